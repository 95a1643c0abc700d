"""Schedules that continue: a run resumed with a longer train.max_steps really trains, under linear,
cosine and wsd, with the learning rate the documented rule gives (pretrain/model/schedule.py: the
multiplier is recomputed with the new total), through the real entry point."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from conftest import train as launch

pytestmark = pytest.mark.slow
PY = sys.executable
LR, WARMUP = 3e-3, 2
BASE = [
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "model.max_position_embeddings=64",
    f"optim.warmup_steps={WARMUP}",
    f"optim.lr={LR}",
    "optim.decay_fraction=0.25",
]


def train(data_dir, out_dir, *overrides):
    proc = launch(data_dir, out_dir, *BASE, *overrides, check=True)
    return proc.stdout + proc.stderr


def documented_multiplier(schedule: str, step: int, total: int) -> float:
    """The rule of docs/recipes.md ("Schedules that continue"), written out again: warm-up, then the shape over (step, the current total)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    if schedule == "wsd":
        decay = round(0.25 * total)
        start = total - decay
        return 1.0 if step < start else 1.0 - (step - start) / decay
    progress = min(1.0, (step - WARMUP) / (total - WARMUP))
    return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("schedule,stage_after", [("linear", 0), ("cosine", 0), ("wsd", 2)])
def test_a_longer_max_steps_on_resume_trains_at_the_documented_rate(schedule, stage_after, shards, tmp_path):
    # cosine also schedules the masking rate (0.15 -> 0.3), which follows the same rule
    results = [f"optim.schedule={schedule}"] + (["masking.rate_end=0.3"] if schedule == "cosine" else [])
    train(shards, tmp_path, "train.max_steps=4", *results, "impl.zero_stage=0")
    # wsd also resumes at another ZeRO stage: the checkpoint is converted (pretrain.checkpoint.reshard), whose
    # loader restores the scheduler too.
    log = train(shards, tmp_path, "train.max_steps=8", *results, f"impl.zero_stage={stage_after}")
    rows = [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    if schedule == "cosine":  # train/mask_rate at step n: the rate step n-1 masked at, over the new total
        rates = {r["step"]: r["train/mask_rate"] for r in rows if "train/mask_rate" in r}
        assert [rates[n] for n in range(5, 9)] == pytest.approx([0.15 + 0.15 * (n - 1) / 7 for n in range(5, 9)])
        # MFU counts the head's FLOPs at the rate each step masked at (one step per log line here)
        from transformers import AutoConfig

        from pretrain.model.flops import mlm_flops_per_sequence

        config = AutoConfig.from_pretrained(Path(tmp_path) / "hf_final")
        per_seq = {r["step"]: r["perf/mfu"] / r["perf/samples_per_s"] for r in rows if "perf/mfu" in r}
        flops = {n: mlm_flops_per_sequence(config, 64, rates[n] * 64) for n in range(5, 9)}
        assert [per_seq[n] / per_seq[5] for n in range(6, 9)] == pytest.approx(
            [flops[n] / flops[5] for n in range(6, 9)], rel=1e-6
        )
    lr = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    start_lr = LR * documented_multiplier(schedule, 4, 8)
    assert f"schedule: {schedule}, lr {start_lr:.1e} at step 4 -> 0 at step 8" in log, log[-3000:]
    assert "the checkpoint's schedule ended at step 4, recomputed for the new end" in log
    # train/lr at step n is the rate of the next update (LambdaLR's last lr): n's multiplier.
    for step in range(5, 9):
        assert lr[step] == pytest.approx(LR * documented_multiplier(schedule, step, 8), rel=1e-6), (step, lr)
    assert all(lr[step] > 0 for step in (5, 6, 7)), lr  # step 8's is the end of the decay, 0
    # The held-out loss (fixed examples and masks) at the new end is clearly below where the first
    # job ended; at lr 0 the weights would not move and the two would be equal.
    assert evals[8] < evals[4] - 0.05, evals
