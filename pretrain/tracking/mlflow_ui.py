"""What a person sees in MLflow's web UI: the metric names that order its chart page, and links that
open the classic (model training) view.

Chart order. MLflow 3.17's run page ("Model metrics") has no ordering setting: it groups a
metric into the section named by everything before the key's last ``/``, sorts sections by name
(JavaScript's default sort: digits before capitals before lower case) with "Model metrics" and
"System metrics" last, and sorts charts within a section by name. With our names, ``checkpoint/``
came first and ``train/`` last. So the MLflow tracker, and only it, renames the headline metrics
into numbered sections that sort first (``metrics.jsonl`` keeps the trainer's names):

    train/loss, train/lr            -> "1 train/loss", "1 train/lr"
    perf/tokens_per_s, perf/mfu     -> "2 perf/mfu", "2 perf/tokens_per_s"
    eval/...                        -> "3 eval/..."  (per-source eval too: "3 eval/<source>/loss")

Everything else keeps its name and follows (``downstream/``, ``health/``, ``perf/``, ``train/``),
then MLflow's own system metrics. Checkpoints are recorded as tags and artifacts, not as a metric.

Links. MLflow 3 opens an experiment in its GenAI layout whatever the experiment's tags say; the
mode comes from the URL (``?workflowType=machine_learning`` after the hash route) or the browser's
storage. Every link we print carries it; MLflow's own "View run" lines (without it) are turned off.
"""
from __future__ import annotations

import os
from urllib.parse import urlparse

HEADLINE = {"train/loss": "1 train/loss", "train/lr": "1 train/lr",
            "perf/tokens_per_s": "2 perf/tokens_per_s", "perf/mfu": "2 perf/mfu"}
EVAL_SECTION = "3 "
CLASSIC_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"      # where `mlflow ui` serves a local store by default


def mlflow_metric_name(key: str) -> str:
    """The name a ``metrics.jsonl`` key gets in MLflow (see the module docstring)."""
    if key in HEADLINE:
        return HEADLINE[key]
    if key.startswith("eval/"):
        return EVAL_SECTION + key
    return key


def ui_base(tracking_uri: str) -> str:
    """The UI's address for a tracking URI: the server itself, or `mlflow ui`'s default for a local store."""
    if urlparse(tracking_uri).scheme in ("http", "https"):
        return tracking_uri.rstrip("/")
    return LOCAL_UI


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{CLASSIC_VIEW}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's chart page in the classic view."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?{CLASSIC_VIEW}"


def quiet_mlflow_links() -> None:
    """MLflow's client prints its own run and experiment links (GenAI view) when a run ends."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
