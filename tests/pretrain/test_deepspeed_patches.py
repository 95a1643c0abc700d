"""pretrain/runtime/deepspeed_patches.py: the patches to DeepSpeed's internals are made only on a
DeepSpeed whose functions they were written against; another one stops the run at start-up with a
named error (and the preflight refuses it before any process starts), never a wrong norm."""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path

import pytest

from pretrain.runtime import deepspeed_patches as patches
from pretrain.runtime import engine

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_deepspeed_is_a_checked_one_and_its_internals_match():
    assert metadata.version("deepspeed").split("+")[0] in patches.CHECKED_VERSIONS
    assert patches.internals_problems() == []
    # setup_env.sh installs the version the patches were checked on
    assert f"deepspeed=={patches.CHECKED_VERSIONS[-1]}" in (REPO / "launchers" / "setup_env.sh").read_text()


def _other_clip(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6, use_graph=False):
    raise AssertionError("never called: the check refuses this DeepSpeed before anything runs")


@pytest.fixture
def changed_deepspeed(monkeypatch):
    """A DeepSpeed whose BF16 clip takes one more parameter and whose BF16_Optimizer lost a method the
    patches call, as a later release might; nothing patched yet in this process."""
    for row in patches.PATCHES:
        if row.original is not None:  # DeepSpeed's own back in place, as before any patch
            monkeypatch.setattr(*row.owner(), row.original)
        monkeypatch.setattr(row, "original", None)
    bf16_optimizer = importlib.import_module(patches.BF16)
    monkeypatch.setattr(bf16_optimizer, "clip_tensors_by_global_norm", _other_clip)
    monkeypatch.delattr(bf16_optimizer.BF16_Optimizer, "get_grads_for_norm")


def test_a_deepspeed_with_other_internals_is_refused_by_name_before_anything_is_patched(changed_deepspeed):
    problems = patches.internals_problems()
    assert problems == [
        "deepspeed.runtime.bf16_optimizer.clip_tensors_by_global_norm takes ('input_tensors', 'max_norm', "
        "'global_norm', 'mpu', 'eps', 'use_graph') (written for ('input_tensors', 'max_norm', 'global_norm', "
        "'mpu', 'eps'))",
        "deepspeed.runtime.bf16_optimizer.BF16_Optimizer.get_grads_for_norm is gone",
    ]
    bf16_optimizer = importlib.import_module("deepspeed.runtime.bf16_optimizer")
    with pytest.raises(patches.DeepSpeedInternalsChanged) as refused:
        patches.apply_patches(optimizer_named=True)
    message = str(refused.value)
    assert "clip_tensors_by_global_norm takes" in message and "get_grads_for_norm is gone" in message
    assert f"pip install 'deepspeed=={patches.CHECKED_VERSIONS[-1]}'" in message
    assert bf16_optimizer.clip_tensors_by_global_norm is _other_clip  # left as it was: nothing patched


def test_the_preflight_refuses_an_unchecked_version_whose_internals_differ(changed_deepspeed):
    """An unchecked version is compared (imported); a checked one is not (the metadata alone)."""
    (problem,) = engine.deepspeed_problems("0.21.0")
    assert problem.startswith("DeepSpeed ") and "clip_tensors_by_global_norm takes" in problem
    assert engine.deepspeed_problems(patches.CHECKED_VERSIONS[-1]) == []


def test_an_unchecked_version_with_the_same_internals_passes_the_preflight():
    assert engine.deepspeed_problems("0.21.0+cu128") == []


def test_cudas_gradient_sum_through_scratch_is_the_mixed_add_bit_for_bit_in_calls_of_one_kind(monkeypatch):
    """On CUDA a micro-batch after the step's first adds its bf16 gradients into the fp32 sums by way of
    fp32 scratch, because a multi-tensor add of mixed dtypes is a kernel a tensor there. The sums equal
    DeepSpeed's fp32 += bf16 bit for bit, scratch taken a chunk at a time (here forced small: four
    chunks, one tensor larger than a chunk alone), and every call is one CUDA's multi-tensor kernels take
    whole: lists of equal sizes and strides, a conversion from one dtype, an add within one."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(patches, "SCRATCH_ELEMENTS", 100)
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 5), (40,), (130,), (3, 7), (2,), (9, 9)]
    grads = [torch.randn(*s, generator=g).bfloat16() for s in shapes]
    start = [torch.randn(*s, generator=g) for s in shapes]
    theirs = [t.clone() for t in start]
    for t, grad in zip(theirs, grads):
        t.add_(grad)
    ours = [t.clone() for t in start]
    calls = []

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func.overloadpacket.__name__, [a for a in args if isinstance(a, list)]))
            return func(*args, **(kwargs or {}))

    with Calls():
        patches.add_converted(list(zip(ours, grads)))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and not torch.equal(ours[0], start[0])
    sums = [(name, lists) for name, lists in calls if name.startswith("_foreach")]
    assert [name for name, _ in sums] == ["_foreach_copy_", "_foreach_add_"] * 4
    for name, (to, of) in sums:
        assert all(a.shape == b.shape and a.stride() == b.stride() for a, b in zip(to, of)), name
        assert {t.dtype for t in to} == {torch.float32} and len({t.dtype for t in of}) == 1, name
        assert name == "_foreach_copy_" or {t.dtype for t in of} == {torch.float32}
