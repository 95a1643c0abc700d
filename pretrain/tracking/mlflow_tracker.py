"""MLflow implementation of :class:`pretrain.tracking.base.Tracker` (rank 0 only).

The training loop must never wait on a tracking server. Every call here only appends to an
in-memory, ordered buffer; one background thread owns all network traffic: it opens the run,
sends the buffer in ``log_batch`` requests within MLflow's limits, and when the server is
unreachable warns once per outage, backs off and retries, so that when the server is back every
point arrives, in order. Retries are idempotent: each point keeps the timestamp it was logged
with, and MLflow's SQL stores drop a re-sent point that is identical in every field.

On a continued run (``run_id`` from a checkpoint, or ``$MLFLOW_RUN_ID``) points at a step the run
already holds for that metric are dropped, because the trainer re-runs the steps after its last
checkpoint.

Only ``log_model`` (Hugging Face export upload) and ``finish`` (final flush) wait, and both are
bounded.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from data_prep.common.atomic import write_atomic
from pretrain import metric_names as names
from pretrain.config.loader import flatten
from pretrain.tracking.base import Tracker
from pretrain.tracking.mlflow_requests import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
    METRIC_NAME,
    environment_tags,
    experiment_id,
    last_logged_steps,
    limit_http_retries,
    longer_http_timeout,
    one_request,
    param_value,
    resolve_tracking_uri,
    retriable,
    short_reason,
)
from pretrain.tracking.mlflow_system import start_system_metrics
from pretrain.tracking.mlflow_ui import quiet_mlflow_links, ui_command
from pretrain.tracking.mlflow_ui import run_url as classic_run_url

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0  # how often the buffer is sent while the server is up
MAX_BACKOFF_S = 30.0  # an outage is retried at least this often
REMIND_EVERY_S = 600.0  # an outage that lasts is said again, with what would be lost
MAX_BUFFERED = 2_000_000  # ~200 MB of points; beyond it new points are dropped (with a warning)
UPLOAD_TIMEOUT_S = 60  # per-socket-operation timeout while uploading a model folder
UPLOAD_ATTEMPTS = 3


class _Unreachable(Exception):
    pass


class MlflowTracker(Tracker):
    """See the module docstring. ``cfg`` is the full :class:`pretrain.config.schema.Config`.

    ``run_id`` is None until the run exists on the server; when the server is down at
    :meth:`start` the run is created in the background once it is reachable, so read
    ``tracker.run_id`` (not the value :meth:`start` returned) when writing a checkpoint.
    """

    def __init__(self, cfg, final_flush_seconds: float = 45.0, resume_step: int = 0):
        self.cfg, self.resume_step = cfg, resume_step
        self.tracking_uri, self._artifact_root = resolve_tracking_uri(cfg)
        self.retry_seconds = max(0.1, float(cfg.tracking.retry_seconds))
        self.final_flush_seconds = final_flush_seconds
        limit_http_retries(self.retry_seconds)
        quiet_mlflow_links()
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self.run_id: Optional[str] = None

        self._cond = threading.Condition()
        # Ordered items: ("metric", key, value, ts_ms, step) | ("param"|"tag", key, value)
        # | ("text", artifact_file, content) | ("dir", local_dir, artifact_path)
        # | ("register", model_name, artifact_path, local_dir) | ("terminate", status)
        self._queue: deque = deque()
        self._closing = threading.Event()  # finish() was called: flush now, retry often
        self._first_attempt_done = threading.Event()
        self._stop_sampler = threading.Event()
        self._want_run: Optional[str] = None
        self._init: tuple[dict, dict] = ({}, {})
        self._last_step: dict[str, int] = {}  # per metric: the largest step the run already held
        self._skipped_resumed = 0  # points of steps after the resumed checkpoint the run already held
        self._outage_since: Optional[float] = None
        self._reminded_at = 0.0
        self._dropped_full = False
        self._rejected = 0
        self._bad_keys: set[str] = set()
        self._thread: Optional[threading.Thread] = None
        self._finished = False
        self._stopped = False  # the flusher gave up (finish() timed out, or a bug)

    # ---------------------------------------------------------------- the trainer's side
    def start(self, run_id: Optional[str], params: dict[str, Any], artifacts: dict[str, str]) -> Optional[str]:
        if self._thread is not None:
            return self.run_id
        self._want_run = run_id or os.environ.get("MLFLOW_RUN_ID") or self._run_id_file() or None
        self._init = (dict(params), dict(artifacts))
        self._thread = threading.Thread(target=self._flusher, name="mlflow-flusher", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        # One attempt, bounded by the HTTP timeout (or a local database's first migration), so a
        # reachable server gives the trainer a run id to put in its first checkpoint.
        self._first_attempt_done.wait(timeout=120)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        points = []
        for key, value in metrics.items():
            if key not in self._bad_keys and not METRIC_NAME.match(key):
                self._bad_keys.add(key)
                log.warning("MLflow: metric name %r has characters MLflow rejects; it is not logged", key)
            if key in self._bad_keys:
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                log.warning("MLflow: metric %r = %r at step %s is not a number; skipped", key, value, step)
                continue
            if math.isfinite(value):  # a NaN point would break the UI's charts
                points.append(("metric", key, value, now, int(step)))
        self._enqueue(points)

    def log_checkpoint(self, tag: str, step: int, path: str) -> None:
        record = {"tag": tag, "step": int(step), "path": str(path), "time": time.time()}
        # No metric: a "checkpoint" chart section would sort first on MLflow's chart page.
        self._enqueue(
            [
                ("tag", "checkpoint/latest", str(tag)),
                ("tag", "checkpoint/latest_step", str(int(step))),
                ("tag", "checkpoint/latest_path", str(path)[:MAX_TAG_VAL_LENGTH]),
                # One small file per checkpoint: listing checkpoints/ is the index, with nothing to
                # read back and rewrite after a restart.
                ("text", f"checkpoints/{tag}.json", json.dumps(record, indent=1)),
            ]
        )

    def log_event(self, name: str, text: str, step: int) -> None:
        # A tag per kind (the latest) and a text file per event (all of them, in order).
        self._enqueue(
            [
                ("tag", f"event/{name}", f"step {int(step)}: {text}"[:MAX_TAG_VAL_LENGTH]),
                ("text", f"events/{int(time.time() * 1000)}-{name}.txt", f"step {int(step)}: {text}\n"),
            ]
        )

    def log_model(self, hf_dir: str, step: int, final: bool) -> None:
        """Uploads now (bounded retries; one try during a known outage). What fails is queued and
        retried in the background, so ``hf_dir`` should stay in place; it is named in the warning."""
        artifact_path = "hf_model/final" if final else f"hf_model/step_{int(step)}"
        ops = [("dir", str(hf_dir), artifact_path), ("tag", "hf_model/latest", artifact_path)]
        if final and self.cfg.tracking.register_model:
            ops.append(("register", self.cfg.tracking.register_model, artifact_path, str(hf_dir)))
        attempts = 0 if self.run_id is None else 1 if self._outage_since is not None else UPLOAD_ATTEMPTS
        delay = self.retry_seconds
        for attempt in range(1, attempts + 1):
            try:
                while ops:
                    self._send([ops[0]])
                    ops.pop(0)
                return
            except _Unreachable as exc:
                if attempt < attempts:
                    log.info("MLflow: upload of %s failed (%s); retrying in %.1fs", hf_dir, exc, delay)
                    time.sleep(delay)
                    delay *= 2
        log.warning(
            "MLflow: %s not reachable; uploading %s as %s is left to the background (keep the folder until then)",
            self.tracking_uri,
            hf_dir,
            artifact_path,
        )
        self._enqueue(ops)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        # Sent by the background thread like everything else, so finish() bounds the wait for it.
        self._enqueue([("dir", str(local_dir), artifact_path)])

    def finish(self, status: str = "FINISHED") -> None:
        if self._finished:
            return
        self._finished = True
        self._stop_sampler.set()
        if self._thread is None:
            return
        self._enqueue([("terminate", status)], force=True)
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=self.final_flush_seconds)
        self._stopped = True
        if self._skipped_resumed:
            log.info(
                "MLflow: %d re-run points were not logged again (the run already held those steps)",
                self._skipped_resumed,
            )
        if self._thread.is_alive():
            with self._cond:
                left = len(self._queue)
            log.warning(
                "MLflow: %d buffered items could not be sent to %s within %.0fs and are lost "
                "(run %s stays RUNNING there)",
                left,
                self.tracking_uri,
                self.final_flush_seconds,
                self.run_id,
            )

    def _at_exit(self) -> None:
        # The trainer calls finish(); this only covers an exit that skipped it.
        if not self._finished:
            self.final_flush_seconds = min(self.final_flush_seconds, 10.0)
            self.finish("KILLED")

    # ---------------------------------------------------------------- buffer
    def _enqueue(self, items: list, force: bool = False) -> None:
        if not items:
            return
        if self._stopped:
            return
        with self._cond:
            if len(self._queue) + len(items) > MAX_BUFFERED and not force:
                if not self._dropped_full:
                    self._dropped_full = True
                    log.warning(
                        "MLflow: %d items buffered for %s; dropping new ones until it is reachable",
                        len(self._queue),
                        self.tracking_uri,
                    )
                return
            self._queue.extend(items)
            if len(self._queue) >= MAX_METRICS_PER_BATCH:
                self._cond.notify_all()

    def _next_batch(self) -> list:
        """The longest run of queued items at the head that one request can carry."""
        with self._cond:
            head = list(itertools.islice(self._queue, 0, MAX_ENTITIES_PER_BATCH))
        return one_request(head)

    # ---------------------------------------------------------------- background thread
    def _flusher(self) -> None:
        delay = self.retry_seconds
        while not self._stopped:
            try:
                if self.run_id is None:
                    try:
                        self._open()
                    finally:
                        self._first_attempt_done.set()
                done = self._drain()
                if self._outage_since is not None:
                    log.warning(
                        "MLflow: %s reachable again after %.0fs; buffered data sent",
                        self.tracking_uri,
                        time.time() - self._outage_since,
                    )
                    self._outage_since = None
                delay = self.retry_seconds
                if done:
                    return
                with self._cond:
                    if not self._closing.is_set() and len(self._queue) < MAX_METRICS_PER_BATCH:
                        self._cond.wait(timeout=FLUSH_INTERVAL_S)
            except _Unreachable as exc:
                if self._outage_since is None:
                    self._outage_since = time.time()
                    with self._cond:
                        n = len(self._queue)
                    self._reminded_at = self._outage_since
                    log.warning(
                        "MLflow: tracking server %s unreachable (%s); training continues, %d items "
                        "buffered in memory, retrying every <=%.0fs; what is buffered is lost if the run "
                        "ends before the server is back (metrics.jsonl in train.out_dir keeps every metric)",
                        self.tracking_uri,
                        exc,
                        n,
                        MAX_BACKOFF_S,
                    )
                elif time.time() - self._reminded_at >= REMIND_EVERY_S:
                    self._reminded_at = time.time()
                    with self._cond:
                        n = len(self._queue)
                    log.warning(
                        "MLflow: tracking server %s still unreachable after %.0f min: %d items buffered, "
                        "lost if the run ends before it is back (is the server running? "
                        "launchers/mlflow_server.sh)",
                        self.tracking_uri,
                        (time.time() - self._outage_since) / 60,
                        n,
                    )
                if self._closing.is_set():
                    time.sleep(min(self.retry_seconds, 1.0))
                else:
                    self._closing.wait(timeout=delay)
                    delay = min(delay * 2, MAX_BACKOFF_S)
            except Exception:  # noqa: BLE001 - the tracker must outlive its own bugs; training goes on
                log.exception("MLflow: unexpected error in the background flusher; tracking stops")
                self._stopped = True
                self._first_attempt_done.set()
                return

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if retriable(exc):
                raise _Unreachable(short_reason(exc)) from exc
            raise

    def _drain(self) -> bool:
        """Send everything queued. True when the terminate item was sent (the thread may end)."""
        while True:
            batch = self._next_batch()
            if not batch:
                return False
            kind = batch[0][0]
            if kind == "terminate":
                self._call(self.client.set_terminated, self.run_id, batch[0][1])
                self._pop(1)
                return True
            self._send(batch)
            self._pop(len(batch))

    def _pop(self, n: int) -> None:
        with self._cond:
            for _ in range(n):
                self._queue.popleft()

    def _send(self, batch: list) -> None:
        """One request. A rejected request is split to find and drop the offending items."""
        try:
            kind = batch[0][0]
            if kind == "text":
                self._call(self.client.log_text, self.run_id, batch[0][2], batch[0][1])
                return
            if kind == "dir":
                self._upload(batch[0][1], batch[0][2])
                return
            if kind == "register":
                self._register(*batch[0][1:3])
                return
            metrics, params, tags = [], [], []
            for item in batch:
                if item[0] == "metric":
                    _, key, value, ts, step = item
                    if step <= self._last_step.get(key, -1):
                        # the checkpoint's own step is logged again on every resume (resume_log.relog):
                        # only steps after it were really run twice
                        self._skipped_resumed += step > self.resume_step
                        continue
                    metrics.append(Metric(key, value, ts, step))
                elif item[0] == "param":
                    params.append(Param(item[1], item[2]))
                else:
                    tags.append(RunTag(item[1], item[2]))
            if metrics or params or tags:
                self._call(self.client.log_batch, self.run_id, metrics=metrics, params=params, tags=tags)
        except _Unreachable:
            raise
        except Exception as exc:  # noqa: BLE001 - rejected by the server: retrying would not help
            if len(batch) > 1:
                half = len(batch) // 2
                self._send(batch[:half])
                self._send(batch[half:])
                return
            self._rejected += 1
            if self._rejected <= 5 or batch[0][0] in ("dir", "register"):
                log.warning("MLflow: the server rejected %r (%s); dropped", batch[0][:3], exc)

    def _requested_run(self):
        """The run to continue (a resumed job's), or None: none asked for, not found, or deleted."""
        if not self._want_run:
            return None
        run = None
        try:
            run = self._call(self.client.get_run, self._want_run)
        except _Unreachable:
            raise
        except MlflowException as exc:
            log.warning(
                "MLflow: run %s not found on %s (%s); starting a new run", self._want_run, self.tracking_uri, exc
            )
        if run is not None and run.info.lifecycle_stage != "active":
            log.warning("MLflow: run %s was deleted; starting a new run", self._want_run)
            run = None
        return run

    def _open(self) -> None:
        """Continue the requested run or create one; queue what a new run gets first."""
        run = self._requested_run()
        params, artifacts = self._init
        init: list = []
        if run is not None:
            if run.info.status != "RUNNING":
                self._call(self.client.update_run, run.info.run_id, status="RUNNING")
            self._last_step = last_logged_steps(self._call, self.client, run)
            log.info(
                "MLflow: continuing run %s (%d metrics already logged, up to step %s)",
                run.info.run_id,
                len(self._last_step),
                max(self._last_step.values(), default=None),
            )
        else:
            exp_id = experiment_id(self._call, self.client, self.cfg.tracking.experiment, self._artifact_root)
            parent = self.cfg.tracking.parent_run_id
            run = self._call(
                self.client.create_run,
                exp_id,
                run_name=self.cfg.tracking.run_name or None,
                tags={"mlflow.parentRunId": parent} if parent else None,
            )
            init += [("param", k[:250], param_value(v)) for k, v in flatten(params).items()]
            init += [("text", name, content) for name, content in artifacts.items()]
            log.info(
                "MLflow: run %s (%s) in experiment %r at %s",
                run.info.run_id,
                run.info.run_name,
                self.cfg.tracking.experiment,
                self.tracking_uri,
            )
        self.run_url = classic_run_url(self.tracking_uri, run.info.experiment_id, run.info.run_id)
        log.info("MLflow: watch the run at %s", self.run_url)
        init += [("tag", k, v) for k, v in environment_tags(self.cfg.world_size()).items()]
        with self._cond:
            self._queue.extendleft(reversed(init))
        self.run_id = run.info.run_id
        self._remember_run_id()
        if self._artifact_root:
            log.info("MLflow: local store; view it with %s", ui_command(self.tracking_uri))
        if self.cfg.tracking.system_metrics:
            steps = [s for k, s in self._last_step.items() if k.startswith(names.SYSTEM)]
            start_system_metrics(
                self.run_id,
                self.tracking_uri,
                self._enqueue,
                self._stop_sampler,
                first_step=max(steps) + 1 if steps else 0,
            )

    # A checkpoint written while the server was unreachable holds no run id; this file, written as
    # soon as the run exists, lets the next launch of the same job continue that run.
    def _run_id_path(self) -> Path:
        return Path(self.cfg.train.out_dir) / "mlflow_run_id"

    def _run_id_file(self) -> Optional[str]:
        path = self._run_id_path()
        return path.read_text().strip() if path.is_file() else None

    def _remember_run_id(self) -> None:
        path = self._run_id_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, self.run_id + "\n")
        except OSError as exc:
            log.warning("MLflow: could not write %s (%s)", path, exc)

    def _upload(self, local_dir: str, artifact_path: str) -> None:
        if not os.path.isdir(local_dir):
            raise FileNotFoundError(f"{local_dir} no longer exists; nothing to upload as {artifact_path}")
        with longer_http_timeout(UPLOAD_TIMEOUT_S):
            self._call(self.client.log_artifacts, self.run_id, local_dir, artifact_path)
        log.info("MLflow: uploaded %s as %s", local_dir, artifact_path)

    def _register(self, name: str, artifact_path: str) -> None:
        try:
            self._call(self.client.create_registered_model, name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"{self._call(self.client.get_run, self.run_id).info.artifact_uri}/{artifact_path}"
        version = self._call(self.client.create_model_version, name, source, run_id=self.run_id)
        log.info("MLflow: registered %s as model %r version %s", source, name, version.version)
