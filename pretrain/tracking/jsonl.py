"""``metrics.jsonl`` in the run folder: one strict-JSON object per logged step, the record that
needs no server. On resume it keeps only the steps up to the checkpoint, so it reads as one
uninterrupted run; a last line cut short by a kill or a full disk is dropped, not fatal."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from data_prep.common.atomic import write_atomic
from pretrain.tracking.base import Tracker

log = logging.getLogger("pretrain")


def strict_json_value(v):
    """NaN and infinities become null: strict JSON readers reject Python's ``NaN``/``Infinity``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: Path) -> list[dict]:
    """Every complete record of a metrics file; a damaged line is skipped with a warning."""
    records = []
    if not path.is_file():
        return records
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            log.warning("%s line %d is damaged (cut short?): dropped", path, n)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class JsonlTracker(Tracker):
    def __init__(self, out_dir: Path, resume_step: int):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._held = {}  # per metric: the last step the file holds
        for r in kept:
            self._held.update(dict.fromkeys((k for k in r if k != "step"), r.get("step", 0)))
        self._file = open(self.path, "a")

    def log_metrics(self, metrics: dict, step: int) -> None:
        # Each metric once per step, the first value, as MLflow keeps it (it cannot delete a point): a
        # relaunch re-logs the checkpoint step's metrics, evaluates a final checkpoint killed before its
        # export again, and a spike recovery trains the steps after its checkpoint again.
        metrics = {k: v for k, v in metrics.items() if step > self._held.get(k, -1)}
        if not metrics:
            return
        self._held.update(dict.fromkeys(metrics, step))
        record = {"step": step, **{k: strict_json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def log_event(self, name: str, text: str, step: int) -> None:
        """Events go to ``events.jsonl`` beside the metrics (the report marks them on the curves)."""
        with open(self.path.with_name("events.jsonl"), "a") as f:
            f.write(json.dumps({"step": int(step), "event": name, "text": text, "time": time.time()}) + "\n")

    def finish(self, status: str = "FINISHED") -> None:
        if not self._file.closed:
            self._file.close()
