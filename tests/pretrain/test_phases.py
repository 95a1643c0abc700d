"""Phases: phase 1 at 64 tokens (1 rank, ZeRO 0), then phase 2 at 128 tokens from its checkpoint (2
ranks, ZeRO 2, another global batch), through the real entry points. Phase 2 starts where phase 1
ended, its optimiser moments are phase 1's (checked in both checkpoints), MLflow shows phase 2 as
phase 1's child, and a model too short for the new data or another tokenizer is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PY, _run
from conftest import train as launch

pytestmark = pytest.mark.slow
BETAS = (0.9, 0.98)  # tiny.yaml's (the default)
COMMON = [
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "tracking.backend=mlflow",
    "tracking.system_metrics=false",
]


def train(data_dir, out_dir, *overrides, ranks=1):
    return launch(data_dir, out_dir, *COMMON, *overrides, ranks=ranks)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def shard(tokenizer, out: Path, seq_len: int, wiki_txt_dir) -> Path:
    _run(
        [
            PY,
            "-m",
            "data_prep",
            "shard",
            "--input",
            f"{wiki_txt_dir}/*.txt",
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--seq-len",
            str(seq_len),
            "--shard-size",
            "700",
            "--block-size",
            "64",
            "--validation-fraction",
            "0.05",
        ]
    )
    _run([PY, "-m", "data_prep", "finalize", str(out)])
    return out


def train_losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def moments(tag_folder: Path):
    from pretrain.checkpoint import reshard

    params, step, _, _ = reshard.consolidate(tag_folder, reshard.read_layout(tag_folder))
    return params, int(step.item() if torch.is_tensor(step) else step)


@pytest.fixture(scope="module")
def phases(shards, wiki_txt_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("phases")  # each phase keeps its MLflow store in its out_dir
    data128 = shard(shards.parent / "tok", root / "shards128", 128, wiki_txt_dir)
    ok(train(shards, root / "p1", "train.max_steps=12", "impl.zero_stage=0"))
    log = ok(
        train(
            data128,
            root / "p2",
            "train.max_steps=1",
            "train.global_batch_size=32",
            "impl.zero_stage=2",
            f"train.init_from_checkpoint={root / 'p1' / 'checkpoints'}",
            ranks=2,
        )
    )
    return root, log


def test_phase_two_continues_phase_one_at_a_longer_sequence_length(phases):
    root, log = phases
    assert "train.init_from_checkpoint: weights and optimiser moments from" in log
    # its own schedule, from step 0 (one step, shorter than its warm-up)
    assert "schedule: linear, lr 1.5e-03 at step 0 -> 3.0e-03 at step 1 (still warming up: optim.warmup_steps=2)" in log
    p1, p2 = train_losses(root / "p1"), train_losses(root / "p2")
    assert list(p2) == [1]  # its own step counter
    # From scratch the loss starts at ln(4096) = 8.3 (phase 1's first); phase 2 starts near phase 1's end,
    # although positions 64-127 were never trained.
    assert p2[1] < p1[1] - 0.4 and abs(p2[1] - p1[12]) < 0.35, (p1, p2)


def test_phase_two_starts_from_phase_one_moments(phases):
    """One AdamW step from phase 1's moments m1, v1 with gradient g gives m2 = b1 m1 + (1 - b1) g and
    v2 = b2 v1 + (1 - b2) g^2, so ((m2 - b1 m1) / (1 - b1))^2 = (v2 - b2 v1) / (1 - b2) element by
    element; moments started from zero would break it. Phase 1 ran at world 1 / ZeRO 0, phase 2 at
    world 2 / ZeRO 2."""
    root, _ = phases
    (m1, step1), (m2, step2) = (
        moments(root / p / "checkpoints" / tag) for p, tag in (("p1", "step00000012"), ("p2", "step00000001"))
    )
    assert (step1, step2) == (12, 13)  # the step count (bias correction) goes on too
    b1, b2 = BETAS
    assert set(m1) == set(m2)
    for name in m1:
        g = (m2[name]["exp_avg"] - b1 * m1[name]["exp_avg"]) / (1 - b1)
        g_squared = (m2[name]["exp_avg_sq"] - b2 * m1[name]["exp_avg_sq"]) / (1 - b2)
        scale = g_squared.abs().max().item() + 1e-30
        assert torch.allclose(g * g, g_squared, rtol=1e-2, atol=1e-3 * scale), name


def test_mlflow_shows_phase_two_under_phase_one(phases):
    from mlflow.tracking import MlflowClient

    root, _ = phases

    def only_run(out_dir):
        client = MlflowClient(f"sqlite:///{out_dir / 'mlruns' / 'mlflow.db'}")
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        return run

    first, second = only_run(root / "p1"), only_run(root / "p2")
    assert second.data.tags["mlflow.parentRunId"] == first.info.run_id
    assert second.data.params["phase.init_from_tag"] == "step00000012"
    assert second.data.params["phase.init_from_run_id"] == first.info.run_id
    assert second.data.params["data.seq_len"] == "128" and first.data.params["data.seq_len"] == "64"


def test_too_short_a_model_and_another_tokenizer_are_refused_by_name(phases, bert_uncased_dir, wiki_txt_dir):
    root, _ = phases
    data = shard(bert_uncased_dir, root / "shards256-bert", 256, wiki_txt_dir)
    proc = train(
        data,
        root / "p2-refused",
        "train.max_steps=1",
        "model.max_position_embeddings=128",
        f"train.init_from_checkpoint={root / 'p1' / 'checkpoints' / 'step00000012'}",
        "tracking.backend=none",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "its model has max_position_embeddings 128, too short for the data's seq_len 256" in proc.stderr
    assert "was trained on data of another tokenizer" in proc.stderr
    assert "start: step" not in proc.stdout  # refused before any process group
    proc = train(
        root / "shards128",
        root / "p2-own",
        "train.max_steps=1",
        "tracking.backend=none",
        f"train.init_from_checkpoint={root / 'p1'}",
    )
    assert proc.returncode == 2 and "holds no complete checkpoint (give the run's checkpoints folder" in proc.stderr
