"""bf16 gradients summed over micro-steps in fp32 (issue 33): at ZeRO 1 that is DeepSpeed's
BF16_Optimizer, whose checkpoints the trainer must resume exactly and export from its fp32 masters.

Time: under a minute on the AMX Xeon, 1.1 minutes on the AVX2-only EPYC under the README's command
(2026-11-29): 13 runs forked from the rank pool, most in bf16, which that CPU emulates (~50x slower
matmuls than fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from test_faults import ok, strict_records, train
from test_resume_with_dropout import rows

pytestmark = pytest.mark.slow

# 2 ranks x 2 micro-batches of 4 a step, 4 steps, each logged with the per-layer health metrics
FOUR_LOGGED_STEPS = [
    "impl.micro_batch_size=4",
    "train.global_batch_size=16",
    "train.max_steps=4",
    "train.log_every=1",
    "train.health_every=1",
    "train.eval_every=0",
]


def test_bf16_zero1_with_accumulation_resumes_exactly_and_exports_its_fp32_masters(shards, tmp_path):
    """bf16 sums micro-step gradients in fp32 (issue 33): at ZeRO 1 DeepSpeed's BF16_Optimizer does it,
    with checkpoint files of its own. A halt and resume at the same layout repeats the uninterrupted
    run's arithmetic, so its losses are equal; the per-layer health metrics read its gradients, and
    the export takes its fp32 masters."""
    bf16 = ["impl.precision=bf16", "impl.zero_stage=1", *FOUR_LOGGED_STEPS, "model.hidden_dropout=0"]
    bf16 += ["model.attention_dropout=0"]
    straight, run = tmp_path / "straight", tmp_path / "resumed"
    first = ok(train(shards, straight, *bf16, ranks=2))
    assert "grad_accum 2" in first.stdout
    ok(train(shards, run, *bf16, "train.halt_at_step=2", ranks=2))
    ok(train(shards, run, *bf16, ranks=2))
    assert rows(run, "train/loss") == rows(straight, "train/loss") and len(rows(straight, "train/loss")) == 4
    grad_norms = rows(straight, "health/layer_00/grad_norm")
    assert len(grad_norms) == 4 and all(0 < g < float("inf") for _, g in grad_norms), grad_norms
    # The norm BF16_Optimizer clips with is taken ahead, with the step's one read from the device
    # (engine.will_skip_update): it is the norm of the gradients reduced over both ranks, which the
    # per-layer norms (read from the same fp32 gradients, before the update) add up to.
    assert norms_add_up(straight) == 4
    step4 = straight / "checkpoints" / "step00000004"
    assert sorted(p.name for p in step4.glob("*optim_states.pt"))[0].startswith("bf16_zero_pp_rank_0")
    from safetensors.torch import load_file

    from pretrain.checkpoint.hf_export import fp32_state_dict

    exported = load_file(straight / "hf_final" / "model.safetensors")
    masters = fp32_state_dict(straight / "checkpoints", "step00000004")
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters.values())
    shared = [k for k in exported if k in masters]
    assert len(shared) > 10 and all(torch.equal(exported[k], masters[k]) for k in shared)


def norms_add_up(out_dir) -> int:
    """Checks each logged step's gradient norm against the per-layer norms (read from the same fp32
    gradients, before the update, summed in quadrature); returns how many steps it checked. The two sum
    in other orders (DeepSpeed's per-tensor norms, health's per-fragment ones): 1e-5 apart at ZeRO 2,
    so 1e-4 (a norm off by 1% fails)."""
    by_step: dict[int, dict] = {}
    for r in strict_records(out_dir / "metrics.jsonl"):
        by_step.setdefault(r["step"], {}).update(r)
    checked = 0
    for r in by_step.values():
        layers = [v for k, v in r.items() if k.startswith("health/") and k.endswith("/grad_norm")]
        if "train/grad_norm" in r:
            assert len(layers) >= 3, r
            assert r["train/grad_norm"] == pytest.approx(math.sqrt(sum(v * v for v in layers)), rel=1e-4), r
            checked += 1
    return checked


@pytest.mark.parametrize("stage,precision", [(2, "bf16"), (2, "fp32"), (1, "fp32")])
def test_zero_1_2_take_the_norm_of_the_reduced_gradients_with_the_steps_one_read(shards, tmp_path, stage, precision):
    """ZeRO 1-2's optimiser (DeepSpeed's DeepSpeedZeroOptimizer: ZeRO 2, and ZeRO 1 outside bf16, its
    own code): at 2 ranks with 2 micro-batches a step, the norm it logs is the reduced gradients' own,
    which the per-layer norms add up to."""
    out = tmp_path / "run"
    ok(train(shards, out, f"impl.precision={precision}", f"impl.zero_stage={stage}", *FOUR_LOGGED_STEPS, ranks=2))
    assert norms_add_up(out) == 4
