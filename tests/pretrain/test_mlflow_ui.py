"""What a person sees in MLflow's web UI, checked in headless Chromium against a real server: the run
page opens in the classic view from the link we log, and its chart page shows the trainer's metric
names in sections ordered by name, as docs/watching.md says (``pretrain/tracking/mlflow_ui.py``)."""

from __future__ import annotations

import logging
import re

import pytest

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient

from browser import page_text
from mlflow_server import mlflow_server  # noqa: F401  (a fixture)
from pretrain.tracking.mlflow_tracker import MlflowTracker
from test_tracking_mlflow import make_cfg

pytestmark = pytest.mark.slow

# Every metric name the trainer logs, plus those of per-layer health, per-source eval and probes.
TRAINER_METRICS = [
    "train/loss",
    "train/accuracy",
    "train/lr",
    "train/grad_norm",
    "train/tokens_seen",
    "train/nonfinite_skipped",
    "perf/tokens_per_s",
    "perf/samples_per_s",
    "perf/mfu",
    "perf/step_time_s",
    "perf/data_wait_s",
    "perf/memory_gb",
    "eval/loss",
    "eval/accuracy",
    "eval/wiki/loss",
    "health/embeddings/grad_norm",
    "health/layer_00/grad_norm",
    "downstream/word_order/accuracy",
]


def sections(lines: list[str]) -> list[str]:
    """The chart page's section headers ("name", "(count)", "Add chart"), in page order."""
    return [
        lines[i]
        for i in range(len(lines) - 2)
        if re.fullmatch(r"\(\d+\)", lines[i + 1]) and lines[i + 2] == "Add chart"
    ]


def test_run_link_opens_the_classic_view_with_the_trainers_names_in_sections(tmp_path, mlflow_server, caplog):  # noqa: F811
    cfg = make_cfg(tmp_path, mlflow_server.uri)
    tracker = MlflowTracker(cfg)
    with caplog.at_level(logging.INFO):
        run_id = tracker.start(None, {"a": 1}, {})
    for step in range(1, 11):
        tracker.log_metrics({k: float(step) for k in TRAINER_METRICS}, step)
        tracker.log_checkpoint(f"step{step:08d}", step, str(tmp_path / "ckpt"))
    tracker.finish()
    run = MlflowClient(mlflow_server.uri).get_run(run_id)
    assert set(run.data.metrics) == set(TRAINER_METRICS)  # the trainer's names; no checkpoint metric
    link = re.search(r"watch the run at (\S+)", caplog.text).group(1)
    assert link == (
        f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}/model-metrics"
        "?workflowType=machine_learning"
    )

    lines = page_text(link)
    assert "Model metrics" in lines and "Model training" in lines, lines[:60]  # the classic run page
    found = sections(lines)
    prefixes = {k.rsplit("/", 1)[0] for k in TRAINER_METRICS}
    assert [s for s in found if s in prefixes] == sorted(prefixes), found  # by name, as docs/watching.md says
    # Sections hold the trainer's names, one chart each (only the first screen draws its charts).
    for section in ("train", "perf", "eval"):
        count = sum(k.rsplit("/", 1)[0] == section for k in TRAINER_METRICS)
        assert lines[lines.index(section) + 1] == f"({count})", (section, found)
    assert not [s for s in found if s.startswith("checkpoint")], found
