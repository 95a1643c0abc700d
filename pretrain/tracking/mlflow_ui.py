"""What a person sees in MLflow's web UI: links that open the classic (model training) view.

Metric names. Every store gets the trainer's names (``train/loss``, ``perf/mfu``, ``eval/loss``):
a metric's name is its identity, and clients read MLflow by name (``get_metric_history(run,
"train/loss")``, ``search_runs(order_by=["metrics.`eval/loss` ASC"])``). MLflow 3's chart page sorts
sections by the part of the name before the last ``/`` (``downstream``, ``eval``, ``health``, ``perf``,
``train``, then MLflow's system metrics); its search box and pinned charts put the headline first
(docs/watching.md, "Watching a run in MLflow"). Checkpoints are tags and artifacts, not a metric.

Links. MLflow 3 opens an experiment in its GenAI layout whatever the experiment's tags say; the
mode comes from the URL (``?workflowType=machine_learning`` after the hash route) or the browser's
storage. Every link we print carries it; MLflow's own "View run" lines (without it) are turned off.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from data_prep.common.commands import script_command
from pretrain.config import loader as configlib

CLASSIC_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default


def ui_base(tracking_uri: str) -> str:
    """The UI's address for a tracking URI: the server itself, or `mlflow ui`'s default for a local store."""
    if urlparse(tracking_uri).scheme in ("http", "https"):
        return configlib.redact(tracking_uri).rstrip("/").replace("***@", "")  # a link to share, no login in it
    return LOCAL_UI


def ui_command(tracking_uri: str) -> str:
    """What serves a local store's runs at ``LOCAL_UI``, for the user to copy (absolute paths)."""
    return script_command("mlflow", "ui", "--backend-store-uri", tracking_uri)


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{CLASSIC_VIEW}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's chart page in the classic view."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?{CLASSIC_VIEW}"


def quiet_mlflow_links() -> None:
    """MLflow's client prints its own run and experiment links (GenAI view) when a run ends."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
