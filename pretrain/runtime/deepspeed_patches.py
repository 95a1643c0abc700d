"""Every change this trainer makes to DeepSpeed's internals: one table, ``PATCHES``, applied by one loop.

The scope is base.yaml's path, ZeRO 1 in bf16 (BF16_Optimizer); ZeRO 0, 2 and 3 run DeepSpeed's own
code, with the waits docs/gpu-step.md names, until a GPU shows that they matter. Each row computes what
DeepSpeed's code would (tests/pretrain/test_host_syncs.py compares the numbers, counts the waits) and
names what it replaces with the parameters it was written against: other internals stop the run at
start-up, each difference named, never a wrong norm. pyproject.toml pins the checked version. Not a
row: DeepSpeed's Muon modules ``torch.compile`` at import (0.7-1.3 s of CPU a rank), never imported
where the optimiser is ours."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys
import types
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("pretrain")

CHECKED_VERSIONS = ("0.19.8",)  # the DeepSpeed releases the rows were read against and the suite passed on
PATCH_GROUPS = ("bf16_multi_tensor", "decisions_ahead")  # impl.deepspeed_patches' switches
BF16 = "deepspeed.runtime.bf16_optimizer"


@dataclass
class Patch:
    group: Optional[str]  # the impl.deepspeed_patches switch; None: only checked (called or swapped by a row)
    target: str  # "module:attribute" (attribute may be Class.method)
    params: tuple[str, ...]  # DeepSpeed's parameters there, as the row was written against them
    replacement: Optional[Callable]
    why: str
    measured: str  # what a GPU measured, or on the CPU where the effect is a count
    upstream: str  # the upstream issue or pull request that would retire the row
    original: Any = None  # DeepSpeed's own, kept once the row is applied

    def owner(self) -> tuple[Any, str]:
        module_name, _, attribute = self.target.partition(":")
        *path, name = attribute.split(".")
        return functools.reduce(getattr, path, importlib.import_module(module_name)), name


class DeepSpeedInternalsChanged(RuntimeError):
    """The installed DeepSpeed's internals are not those the patches were written against."""


def internals_problems() -> list[str]:
    """Each row's target that is missing or takes other parameters in the installed DeepSpeed (a row
    already applied in this process is compared through its kept original)."""
    problems = []
    for row in PATCHES:
        name = row.target.replace(":", ".")
        try:
            has = tuple(inspect.signature(row.original or getattr(*row.owner())).parameters)
        except (ImportError, AttributeError):
            problems.append(f"{name} is gone")
            continue
        except (TypeError, ValueError):  # no signature to read
            has = None
        if has != row.params:
            problems.append(f"{name} takes {has} (written for {row.params})")
    return problems


def internals_refusal(problems: list[str]) -> str:
    """The message of a DeepSpeed whose internals differ: which, and what to install."""
    return (
        f"DeepSpeed {_installed_version()}: its internals differ from those pretrain/runtime/deepspeed_patches.py "
        f"was written against (checked on {', '.join(CHECKED_VERSIONS)}): " + "; ".join(problems) + ". "
        f"Install a checked version (pip install 'deepspeed=={CHECKED_VERSIONS[-1]}'), or port the patches"
    )


def checked(version: str) -> bool:
    """Whether ``version`` (a local build's ``+cu128`` suffix aside) is one the patches were checked on."""
    return version.split("+")[0] in CHECKED_VERSIONS


def _installed_version() -> str:
    return metadata.version("deepspeed") if importlib.util.find_spec("deepspeed") else "(not installed)"


_applied_groups: set[str] = set()


def apply_patches(optimizer_named: bool, groups: tuple[str, ...] = PATCH_GROUPS) -> None:
    """The rows of ``groups`` in place, DeepSpeed's own on the others, after the check.
    ``optimizer_named``: the DeepSpeed JSON names an optimiser (then DeepSpeed's Muon may be needed)."""
    if not optimizer_named:
        _skip_muon_import()
    problems = internals_problems()
    if problems:
        raise DeepSpeedInternalsChanged(internals_refusal(problems))
    if not checked(version := _installed_version()):
        log.warning("DeepSpeed %s: its patched functions match %s's, but it was not checked", version, CHECKED_VERSIONS)
    for row in (r for r in PATCHES if r.replacement is not None):
        owner, name = row.owner()
        if row.original is None:
            row.original = getattr(owner, name)
        setattr(owner, name, row.replacement if row.group in groups else row.original)
    _applied_groups.clear()
    _applied_groups.update(groups)


def original(target: str) -> Callable:
    """DeepSpeed's own function at ``target`` (the one a row replaced, or the one there now)."""
    (row,) = [r for r in PATCHES if r.target == target]
    return row.original or getattr(*row.owner())


def will_skip_update(engine) -> torch.Tensor | None:
    """Whether DeepSpeed's coming step will skip its update (the gradient norm non-finite), a float64
    0/1 on the device; the norm, taken now, kept on the optimiser for ``give_decision``. None where
    DeepSpeed decides alone: every optimiser but BF16_Optimizer, experts, gradients not yet reduced."""
    opt = engine.optimizer
    if "decisions_ahead" not in _applied_groups or type(opt).__name__ != "BF16_Optimizer":
        return None
    plain = not opt.has_moe_layers and opt.mpu is None and float(opt.norm_type) == 2.0
    if not (plain and engine.managed_gradient_accumulation() and engine.is_gradient_accumulation_boundary()):
        return None
    grads, _ = opt.get_grads_for_norm()
    if not grads:
        return None
    opt.norm_ahead = norm = _global_norm(grads)  # non-finite marked -1, as DeepSpeed marks it
    return (norm < 0).double()


def give_decision(engine, skip: bool) -> None:
    """The answer to ``will_skip_update``, read by the step, for DeepSpeed's coming step."""
    norm = engine.optimizer.__dict__.pop("norm_ahead", None)
    if norm is not None:
        engine.optimizer.decided = (norm, skip)


def _step_decided(self, closure=None):
    """DeepSpeed's step, within which its module's norm is the given norm and its validity check the
    given answer (``give_decision``): it reads nothing from the device. Without one, DeepSpeed's own."""
    decided, step = self.__dict__.pop("decided", None), original(f"{BF16}:BF16_Optimizer.step")
    if decided is None:
        return step(self, closure)
    module, (norm, skip) = sys.modules[BF16], decided
    kept = module.get_global_norm_of_tensors, module.is_invalid_grad_norm
    module.get_global_norm_of_tensors = lambda *args, **kwargs: norm
    module.is_invalid_grad_norm = lambda _: skip
    try:
        return step(self, closure)
    finally:
        module.get_global_norm_of_tensors, module.is_invalid_grad_norm = kept


def _mask_nonfinite(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """A Python scalar fill (a kernel argument); -1 whatever ``val``, as DeepSpeed's: its callers test for -1."""
    input.masked_fill_(~torch.isfinite(input), -1.0)


def _global_norm(input_tensors, norm_type=2, mpu=None, moe_ep_group=None, **newer):
    """In one multi-tensor call (DeepSpeed's arithmetic: per-tensor fp32 norms summed in quadrature) where
    it is a 2-norm without model or expert parallelism; else DeepSpeed's."""
    if float(norm_type) != 2.0 or mpu is not None or moe_ep_group is not None or newer or not input_tensors:
        own = original(f"{BF16}:get_global_norm_of_tensors")
        return own(input_tensors, norm_type=norm_type, mpu=mpu, moe_ep_group=moe_ep_group, **newer)
    with torch.no_grad():  # not detach() per tensor: each is a dispatch of host time
        norms = torch._foreach_norm([t if t.dtype == torch.float32 else t.float() for t in input_tensors], 2.0)
        total = torch.stack(norms).pow(2.0).sum().pow(0.5)
        _mask_nonfinite(total)
    return total


def _clip(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6, **newer):
    """One multi-tensor multiply by min(1, max_norm / (norm + eps)), the factor left on the device."""
    if newer:
        return original(f"{BF16}:clip_tensors_by_global_norm")(input_tensors, max_norm, global_norm, mpu, eps, **newer)
    if global_norm is None:
        global_norm = _global_norm(input_tensors, mpu=mpu)
    if input_tensors:
        with torch.no_grad():
            torch._foreach_mul_(list(input_tensors), (max_norm / (global_norm + eps)).clamp(max=1.0))
    return global_norm


SCRATCH_ELEMENTS = 1 << 25  # fp32 elements converted at a time when adding (128 MiB), a tensor at least


def _update_hp_grads(self, clear_lp_grads=False):
    """The bf16 gradients into the fp32 sums in multi-tensor calls of one dtype each, then freed;
    DeepSpeed's own where it does more (immediate updates, AutoEP folding).

    CUDA runs a multi-tensor add of fp32 += bf16 as a kernel a tensor (its fast path wants one dtype:
    202 kernels a micro-batch for BERT-base, 1,616 a step of 8 on the H200). Converting is the exception
    (``_foreach_copy_`` takes another source dtype in its multi-tensor kernel), so: a sum still zero (the
    step's first micro-batch, the only one at one micro-batch a step) is the converted copy; on CUDA one
    that has gradients gets the bf16 ones converted into scratch, then an fp32 + fp32 add. A CPU adds
    bf16 into fp32 in one pass (its multi-tensor calls are a loop either way; through scratch measured
    2.3x slower on the AMX Xeon, the copy 2.7x faster than the add). The sums are DeepSpeed's, bit for
    bit (bf16 to fp32 is exact)."""
    if self.immediate_grad_update or getattr(self, "autoep_folding_tp_group", None) is not None:
        return original(f"{BF16}:BF16_Optimizer.update_hp_grads")(self, clear_lp_grads=clear_lp_grads)
    with torch.no_grad():
        for i, group in enumerate(self.bf16_groups):
            hp_grads, has = self.fp32_groups_gradients[i], self.fp32_groups_has_gradients[i]
            present = [j for j, lp in enumerate(group) if lp.grad is not None]
            # the sums as the gradients' shapes: the multi-tensor kernels want equal sizes and strides
            pairs = {j: (hp_grads[j].view(group[j].grad.shape), group[j].grad) for j in present}
            fresh = [pairs[j] for j in present if not has[j]]  # zero since the last step (clear_hp_grads)
            if fresh:
                torch._foreach_copy_(*map(list, zip(*fresh)))
            adding = [pairs[j] for j in present if has[j]]
            if adding and adding[0][0].device.type == "cuda":
                add_converted(adding)
            elif adding:
                torch._foreach_add_(*map(list, zip(*adding)))
            for j in present:
                group[j]._hp_grad = hp_grads[j]
                has[j] = True
                # Freed, not zeroed: DeepSpeed zeroes them before each backward for autograd to add into
                # (~660 MB read and written a micro-batch for BERT-base); nothing reads them after this sum.
                group[j].grad = None


def add_converted(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``total += grad`` for each (fp32 total, bf16 grad): the grads converted into scratch a chunk of
    at most SCRATCH_ELEMENTS at a time, then added fp32 to fp32 (two multi-tensor calls a chunk)."""
    chunks, size = [[]], 0
    for total, grad in pairs:
        if chunks[-1] and size + total.numel() > SCRATCH_ELEMENTS:
            chunks, size = [*chunks, []], 0
        chunks[-1].append((total, grad))
        size += total.numel()
    for totals, grads in (zip(*chunk) for chunk in chunks if chunk):
        scratch = torch.empty(sum(t.numel() for t in totals), dtype=torch.float32, device=totals[0].device)
        converted = [s.view(g.shape) for s, g in zip(scratch.split([t.numel() for t in totals]), grads)]
        torch._foreach_copy_(converted, list(grads))
        torch._foreach_add_(list(totals), converted)


WAIT = "on CUDA a copy from pageable host memory or a read, which waits for every kernel queued before it"
PATCHES = [
    Patch("bf16_multi_tensor", f"{BF16}:get_global_norm_of_tensors", ("input_tensors", "norm_type", "mpu", "moe_ep_group"),
          _global_norm, "a norm kernel a tensor (202 for BERT-base), and non-finite marked -1 by a host copy "
          f"(mask_nan_or_inf_with_val_inplace's torch.tensor(-1.0, device=): {WAIT})",
          "CPU (BERT-base, with the clip): the optimizer phase 1,238 -> 26 ops, 2 -> 1 host reads a step; no GPU figure yet",
          "none filed: a torch._foreach_norm path and a scalar fill in DeepSpeed's get_global_norm_of_tensors"),
    Patch("bf16_multi_tensor", f"{BF16}:clip_tensors_by_global_norm", ("input_tensors", "max_norm", "global_norm", "mpu", "eps"),
          _clip, f"the clip factor compared on the host ({WAIT}), then a multiply a tensor", "with the norm, above",
          "deepspeedai/DeepSpeed#5547 (merged into #5504) clamps on the device for fp16's unscale, not here"),
    Patch("bf16_multi_tensor", f"{BF16}:BF16_Optimizer.update_hp_grads", ("self", "clear_lp_grads"), _update_hp_grads,
          "two kernels and a Python call a parameter a micro-batch, and bf16 gradients zeroed to be added into",
          "CPU: the backward phase 1,493 -> 965 ops a step; H200 (2026-11-28), one fp32 += bf16 multi-tensor add: "
          "still a kernel a tensor, 8.4 ms a step, hence a converting copy and a one-dtype add; no GPU figure yet",
          "deepspeedai/DeepSpeed#4975 (open: immediate gradient updates) does not fuse them"),
    Patch("decisions_ahead", f"{BF16}:BF16_Optimizer.step", ("self", "closure"), _step_decided,
          f"the norm's validity read once a step (is_invalid_grad_norm: {WAIT}), after the step's own read",
          "1 host wait a step fewer, 0 left at ZeRO 1 bf16 (tests/sync_probe.py, CPU count); no GPU figure yet",
          "none filed: a step that takes a precomputed norm and skip decision"),
    Patch(None, f"{BF16}:BF16_Optimizer.get_grads_for_norm", ("self", "for_clipping"), None,
          "will_skip_update takes the norm of these gradients", "-", "-"),
    Patch(None, f"{BF16}:is_invalid_grad_norm", ("norm",), None, "_step_decided answers it within the step", "-", "-"),
]  # fmt: skip


class _NotMuon:
    """Any name DeepSpeed imports from its Muon modules: nothing is an instance of it, a call is an error."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon optimiser is not available in a pretrain.train run (optim.name is ours)")


def _skip_muon_import() -> None:
    def attribute(name: str):
        if name.startswith("__"):  # what the import machinery and introspection look for
            raise AttributeError(name)
        return _NotMuon

    for name in ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon"):
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__getattr__ = attribute
