"""Per-layer health metrics (``train.health_every``) at ZeRO 0, 2 and 3 on the same weights: every layer
has them, they are plausible, and the stages agree (the partitioned sums add up to the whole)."""
from __future__ import annotations

import json
import math
import re

import pytest
from test_train import COMMON, train

pytestmark = pytest.mark.slow
STAGES = (0, 2, 3)
GROUPS = ["embeddings", "layer_00", "layer_01", "head"]      # tiny.yaml: 2 encoder layers
KINDS = ("grad_norm", "param_norm", "update_ratio")


@pytest.fixture(scope="module")
def health_runs(shards, tmp_path_factory):
    out = {}
    for stage in STAGES:
        d = tmp_path_factory.mktemp(f"health{stage}")
        proc = train(shards, d, *COMMON, "train.max_steps=8", "train.health_every=4", f"impl.zero_stage={stage}")
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        out[stage] = ({r["step"]: {k: v for k, v in r.items() if k.startswith("health/")}
                       for r in rows if any(k.startswith("health/") for k in r)}, proc)
    return out


def test_every_layer_has_health_metrics_every_n_steps(health_runs):
    metrics, _ = health_runs[0]
    assert sorted(metrics) == [4, 8]
    for step, row in metrics.items():
        assert sorted(row) == sorted(f"health/{g}/{k}" for g in GROUPS for k in KINDS), step
        for g in GROUPS:
            assert row[f"health/{g}/grad_norm"] > 0 and row[f"health/{g}/param_norm"] > 0
            # AdamW at lr ~3e-3 moves each weight by about lr: a ratio of 1e-4 to 1e-1, not 0 nor 1.
            assert 1e-4 < row[f"health/{g}/update_ratio"] < 0.1, (step, g, row)
    # The head holds the 4096-token output bias and the embeddings the 4096 x 64 table.
    assert metrics[4]["health/embeddings/param_norm"] > metrics[4]["health/layer_00/param_norm"] / 10


def test_the_console_shows_our_lines_with_the_time_left_and_a_summary(health_runs):
    _, proc = health_runs[0]
    console = proc.stdout + proc.stderr
    for noise in ("FutureWarning", "LOAD REPORT", "corrupted", "Reconstructed fp32 state dict", "gcc "):
        assert noise not in console, noise
    assert re.search(r" INFO step 4 loss=\S+ .*tokens_per_s=\S+ .* left=0m\d\ds\n", proc.stdout), proc.stdout[-3000:]
    assert re.search(r" INFO done: 8 steps, 8,192 tokens in \dm\d\ds; train/loss \d\.\d+, eval/loss \d\.\d+\n"
                     r"  checkpoints: .*\n  export: .*hf_final", proc.stdout), proc.stdout[-3000:]


@pytest.mark.parametrize("stage", [2, 3])
def test_partitioned_stages_agree_with_zero_0(health_runs, stage):
    whole, parts = health_runs[0][0], health_runs[stage][0]
    assert sorted(parts) == sorted(whole)
    for step in whole:
        for key, value in whole[step].items():
            assert math.isclose(parts[step][key], value, rel_tol=2e-3), (stage, step, key, parts[step][key], value)
