"""A run resumed with another number of ranks, another ZeRO stage or another micro-batch continues
the same run: the same samples in the same global steps (the data position is one global count and
masks are keyed by sample), the model and optimiser converted between ZeRO layouts, and the losses
of the uninterrupted run.

Tolerance: the legs sum the same numbers in another order (other micro-batch rows per matmul, a
gradient all-reduce or none, ZeRO-3's partitioned reductions), so fp32 round-off (~1e-7 relative per
operation) differs; Adam's update normalises gradients, which can lift that to ~1e-5 over a dozen
steps. 1e-3 relative is two orders above that and two below the loss change per step (~0.1), so a
repeated or skipped batch, or a mask drawn differently, fails it. Dropout is off here; it is keyed by
sample id too, and tests/pretrain/test_resume_with_dropout.py resumes a run with dropout on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_faults import ok, train

pytestmark = pytest.mark.slow
LEG = 4
SAME = [
    "model.hidden_dropout=0",
    "model.attention_dropout=0",
    "train.log_every=1",
    "optim.lr=3e-3",
    "train.global_batch_size=16",
]


def losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def samples_consumed(out_dir, step) -> int:
    state = json.loads((Path(out_dir) / "checkpoints" / f"step{step:08d}" / "train_state.json").read_text())
    return state["samples_consumed"]


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    ok(train(shards, out, *SAME, f"train.max_steps={3 * LEG}", "impl.zero_stage=2", "impl.micro_batch_size=8", ranks=2))
    return losses(out)


@pytest.fixture(scope="module")
def first_leg(shards, tmp_path_factory):
    """The uninterrupted run's first LEG steps (2 ranks, ZeRO 2, micro-batch 8), halted with a checkpoint."""
    out = tmp_path_factory.mktemp("first_leg")
    first = ok(
        train(
            shards,
            out,
            *SAME,
            f"train.max_steps={3 * LEG}",
            "impl.zero_stage=2",
            "impl.micro_batch_size=8",
            f"train.halt_at_step={LEG}",
            ranks=2,
        )
    )
    assert "resumed" not in first.stdout
    return out


def test_two_ranks_zero2_then_one_rank_zero0_then_two_ranks_zero3(uninterrupted, first_leg, shards, tmp_path):
    steps = f"train.max_steps={3 * LEG}"
    shutil.copytree(first_leg, tmp_path, dirs_exist_ok=True)
    second = ok(train(shards, tmp_path, *SAME, steps, "impl.zero_stage=0", f"train.halt_at_step={2 * LEG}", ranks=1))
    assert "converting" in (second.stdout + second.stderr).lower(), second.stdout[-3000:]
    third = ok(train(shards, tmp_path, *SAME, steps, "impl.zero_stage=3", ranks=2))
    assert "converting" in (third.stdout + third.stderr).lower()
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 3 * LEG + 1))
    for step, loss in uninterrupted.items():
        assert got[step] == pytest.approx(loss, rel=1e-3), step
    assert [samples_consumed(tmp_path, s) for s in (3 * LEG,)] == [3 * LEG * 16]


def test_micro_batch_8_to_4_continues_on_the_same_samples(uninterrupted, first_leg, shards, tmp_path):
    steps = f"train.max_steps={3 * LEG}"
    shutil.copytree(first_leg, tmp_path, dirs_exist_ok=True)
    resumed = ok(
        train(
            shards,
            tmp_path,
            *SAME,
            steps,
            "impl.zero_stage=2",
            "impl.micro_batch_size=4",
            f"train.halt_at_step={2 * LEG}",
            ranks=2,
        )
    )
    assert "grad_accum 2" in resumed.stdout
    got = losses(tmp_path)
    for step in range(1, 2 * LEG + 1):
        assert got[step] == pytest.approx(uninterrupted[step], rel=1e-3), step
