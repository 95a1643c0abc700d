"""Continued pretraining as people run it on their own corpus (issue 82): what a resumed run keeps,
and what a run says about where it started."""

from __future__ import annotations

import pytest

from conftest import train


@pytest.mark.slow
def test_a_resumed_auto_run_keeps_its_checkpoints_precision(shards, tmp_path):
    """impl.precision=auto on a resume takes the checkpoint's precision, without timing the step again
    (a new timing at another world size on a busy machine had switched a bf16 run to fp32)."""
    out = tmp_path / "run"
    train(shards, out, "train.max_steps=2", "train.checkpoint_every=2", "impl.precision=fp32", check=True)
    proc = train(shards, out, "train.max_steps=4", "train.checkpoint_every=2", "impl.precision=auto", check=True)
    text = proc.stdout + proc.stderr
    assert "precision fp32 (auto: fp32, as checkpoint step00000002 was trained" in text, text[-3000:]
    assert "timing this model's step" not in text
