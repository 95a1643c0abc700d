"""The training loop's companions: metric output, stop signals, per-step seeds, run parameters."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pretrain import configlib

log = logging.getLogger("pretrain")


def dropout_seed(seed: int, step: int, rank: int, micro_step: int) -> int:
    """Dropout draws depend only on where we are, so a resumed run draws exactly the same."""
    digest = hashlib.blake2b(f"dropout:{seed}:{step}:{rank}:{micro_step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit or preemption) and SIGTERM ask the loop to
    finish the current step, checkpoint and exit. Further signals during the save change nothing."""

    def __init__(self, signums=(signal.SIGUSR1, signal.SIGTERM)):
        self.requested = False
        self.name = ""
        for s in signums:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if not self.requested:
            self.name = signal.Signals(signum).name
            print(f"[rank {os.environ.get('RANK', '?')}] received {self.name}: will checkpoint after this step",
                  file=sys.stderr, flush=True)
        self.requested = True


class MetricLog:
    """Rank 0 writes each logged step to the console, ``metrics.jsonl`` and the tracker. On resume
    the file keeps only steps up to the checkpoint, so it reads as one uninterrupted run."""

    def __init__(self, out_dir: Path, rank: int, tracker, resume_step: int):
        self.rank, self.tracker = rank, tracker
        self.path = out_dir / "metrics.jsonl"
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= resume_step]
                self.path.write_text("".join(line + "\n" for line in kept))
            self._file = open(self.path, "a")

    def emit(self, metrics: dict, step: int) -> None:
        if self.rank != 0 or not metrics:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        shown = " ".join(f"{k.removeprefix('train/').removeprefix('perf/')}={_fmt(v)}" for k, v in metrics.items())
        log.info("step %d %s", step, shown)
        self.tracker.log_metrics({k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}, step)

    def close(self, status: str) -> None:
        if self.rank == 0:
            self._file.close()
            self.tracker.finish(status)


def _fmt(v) -> str:
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"


def run_params(cfg, world: int, precision: str, manifest: dict) -> dict:
    """Flat parameters for the tracker: the resolved config plus what the run derived from it."""
    totals = manifest.get("totals", {})
    params = configlib.flatten(configlib.to_dict(cfg))
    params.update({
        "derived.world_size": world,
        "derived.grad_accum_steps": cfg.grad_accum_steps(world),
        "derived.precision": precision,
        "data.seq_len": manifest["seq_len"],
        "data.vocab_size": manifest["tokenizer"]["vocab_size"],
        "data.tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "data.train_tokens": totals.get("train", {}).get("tokens"),
        "data.train_sequences": totals.get("train", {}).get("sequences"),
        "data.train_shards": totals.get("train", {}).get("shards"),
        "launch.command": " ".join(sys.argv),
        "launch.torch": torch.__version__,
    })
    return params
