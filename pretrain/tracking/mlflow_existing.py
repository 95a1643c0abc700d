"""Metrics from a command that is not a training run (``python -m pretrain.evaluate``) into an MLflow
run that already exists, e.g. the training run of the export being evaluated. Unlike the trainer's
tracker this waits on the server: the command has nothing else to do, and its user asked for it."""

from __future__ import annotations

import math
import time
from typing import Optional


def run_problem(run_id: str, tracking_uri: str = "") -> Optional[str]:
    """Why metrics cannot go to this run (checked before any work), or None."""
    from mlflow import MlflowClient

    try:
        MlflowClient(tracking_uri or None).get_run(run_id)
    except Exception as exc:  # unreachable server, unknown run: MLflow raises several types
        return f"--mlflow-run-id {run_id}: not usable at {tracking_uri or '$MLFLOW_TRACKING_URI'} ({exc})"
    return None


def log_metrics_to_run(
    metrics: dict[str, float], run_id: str, tracking_uri: str = "", step: Optional[int] = None
) -> int:
    """The finite ``metrics`` at ``step`` (default: the run's last step, where a training run's final
    export was scored), in one request (MLflow refuses NaN). Returns the step used."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    # lazy: imports mlflow (~1.5 s), as the two lines above, which the evaluate CLI needs only with a run id
    from pretrain.tracking.mlflow_requests import last_logged_steps

    client = MlflowClient(tracking_uri or None)
    if step is None:
        run = client.get_run(run_id)
        step = max(last_logged_steps(lambda f, *a, **k: f(*a, **k), client, run).values(), default=0)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(v)])
    return step
