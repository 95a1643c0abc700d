"""``impl.precision: fp8`` (issue 84, item 4): the encoder layers' matmuls in float8 over bf16
weights, trained on the CPU (the float8 values multiplied in fp32, as torch._scaled_mm does) to the
bf16 run's losses within float8's rounding; the checkpoint is a bf16 one that a bf16 run resumes;
refused by name on a GPU without float8 tensor cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import train
from pretrain.config.schema import ImplConfig, ModelConfig
from pretrain.model import fp8
from pretrain.model.masking import SpecialIds
from pretrain.model.mlm import build_model

RUN = [
    "train.max_steps=30",
    "train.log_every=5",
    "train.eval_every=0",
    "train.eval_sequences=16",
    "train.checkpoint_every=30",
    "model.max_position_embeddings=64",
]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_a_gpu_without_float8_tensor_cores_is_refused_by_name():
    assert fp8.problems((9, 0)) == [] and fp8.problems((8, 9)) == []  # Hopper, Ada
    (problem,) = fp8.problems((8, 0))  # an A100
    assert "impl.precision: fp8 needs float8 tensor cores" in problem and "this GPU is 8.0: use bf16" in problem


def test_a_float8_layer_computes_what_the_gpus_kernel_does_within_float8s_rounding_of_bf16():
    """Forward and both gradients against the bf16 layer: within e4m3's and e5m2's rounding (3 and 2
    mantissa bits), not equal; the CPU's fp32 product of the float8 values is torch._scaled_mm's."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(128, 96).to(torch.bfloat16)
    ours = torch.nn.Linear(128, 96).to(torch.bfloat16)
    ours.load_state_dict(plain.state_dict())
    ours.__class__ = fp8.Float8Linear
    x = torch.randn(4, 16, 128, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), plain(x2)
    g = torch.randn_like(y1)
    y1.backward(g), y2.backward(g)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert 0.005 < rel(y1, y2) < 0.06 and 0.005 < rel(x1.grad, x2.grad) < 0.1
    assert 0.005 < rel(ours.weight.grad, plain.weight.grad) < 0.1 and torch.equal(ours.bias.grad, plain.bias.grad)
    a, a_inv = fp8.to_float8(torch.randn(32, 64), fp8.FORWARD)
    b, b_inv = fp8.to_float8(torch.randn(48, 64) * 1e3, fp8.FORWARD)
    kernel = torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=torch.float32)
    # Equal up to the order of the fp32 sums, whose rounding is relative to the products summed, not to
    # their sum: an element that nearly cancels differs by more than rtol of itself (an AVX2-only EPYC:
    # 0.0018 at 41.7 among outputs of ~10^4), so atol is a share of the largest output.
    ours_kernel = fp8.scaled_mm(a, a_inv, b.t(), b_inv, torch.float32)
    torch.testing.assert_close(ours_kernel, kernel, rtol=1e-5, atol=1e-5 * kernel.abs().max().item())


def test_only_the_encoder_layers_are_converted_and_the_state_dict_is_unchanged():
    model = build_model(
        ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=64),
        512,
        SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=512),
        ImplConfig(precision="bf16"),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fp8.convert(model) == 12  # 6 a layer: query, key, value, attention output, intermediate, output
    converted = [n for n, m in model.named_modules() if isinstance(m, fp8.Float8Linear)]
    assert all(".encoder.layer." in n for n in converted) and len(converted) == 12
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow
def test_an_fp8_run_trains_as_bf16_does_and_leaves_a_bf16_checkpoint(shards, tmp_path):
    train(shards, tmp_path / "bf16", *RUN, "impl.precision=bf16", check=True)
    run = train(shards, tmp_path / "fp8", *RUN, "impl.precision=fp8", check=True)
    assert (
        "precision fp8 (fp8 as configured; float8 values multiplied in fp32 on the CPU, 12 encoder linear layers in float8)"
        in (run.stdout + run.stderr)
    ), (run.stdout + run.stderr)[-3000:]
    ours, theirs = losses(tmp_path / "fp8"), losses(tmp_path / "bf16")
    assert sorted(ours) == sorted(theirs) == [5, 10, 15, 20, 25, 30]
    assert theirs[30] < theirs[5] - 0.5  # it learns
    for step in ours:  # float8's rounding moves the losses a little, not the run
        assert abs(ours[step] - theirs[step]) < 0.02 * theirs[step], (step, ours, theirs)
    assert ours != theirs  # the matmuls did run in float8
    layout = json.loads((tmp_path / "fp8" / "checkpoints" / "step00000030" / "layout.json").read_text())
    assert layout["precision"] == "bf16"
    resumed = train(
        shards, tmp_path / "fp8", *RUN[1:], "train.max_steps=35", "impl.precision=bf16", check=True
    )  # a bf16 run goes on from it, no conversion
    assert "resum" in (resumed.stdout + resumed.stderr) and 35 in losses(tmp_path / "fp8")
