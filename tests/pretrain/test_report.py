"""The run report (``python -m pretrain.report`` and the trainer's end of run): every figure the
metrics allow is drawn, decodes in headless Chromium, and the MLflow run holds the report.

One real 2-rank run against a real ``mlflow server`` (with eval and a downstream probe); a copy of
its ``metrics.jsonl`` with the rows other parts of the trainer write (per-layer health, per-source
eval, a non-finite skip and a spike recovery) checks the figures that this run cannot produce.

Time: under a minute on the AMX Xeon, 1.4 minutes on the AVX2-only EPYC under the README's command
(2026-11-29): the real 2-rank run and its ``mlflow server``, and headless Chromium decoding every
figure."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient

from browser import decoded_images, screenshot
from conftest import run_module
from mlflow_server import mlflow_server  # noqa: F401  (a fixture)
from test_tracking_train import only_run, train

pytestmark = pytest.mark.slow


@pytest.fixture
def shots(tmp_path) -> Path:
    """Where screenshots go: $SCREENSHOT_DIR to keep and look at them, else the test's tmp folder."""
    import os

    folder = Path(os.environ.get("SCREENSHOT_DIR") or tmp_path / "shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def finished_run(shards, tmp_path_factory, mlflow_server):  # noqa: F811  # noqa: F811
    tmp = tmp_path_factory.mktemp("report_run")
    experiment, out = f"report-{uuid.uuid4().hex[:8]}", tmp / "run"
    proc = train(
        shards,
        out,
        mlflow_server.uri,
        experiment,
        "train.max_steps=6",
        "train.eval_every=3",
        "train.checkpoint_every=3",
        "eval.downstream=[{path: word_order, max_examples: 100}]",
        "eval.downstream_every=3",
        "tracking.report=true",
    )
    return out, experiment, proc


def test_end_of_run_report_renders_and_is_an_mlflow_artifact(finished_run, mlflow_server, tmp_path, shots):  # noqa: F811  # noqa: F811
    out, experiment, proc = finished_run
    report = out / "report"
    assert sorted(p.name for p in report.glob("*.png")) == ["loss.png", "probes.png", "throughput.png"]
    images = decoded_images(report / "report.html")
    assert len(images) == 3 and all(i["complete"] and i["w"] == 900 and i["h"] == 420 for i in images), images
    html = (report / "report.html").read_text()
    assert "step00000006" in html and str((out / "hf_final").resolve()) in html  # where things are
    assert "hidden_size: 64" in html and "vocab size</th><td>4096" in html  # config, manifest
    assert "report: " in proc.stdout, proc.stdout[-3000:]  # its cost is logged
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert f"/runs/{run_id}/model-metrics?workflowType=machine_learning</a>" in html  # the MLflow run's page

    client = MlflowClient(mlflow_server.uri)
    run_id = only_run(client, experiment).info.run_id
    assert {a.path for a in client.list_artifacts(run_id, "report")} == {
        "report/report.html",
        "report/loss.png",
        "report/probes.png",
        "report/throughput.png",
    }
    got = Path(client.download_artifacts(run_id, "report/report.html", str(tmp_path)))
    assert got.read_bytes() == (report / "report.html").read_bytes()

    shot = screenshot((report / "report.html").as_uri(), shots / "report.png", budget_ms=3000)
    assert shot.stat().st_size > 20_000  # a page of charts, not a blank page


def health_rows(steps: list[int]) -> list[dict]:
    """Rows as the trainer's per-layer health check writes them; layer_01's gradient grows 10x per
    step, and layer_00's is zero at the last step (a blank cell on the log scale)."""
    rows = []
    for i, step in enumerate(steps):
        row = {
            "step": step,
            "health/embeddings/grad_norm": 0.5,
            "health/layer_00/grad_norm": 1.0,
            "health/layer_01/grad_norm": 10.0**i,
            "health/head/grad_norm": 2.0,
        }
        if i == len(steps) - 1:
            row["health/layer_00/grad_norm"] = 0.0
        rows.append(row)
    return rows


def test_cli_draws_layers_sources_and_marks_skips_and_recoveries(finished_run, tmp_path, shots):
    from pretrain.eval.intervals import wilson
    from pretrain.report.figures import events, grad_norm_heatmap, probe_figure
    from pretrain.tracking.jsonl import read_metrics

    out, _, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("report", "hf_*"))
    rows = read_metrics(copy / "metrics.jsonl")
    rows += health_rows([2, 4, 6])
    rows += [{"step": s, "eval/wiki/loss": 9.0 - s / 3, "eval/code/loss": 8.0 - s / 4} for s in (3, 6)]
    rows += [
        {"step": 4, "train/nonfinite_skipped": 1},
        {"step": 5, "train/spike_recoveries": 1},
        {"step": 6, "train/nonfinite_skipped": 1, "train/spike_recoveries": 1},
    ]
    rows.sort(key=lambda r: r["step"])
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    assert events(rows) == {"non-finite skip": [4], "spike recovery": [5]}
    # The probe's 95% interval as a band around its line: the run logged its test sentences at step 0
    examples = next(
        r["downstream/word_order/test_examples"] for r in rows if "downstream/word_order/test_examples" in r
    )
    assert examples == 19  # a quarter of the sentences the test shards hold out (fewer than max_examples)
    probed = [(r["step"], r["downstream/word_order/accuracy"]) for r in rows if "downstream/word_order/accuracy" in r]
    band = probe_figure(rows).axes[0].collections[0].get_paths()[0].vertices
    for step, accuracy in probed:
        at = band[band[:, 0] == step, 1]
        assert set(at.round(9)) == {round(v, 9) for v in wilson(accuracy, examples)}, (step, at)
    heat = grad_norm_heatmap(rows).axes[0].images[0].get_array()
    assert heat.shape == (4, 3)  # embeddings, layer_00, layer_01, head × 3 steps
    assert list(heat[2]) == [1.0, 10.0, 100.0] and heat.mask[1, 2]

    proc = run_module("pretrain.report", copy, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(copy / "report" / "report.html")
    assert sorted(p.stem for p in (copy / "report").glob("*.png")) == [
        "eval_sources",
        "grad_norm_layers",
        "loss",
        "probes",
        "throughput",
    ]
    images = decoded_images(copy / "report" / "report.html")
    assert len(images) == 5 and all(i["complete"] and i["w"] > 0 for i in images), images
    html = (copy / "report" / "report.html").read_text()
    assert "hidden_size: 64" in html  # the config saved with the checkpoint, read back
    screenshot(
        (copy / "report" / "report.html").as_uri(), shots / "report_all_figures.png", size="1200,3800", budget_ms=3000
    )


def test_cli_refuses_a_folder_without_metrics(tmp_path):
    proc = run_module("pretrain.report", tmp_path, timeout=120)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr, proc.stderr
