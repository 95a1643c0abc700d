"""Talking to an MLflow server within its limits: where the run is stored, how big a request may
be, how long an HTTP call may take and whether a failed one is worth retrying, and the tags that
record what produced a run. The buffering and the background sender are in ``mlflow_tracker``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import socket
import subprocess
import sys
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from mlflow.exceptions import MlflowException

from pretrain.config import loader as configlib

log = logging.getLogger(__name__)

# MLflow's own limits (mlflow.utils.validation); a request over them is rejected as a whole.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000
MAX_BATCH_BYTES = 500_000  # the server refuses log-batch bodies over 1 MB; stay well under
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000

METRIC_NAME = re.compile(r"^[A-Za-z0-9_\-. :/]{1,250}$")  # what the server accepts
_HTTP_ENV_SET_BY_US: dict[str, str] = {}


def default_local_store(out_dir: str) -> tuple[str, str]:
    """(tracking URI, artifact root) of the store used when no server is configured.

    A SQLite database, not the ``./mlruns`` file store: MLflow 3 keeps the file store in
    maintenance mode and made SQLite its default. ``mlflow ui --backend-store-uri <uri>`` shows it.
    """
    root = Path(out_dir).resolve() / "mlruns"
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


def resolve_tracking_uri(cfg) -> tuple[str, Optional[str]]:
    """(URI, artifact root for experiments this tracker creates, or None: the server decides)."""
    uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri, None
    return default_local_store(cfg.train.out_dir)


def limit_http_retries(request_timeout_s: float) -> None:
    """MLflow's HTTP client by default retries a refused request for minutes with a 120 s timeout;
    the flusher does its own retrying, so each request should fail fast. These are process-wide
    environment variables (MLflow reads them per request); values a user exported are kept."""
    wanted = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(request_timeout_s))),
    }
    for name, value in wanted.items():
        current = os.environ.get(name)
        if current is None or _HTTP_ENV_SET_BY_US.get(name) == current:
            os.environ[name] = value
            _HTTP_ENV_SET_BY_US[name] = value


@contextmanager
def longer_http_timeout(seconds: int):
    name = "MLFLOW_HTTP_REQUEST_TIMEOUT"
    before = os.environ.get(name)
    if before is not None and _HTTP_ENV_SET_BY_US.get(name) != before:
        yield  # the user chose a timeout: keep it
        return
    os.environ[name] = str(seconds)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def retriable(exc: BaseException) -> bool:
    """Server down, overloaded or timing out: keep the data and retry. A request the server
    rejects (4xx) would fail again; a programming error too."""
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status == 429
    return not isinstance(exc, (TypeError, ValueError, KeyError, AttributeError, NameError))


def short_reason(exc: BaseException) -> str:
    text = str(exc)
    for needle, reason in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
        ("RemoteDisconnected", "disconnected"),
    ):
        if needle in text:
            return reason
    return text.splitlines()[0][:200] if text else type(exc).__name__


def param_value(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (list, tuple, dict)) else str(v)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        suffix = "...[truncated]"
        text = text[: MAX_PARAM_VAL_LENGTH - len(suffix)] + suffix
    return text


def environment_tags(world_size: int) -> dict[str, str]:
    """What produced the run: package versions, git commit, launch command, world size."""
    tags = {
        "env.python": sys.version.split()[0],
        "env.hostname": socket.gethostname(),
        "env.world_size": str(world_size),
        "env.launch_command": configlib.redact(shlex.join(sys.argv))[:MAX_TAG_VAL_LENGTH],
        "mlflow.source.name": sys.argv[0] if sys.argv and sys.argv[0] else "python",
    }
    for pkg in ("torch", "deepspeed", "transformers", "mlflow", "datasets", "tokenizers"):
        try:
            tags[f"env.{pkg}"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            tags[f"env.{pkg}"] = "not installed"
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            tags["env.git_dirty"] = str(bool(dirty.stdout.strip())).lower()
    except (OSError, subprocess.SubprocessError):
        pass  # no git here: the commit is simply not recorded
    return tags


def one_request(head: list) -> list:
    """The longest run of queued items at the head of the tracker's queue that one request can
    carry: metrics, params and tags batch together within MLflow's limits; anything else alone."""
    if not head:
        return []
    if head[0][0] not in ("metric", "param", "tag"):
        return head[:1]
    batch, counts, size = [], {"metric": 0, "param": 0, "tag": 0}, 0
    limits = {"metric": MAX_METRICS_PER_BATCH, "param": MAX_PARAMS_TAGS_PER_BATCH, "tag": MAX_PARAMS_TAGS_PER_BATCH}
    for item in head:
        kind = item[0]
        if kind not in limits:
            break
        item_size = 80 + len(item[1]) + (len(item[2]) if kind != "metric" else 0)
        if counts[kind] == limits[kind] or (batch and size + item_size > MAX_BATCH_BYTES):
            break
        counts[kind] += 1
        size += item_size
        batch.append(item)
    return batch


def experiment_id(call, client, name: str, artifact_root: Optional[str]) -> str:
    """The id of experiment ``name``: created (or restored from deletion) when needed. ``call``
    runs one client request (the tracker's retry and outage handling)."""
    exp = call(client.get_experiment_by_name, name)
    if exp is None:
        try:
            # Without this tag MLflow 3's UI opens the experiment in its GenAI layout.
            return call(
                client.create_experiment,
                name,
                artifact_location=artifact_root,
                tags={"mlflow.experimentKind": "custom_model_development"},
            )
        except MlflowException as exc:  # created meanwhile by another job
            exp = call(client.get_experiment_by_name, name)
            if exp is None:
                raise exc
    if exp.lifecycle_stage != "active":
        log.warning("MLflow: experiment %r was deleted; restoring it", name)
        call(client.restore_experiment, exp.experiment_id)
    return exp.experiment_id


def last_logged_steps(call, client, run) -> dict[str, int]:
    """Per metric, the largest step a continued run already holds."""
    # run.data keeps, per metric, the point at the largest step; MLflow's own system-metrics
    # resume reads it the same way. The fallback reads whole histories (slow on long runs).
    objs = getattr(run.data, "_metric_objs", None)
    if objs is not None:
        return {m.key: int(m.step) for m in objs}
    return {
        key: max(int(m.step) for m in call(client.get_metric_history, run.info.run_id, key)) for key in run.data.metrics
    }
