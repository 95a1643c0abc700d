"""Deferred reads (issue 73, item 1c): a step that logs, evaluates and checkpoints nothing reads its
decision (skip the update? stop? the loss the spike guard watches) one step later, its update masked
on the device meanwhile (pretrain/step.py, "Deferred reads"). Nothing a run computes may change: every
run here is compared with the same run reading every decision at once (``impl.deferred_reads=false``),
number for number, also where updates are skipped and where a spike is rolled back.

Time: under a minute on the AMX Xeon, 1.4 minutes on the AVX2-only EPYC under the README's command
(2026-11-29): every run twice (deferred and at once), 18 short runs forked from the rank pool."""

from __future__ import annotations

import json

import pytest

from conftest import train
from test_faults import ok, strict_records

pytestmark = pytest.mark.slow

AT_ONCE = "impl.deferred_reads=false"
# 8 steps of 2 micro-batches, logged at 4 and 8: steps 1-3 and 5-7 read nothing before their update
EIGHT_STEPS = [
    "impl.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.max_steps=8",
    "train.log_every=4",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "model.max_position_embeddings=64",
]
LOGGED = ("train/loss", "train/lr", "train/grad_norm", "train/accuracy", "perf/tokens_per_s")


def logged(out_dir) -> list[dict]:
    """Each metrics row, without the timings (which differ from run to run)."""
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/") and not k.startswith("sys/")}
        for r in strict_records(out_dir / "metrics.jsonl")
    ]


@pytest.mark.parametrize(
    "stage,precision,ranks",
    [(1, "bf16", 2), (2, "fp32", 1), (0, "bf16", 1), (3, "fp32", 1)],
    ids=["zero1-bf16-2ranks", "zero2-fp32", "zero0-bf16", "zero3-fp32"],
)
def test_deferred_steps_log_what_steps_read_at_once_log(shards, tmp_path, stage, precision, ranks):
    """The masked update is the update: losses, learning rates, gradient norms and accuracies equal,
    bit for bit, at every ZeRO stage (ZeRO 1 in bf16 at 2 ranks is configs/base.yaml's path)."""
    setting = [f"impl.zero_stage={stage}", f"impl.precision={precision}", *EIGHT_STEPS]
    deferred, at_once = tmp_path / "deferred", tmp_path / "at_once"
    ok(train(shards, deferred, *setting, ranks=ranks))
    ok(train(shards, at_once, *setting, AT_ONCE, ranks=ranks))
    ours, reference = logged(deferred), logged(at_once)
    assert [r["step"] for r in ours if "train/loss" in r] == [4, 8]
    assert ours == reference


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "fp32")], ids=["zero1-bf16", "zero2-fp32"])
def test_skipped_updates_read_a_step_late_hold_the_schedule_and_stop_the_run(shards, tmp_path, stage, precision):
    """An absurd learning rate: every loss after the first update is non-finite. Steps 2, 3, 5 read
    their decision a step late, their updates masked on the device; each skipped step still holds the
    warming-up schedule (the rate logged at step 4 is step 1's next rate), and the fourth in a row
    (step 5, read by step 6) stops the run with exit 4, as a run that reads every step at once does."""
    setting = [
        f"impl.zero_stage={stage}",
        f"impl.precision={precision}",
        *EIGHT_STEPS,
        "train.max_steps=40",
        "optim.lr=1e30",
        "optim.warmup_steps=8",
        "train.max_nonfinite_in_a_row=4",
    ]
    deferred, at_once = tmp_path / "deferred", tmp_path / "at_once"
    procs = [train(shards, deferred, *setting), train(shards, at_once, *setting, AT_ONCE)]
    for proc in procs:
        assert proc.returncode == 4, proc.stderr[-3000:]
        assert "4 non-finite losses in a row (last at step 5)" in proc.stdout + proc.stderr
    ours = logged(deferred)
    assert ours == logged(at_once)
    step4 = next(r for r in ours if r["step"] == 4 and "train/lr" in r)
    assert step4["train/lr"] == pytest.approx(1e30 * 2 / 8) and step4["train/nonfinite_skipped"] == 3
    assert ours[-1]["train/nonfinite_skipped"] == 4


def test_a_spike_read_a_step_late_is_rolled_back_as_at_once(shards, tmp_path):
    """Noise in data steps 10 and 11 makes optimiser steps 11 and 12 spike (tests/pretrain/test_spike_hang.py).
    Step 12 logs and checkpoints nothing: its loss, which confirms the spike, is read at step 13,
    after step 13 trained. The rollback is the same: back to step 8's checkpoint, the same samples
    skipped (not step 13's as well), and the same losses after it."""
    setting = [
        "train.max_steps=16",
        "train.log_every=8",
        "train.eval_every=0",
        "train.checkpoint_every=8",
        "model.max_position_embeddings=64",
        "optim.warmup_steps=4",
        "optim.lr=3e-3",
        "train.spike_guard.enabled=true",
        "train.spike_guard.window=6",
        "train.spike_guard.min_window=4",
        "train.spike_guard.sigmas=2",
        "train.spike_guard.skip_steps=4",
    ]
    noise = {"PRETRAIN_TEST_NOISE_STEPS": "10:12"}
    recovery = "loss spike from step 11 to 12: back to step00000008, samples 128 to 192 skipped"
    deferred, at_once = tmp_path / "deferred", tmp_path / "at_once"
    for out, extra in ((deferred, []), (at_once, [AT_ONCE])):
        proc = ok(train(shards, out, *setting, *extra, ranks=2, env=noise))
        assert proc.stdout.count(recovery) == 1, proc.stdout[-3000:]
    assert logged(deferred) == logged(at_once)
    states = [
        json.loads((out / "checkpoints" / "step00000016" / "train_state.json").read_text())
        for out in (deferred, at_once)
    ]
    assert states[0]["skipped_windows"] == states[1]["skipped_windows"] != []
    assert states[0]["data"] == states[1]["data"]
    events = [json.loads(line) for line in (deferred / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [("spike_recovery", 12)]
