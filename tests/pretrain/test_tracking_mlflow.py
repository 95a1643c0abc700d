"""MlflowTracker against a real ``mlflow server`` (SQLite store) on loopback, checked through MlflowClient.

Time: under a minute on the AMX Xeon, 1.6 minutes on the AVX2-only EPYC under the README's command
(2026-11-29): a real ``mlflow server`` started, stopped and started again (8 of its processes:
imports and the SQLite store's migrations, seconds of CPU each)."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

pytest.importorskip("mlflow")

import mlflow  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from mlflow_server import mlflow_server  # noqa: E402,F401  (a fixture)
from pretrain.config import loader as configlib  # noqa: E402
from pretrain.config.schema import Config  # noqa: E402
from pretrain.runtime.engine import rank0_value  # noqa: E402
from pretrain.tracking import NullTracker, make_tracker  # noqa: E402
from pretrain.tracking.mlflow_requests import default_local_store  # noqa: E402
from pretrain.tracking.mlflow_tracker import MlflowTracker  # noqa: E402

pytestmark = pytest.mark.slow  # every test here launches processes


def make_cfg(tmp_path, uri: str = "", **tracking) -> Config:
    cfg = Config()
    cfg.train.out_dir = str(tmp_path / "run")
    cfg.tracking.tracking_uri = uri
    cfg.tracking.experiment = f"test-{uuid.uuid4().hex[:8]}"
    cfg.tracking.run_name = "tiny"
    cfg.tracking.system_metrics = False
    cfg.tracking.retry_seconds = 1.0
    for k, v in tracking.items():
        setattr(cfg.tracking, k, v)
    return cfg


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def loss(step: int) -> float:
    return 10.0 / (1.0 + step)


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = BertForMaskedLM(config)
    out = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(out)
    return out


def test_new_run_gets_params_artifacts_and_complete_histories(tmp_path, mlflow_server):
    cfg = make_cfg(tmp_path, mlflow_server.uri)
    params = configlib.flatten(configlib.to_dict(cfg))
    # More than one log_batch worth of params (100), and one over MLflow's 6000-char value limit.
    params.update({f"extra.p{i:03d}": i for i in range(150)})
    params["extra.long"] = "x" * 7000
    tracker = make_tracker(cfg, rank=0, jsonl=False)
    assert isinstance(tracker, MlflowTracker)
    assert isinstance(make_tracker(cfg, rank=1), NullTracker)
    run_id = tracker.start(None, params, {"config.yaml": configlib.dump_yaml(cfg), "deepspeed.json": '{"a": 1}'})
    assert run_id and tracker.run_id == run_id
    assert rank0_value(run_id) == run_id  # no process group: unchanged
    steps = range(1, 1201)  # 2,400 points: several 1,000-metric batches
    for s in steps:
        tracker.log_metrics({"train/loss": loss(s), "train/lr": s * 1e-6}, s)
    tracker.log_checkpoint("step_1200", 1200, str(tmp_path / "ckpt" / "step_1200"))
    tracker.finish()

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == cfg.tracking.experiment
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"  # not the GenAI layout
    got = run.data.params
    assert len(got) == len(params)
    assert got["optim.lr"] == str(cfg.optim.lr) and got["optim.betas"] == "[0.9, 0.98]"
    assert got["extra.p149"] == "149"
    assert len(got["extra.long"]) == 6000 and got["extra.long"].endswith("[truncated]")
    assert history(client, run_id, "train/loss") == [(s, pytest.approx(loss(s))) for s in steps]
    assert [s for s, _ in history(client, run_id, "train/lr")] == list(steps)
    tags = run.data.tags
    assert tags["checkpoint/latest"] == "step_1200" and tags["checkpoint/latest_step"] == "1200"
    assert tags["env.mlflow"] == mlflow.__version__ and tags["env.world_size"] == "1"
    assert tags["env.torch"] not in ("", "not installed") and "env.launch_command" in tags
    assert tags["env.deepspeed"]
    dl = tmp_path / "dl"
    dl.mkdir()
    text = open(client.download_artifacts(run_id, "config.yaml", str(dl))).read()
    assert text == configlib.dump_yaml(cfg)  # the YAML the trainer passed, verbatim
    record = open(client.download_artifacts(run_id, "checkpoints/step_1200.json", str(dl))).read()
    assert '"step": 1200' in record and "step_1200" in record


def test_restarted_tracker_continues_the_run_without_duplicate_steps(tmp_path, mlflow_server, monkeypatch):
    cfg = make_cfg(tmp_path, mlflow_server.uri)
    first = MlflowTracker(cfg)
    run_id = first.start(None, {"optim.lr": 5e-4}, {})
    for s in range(1, 31):
        first.log_metrics({"train/loss": loss(s)}, s)
        if s % 10 == 0:
            first.log_metrics({"eval/loss": loss(s) + 1}, s)
    first.log_checkpoint("step_20", 20, "/ckpt/step_20")
    first.finish("KILLED")  # the job died after step 30; last checkpoint 20
    client = MlflowClient(mlflow_server.uri)
    assert client.get_run(run_id).info.status == "KILLED"

    # The relaunch resumes from the step-20 checkpoint and re-runs 21..30 (values marked so that a
    # duplicate or an overwrite would show), then goes on to 40.
    second = MlflowTracker(cfg)
    assert second.start(run_id, {"optim.lr": 1.0}, {"config.yaml": "changed"}) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    for s in range(21, 41):
        second.log_metrics({"train/loss": loss(s) + (100 if s <= 30 else 0)}, s)
        if s % 10 == 0:
            second.log_metrics({"eval/loss": loss(s) + 1}, s)
    second.finish()

    # A third segment continues through $MLFLOW_RUN_ID, as a launcher would pass it.
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    third = MlflowTracker(cfg)
    assert third.start(None, {}, {}) == run_id
    third.log_metrics({"train/loss": loss(41)}, 41)
    third.finish()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"optim.lr": "0.0005"}  # params belong to the run's first launch
    assert history(client, run_id, "train/loss") == [(s, pytest.approx(loss(s))) for s in range(1, 42)]
    # eval/loss was last logged at 30 before the restart: 30 is not repeated, 40 arrives.
    assert history(client, run_id, "eval/loss") == [(s, pytest.approx(loss(s) + 1)) for s in (10, 20, 30, 40)]
    assert [a.path for a in client.list_artifacts(run_id)] == ["checkpoints"]


def test_server_outage_loses_nothing_and_never_blocks(tmp_path, mlflow_server, tiny_bert_dir, caplog):
    """One tracker loses its server mid-run; a second one starts while it is down."""
    caplog.set_level(logging.WARNING, logger="pretrain.tracking.mlflow_tracker")
    cfg = make_cfg(tmp_path, mlflow_server.uri, retry_seconds=1.0)
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(None, {"a": 1}, {})
    client = MlflowClient(mlflow_server.uri)
    for s in range(1, 11):
        tracker.log_metrics({"train/loss": loss(s)}, s)
    deadline = time.monotonic() + 15
    while len(history(client, run_id, "train/loss")) < 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(history(client, run_id, "train/loss")) == 10

    mlflow_server.stop()
    try:
        late = MlflowTracker(make_cfg(tmp_path / "another_job", mlflow_server.uri))  # its own out_dir: a new run
        t0 = time.perf_counter()
        assert late.start(None, {"b": 2}, {"config.yaml": "x: 1\n"}) is None  # no run yet
        assert time.perf_counter() - t0 < 3 * cfg.tracking.retry_seconds
        for s in range(1, 6):
            late.log_metrics({"train/loss": loss(s)}, s)

        slowest = 0.0
        for s in range(11, 41):
            t0 = time.perf_counter()
            tracker.log_metrics({"train/loss": loss(s), "train/tokens_per_s": 1000.0 + s}, s)
            if s == 25:
                tracker.log_checkpoint("step_25", 25, "/ckpt/step_25")
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.05)  # ~1.5 s down: the flusher fails and backs off
        assert slowest < cfg.tracking.retry_seconds / 4
        t0 = time.perf_counter()
        tracker.log_model(str(tiny_bert_dir), 40, final=False)  # one try in a known outage, then queued
        assert time.perf_counter() - t0 < cfg.tracking.retry_seconds
        outage_warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(outage_warnings) == 2  # once per tracker and outage, not per attempt
        assert all("lost if the run ends before the server is back" in r.getMessage() for r in outage_warnings)
        assert any(str(tiny_bert_dir) in r.getMessage() for r in caplog.records)
    finally:
        mlflow_server.start()

    for s in range(41, 51):
        tracker.log_metrics({"train/loss": loss(s), "train/tokens_per_s": 1000.0 + s}, s)
    t0 = time.perf_counter()
    tracker.finish()
    late.finish()
    assert time.perf_counter() - t0 < 30
    assert sum("reachable again" in r.getMessage() for r in caplog.records) == 2

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert history(client, run_id, "train/loss") == [(s, pytest.approx(loss(s))) for s in range(1, 51)]
    assert history(client, run_id, "train/tokens_per_s") == [(s, 1000.0 + s) for s in range(11, 51)]
    assert run.data.tags["checkpoint/latest"] == "step_25"
    assert run.data.tags["hf_model/latest"] == "hf_model/step_40"
    uploaded = {a.path for a in client.list_artifacts(run_id, "hf_model/step_40")}
    assert {"hf_model/step_40/config.json", "hf_model/step_40/model.safetensors"} <= uploaded

    assert late.run_id is not None and late.run_id != run_id
    late_run = client.get_run(late.run_id)
    assert late_run.info.status == "FINISHED" and late_run.data.params == {"b": "2"}
    assert history(client, late.run_id, "train/loss") == [(s, pytest.approx(loss(s))) for s in range(1, 6)]
    assert [a.path for a in client.list_artifacts(late.run_id)] == ["config.yaml"]


def test_hf_model_folder_round_trips_and_registers(tmp_path, mlflow_server, tiny_bert_dir):
    import torch
    from transformers import AutoModelForMaskedLM

    name = f"tiny-mlm-{uuid.uuid4().hex[:6]}"
    cfg = make_cfg(tmp_path, mlflow_server.uri, register_model=name)
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(None, {}, {})
    tracker.log_model(str(tiny_bert_dir), 7, final=False)
    tracker.log_model(str(tiny_bert_dir), 10, final=True)
    tracker.finish()

    client = MlflowClient(mlflow_server.uri)
    assert sorted(a.path for a in client.list_artifacts(run_id, "hf_model")) == ["hf_model/final", "hf_model/step_7"]
    local = mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path="hf_model/final", dst_path=str(tmp_path / "dl"), tracking_uri=mlflow_server.uri
    )
    loaded = AutoModelForMaskedLM.from_pretrained(local)
    original = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    assert loaded.config.hidden_size == 32
    for (k, a), (k2, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    (version,) = client.search_model_versions(f"name='{name}'")
    assert version.run_id == run_id and version.source.endswith("hf_model/final")
    assert client.get_run(run_id).data.tags["hf_model/latest"] == "hf_model/final"


def test_default_local_store_works_without_a_server(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    cfg = make_cfg(tmp_path, "", system_metrics=True)
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(None, {"model.hidden_size": 32}, {"config.yaml": "model: {}\n"})
    for s in range(1, 21):
        tracker.log_metrics({"train/loss": loss(s)}, s)
    time.sleep(1.2)  # a few system-metric samples
    tracker.finish()

    uri, artifacts = default_local_store(cfg.train.out_dir)
    assert uri.startswith("sqlite:///") and uri.endswith("/run/mlruns/mlflow.db")
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"model.hidden_size": "32"}
    assert history(client, run_id, "train/loss") == [(s, pytest.approx(loss(s))) for s in range(1, 21)]
    assert run.info.artifact_uri.startswith(artifacts)
    assert (
        tmp_path / "run" / "mlruns" / "artifacts" / run_id / "artifacts" / "config.yaml"
    ).read_text() == "model: {}\n"
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert len(cpu) >= 2 and sorted(m.step for m in cpu) == list(range(len(cpu)))


def test_same_out_dir_continues_its_run_even_without_a_checkpointed_id(mlflow_server, tmp_path):
    """A job whose checkpoint was written while the server was down has no run id in it; the next
    launch in the same out_dir still continues that job's run (via out_dir/mlflow_run_id)."""
    first = MlflowTracker(make_cfg(tmp_path, mlflow_server.uri))
    run_id = first.start(None, {"a": 1}, {})
    first.log_metrics({"train/loss": 1.0}, 1)
    first.finish("KILLED")
    cfg = make_cfg(tmp_path, mlflow_server.uri)
    cfg.tracking.experiment = first.cfg.tracking.experiment
    second = MlflowTracker(cfg)
    assert second.start(None, {"a": 1}, {}) == run_id
    second.log_metrics({"train/loss": 0.5}, 2)
    second.finish()
    client = MlflowClient(mlflow_server.uri)
    assert [step for step, _ in history(client, run_id, "train/loss")] == [1, 2]
    assert len(client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])) == 1


@pytest.mark.slow
def test_the_server_launcher_runs_as_a_user_runs_it(tmp_path):
    """Issue 61, item 2: `bash launchers/mlflow_server.sh` from another directory with a bare PATH (no
    virtualenv on it) ran `python -m mlflow`, printed its UI line and died; the trainer's buffered
    metrics were then lost. It now runs the project's interpreter, serves, and takes a metric."""
    import os
    import signal
    import subprocess
    import urllib.request

    from conftest import REPO, free_port

    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        ["bash", str(REPO / "launchers" / "mlflow_server.sh"), "--dir", "store", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer in 90 s"
                time.sleep(0.5)
        client = MlflowClient(f"http://127.0.0.1:{port}")
        run = client.create_run(client.create_experiment("launcher"))
        client.log_metric(run.info.run_id, "train/loss", 2.5, step=1)
        assert [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2.5]
        assert (tmp_path / "store" / "mlflow.db").is_file()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # a machine without the project's environment is told so, before anything is printed
    bare = subprocess.run(
        ["/bin/bash", str(REPO / "launchers" / "mlflow_server.sh"), "--port", str(port)],
        cwd=tmp_path,
        env={**env, "PYTHON": "/nonexistent/python", "PATH": str(tmp_path / "empty")},
        capture_output=True,
        text=True,
    )
    assert (bare.returncode, bare.stdout) == (2, ""), (bare.returncode, bare.stdout, bare.stderr)
    assert "mlflow_server.sh: no Python with mlflow" in bare.stderr and "setup_env.sh" in bare.stderr, bare.stderr


def test_a_server_that_never_answers_is_said_again_with_what_would_be_lost(tmp_path, caplog, monkeypatch):
    """A run pointed at a server that is not running buffers its metrics for the whole run: said at the
    first failure and again every REMIND_EVERY_S (here 1 s) with the count, not only at the end."""
    from conftest import free_port
    from pretrain.tracking import mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "REMIND_EVERY_S", 1.0)
    monkeypatch.setattr(mlflow_tracker, "MAX_BACKOFF_S", 0.5)
    caplog.set_level(logging.WARNING, logger="pretrain.tracking.mlflow_tracker")
    tracker = MlflowTracker(make_cfg(tmp_path, f"http://127.0.0.1:{free_port()}", retry_seconds=0.2))
    tracker.start(None, {"a": 1}, {})
    for s in range(1, 6):
        tracker.log_metrics({"train/loss": loss(s)}, s)
    deadline = time.monotonic() + 20
    while not any("still unreachable" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.2)
    tracker.final_flush_seconds = 1.0
    tracker.finish("FINISHED")
    reminder = next(r.getMessage() for r in caplog.records if "still unreachable" in r.getMessage())
    assert "items buffered, lost if the run ends before it is back" in reminder, reminder
