"""Every change this trainer makes to DeepSpeed's internals, in one place, each checked against the
DeepSpeed versions named here before it is made.

Why they exist (docs/gpu-step.md): DeepSpeed's optimiser wrappers ask the device for a number many
times a step (an overflow test, a norm, a norm check, a clip factor: each a wait for every kernel
queued before it) and take norms and gradient sums one tensor at a time. The patches answer those
questions from the one read the step makes anyway (``will_skip_update``, ``norm_decided``), fill
non-finite norms on the device, use multi-tensor kernels for BF16_Optimizer's norm, clip and
gradient sums, and keep DeepSpeed's Muon module (a ``torch.compile`` at import) from loading in a run
whose optimiser is ours. Each computes what DeepSpeed's own would; the tests compare them, number for
number, with DeepSpeed's (tests/pretrain/test_host_syncs.py, test_bf16_accumulation.py).

They replace functions by name, so they rest on DeepSpeed's internals: ``REPLACED`` lists each
function replaced (or asked for) with the parameters it was written against. ``apply_patches`` checks
them first and raises ``DeepSpeedInternalsChanged``, naming each difference, on a DeepSpeed whose
internals differ: a run that stops at start-up, never one that trains on a wrong norm. A version not
in ``CHECKED_VERSIONS`` whose internals match is used, with a warning; ``deepspeed_problems`` (the
preflight) refuses one that does not match, before any process starts.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import types
from importlib import metadata

import torch

log = logging.getLogger("pretrain")

# The DeepSpeed releases these patches were read against and the suite passed on.
CHECKED_VERSIONS = ("0.19.8",)

# "module:attribute" -> the parameter names DeepSpeed's function takes there (None: it must exist,
# its parameters are hidden by a wrapper). What the patches replace, and what they call or read.
REPLACED: dict[str, tuple[str, ...] | None] = {
    "deepspeed.runtime.utils:mask_nan_or_inf_with_val_inplace": ("input", "device", "val"),
    "deepspeed.runtime.utils:CheckOverflow.has_overflow": ("self", "params", "has_moe_params"),
    "deepspeed.runtime.utils:CheckOverflow.has_overflow_serial": ("self", "params"),
    "deepspeed.runtime.zero.stage_1_and_2:is_invalid_grad_norm": ("norm",),
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.has_overflow": ("self", "partition_gradients"),
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.scaled_global_norm": ("self", "norm_type"),
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial": ("self",),
    "deepspeed.runtime.zero.stage3:torch": None,  # the module's own name for torch (_TorchFillingNumbers)
    "deepspeed.runtime.zero.stage3:is_invalid_grad_norm": ("norm",),
    "deepspeed.runtime.zero.stage3:combine_grad_norm_groups": ("norm_groups", "norm_type"),
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._get_norm_groups": None,
    "deepspeed.runtime.bf16_optimizer:get_global_norm_of_tensors": (
        "input_tensors",
        "norm_type",
        "mpu",
        "moe_ep_group",
    ),
    "deepspeed.runtime.bf16_optimizer:clip_tensors_by_global_norm": (
        "input_tensors",
        "max_norm",
        "global_norm",
        "mpu",
        "eps",
    ),
    "deepspeed.runtime.bf16_optimizer:is_invalid_grad_norm": ("norm",),
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer.update_hp_grads": ("self", "clear_lp_grads"),
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer.get_grads_for_norm": ("self", "for_clipping"),
    "deepspeed.runtime.fp16.unfused_optimizer:get_weight_norm": ("parameters", "norm_type", "mpu"),
    "deepspeed.runtime.fp16.unfused_optimizer:get_global_norm": ("norm_list",),
    "deepspeed.runtime.fp16.unfused_optimizer:is_invalid_grad_norm": ("norm",),
    "deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer.unscale_and_clip_grads": (
        "self",
        "total_norm",
        "apply_scale",
    ),
}


class DeepSpeedInternalsChanged(RuntimeError):
    """The installed DeepSpeed's internals are not those the patches were written against."""


def internals_problems(replaced: dict[str, tuple[str, ...] | None] = REPLACED) -> list[str]:
    """Each function of ``replaced`` that is missing or takes other parameters in the installed
    DeepSpeed, named (one of ours in its place, from an earlier patch in this process, is taken as
    checked: it was checked before it was put there)."""
    problems = []
    for target, params in replaced.items():
        module_name, _, attribute = target.partition(":")
        try:
            found = importlib.import_module(module_name)
            for part in attribute.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            problems.append(f"{module_name}.{attribute} is gone")
            continue
        if params is None or getattr(found, "__module__", None) == __name__:
            continue
        try:
            has = tuple(inspect.signature(found).parameters)
        except (TypeError, ValueError):
            has = None
        if has != params:
            problems.append(f"{module_name}.{attribute} takes {has} (written for {params})")
    return problems


def internals_refusal(problems: list[str]) -> str:
    """The message of a DeepSpeed whose internals differ: which, and what to install."""
    installed = _installed_version()
    return (
        f"DeepSpeed {installed}: its internals differ from those pretrain/runtime/deepspeed_patches.py was "
        f"written against (checked on {', '.join(CHECKED_VERSIONS)}): " + "; ".join(problems) + ". "
        f"Install a checked version (pip install 'deepspeed=={CHECKED_VERSIONS[-1]}'), or port the patches"
    )


def checked(version: str) -> bool:
    """Whether ``version`` (a local build's ``+cu128`` suffix aside) is one the patches were checked on."""
    return version.split("+")[0] in CHECKED_VERSIONS


def _installed_version() -> str:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return "(not installed)"


_APPLIED: dict = {}


# The groups a run may turn off one by one (``impl.deepspeed_patches``), to measure each on a GPU
# (issue 84, item 5); off, DeepSpeed's own code runs there, with its waits, to the same numbers.
PATCH_GROUPS = ("nonfinite_fill", "bf16_multi_tensor", "decisions_ahead", "overflow_once")


def apply_patches(optimizer_named: bool, groups: tuple[str, ...] = PATCH_GROUPS) -> None:
    """The patches of ``groups``, after the check (once a process: the check reads DeepSpeed's own
    functions, which the patches then replace). ``optimizer_named``: the DeepSpeed JSON names an
    optimiser (then DeepSpeed's Muon module may be needed, and loads)."""
    if not optimizer_named:
        _skip_muon_import()
    if not _APPLIED:
        problems = internals_problems()
        if problems:
            raise DeepSpeedInternalsChanged(internals_refusal(problems))
        installed = _installed_version()
        if not checked(installed):
            log.warning(
                "DeepSpeed %s: its patched functions match those of %s by name and parameters, but this "
                "version was not checked (pretrain/runtime/deepspeed_patches.py, CHECKED_VERSIONS)",
                installed,
                ", ".join(CHECKED_VERSIONS),
            )
        _APPLIED["version"] = installed
    _APPLIED["groups"] = set(groups)
    installers = {
        "nonfinite_fill": (_mask_nonfinite_norm_on_the_device,),
        "bf16_multi_tensor": (_bf16_optimizer_multi_tensor,),
        "decisions_ahead": (_zero_decisions_ahead, _unfused_decisions_ahead, _stage3_decisions_ahead),
        "overflow_once": (_fp16_optimizer_overflow_once,),
    }
    for group in groups:
        for install in installers[group]:
            install()


# DeepSpeed's Muon optimiser: its engine and ZeRO wrappers import these for type checks and for Muon's
# update inside the gradient partitioning (a path only Muon parameters take).
MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


class _NotMuon:
    """Stands for everything of DeepSpeed's Muon modules in a run whose optimiser is ours: no object
    is an instance of it, and calling it (a Muon update) is an error."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "DeepSpeed's Muon optimiser is not available in a pretrain.train run: "
            "the optimiser is the trainer's own (optim.name)"
        )


def _muon_attribute(name: str):
    if name.startswith("__"):  # what the import machinery and introspection look for
        raise AttributeError(name)
    return _NotMuon  # any name a DeepSpeed version imports from these modules


def _skip_muon_import() -> None:
    """DeepSpeed's Muon module calls ``torch.compile`` at import, which loads the inductor's compiler:
    0.7-1.3 s of CPU in every rank's start-up (or its first backward, at ZeRO 1-3), for a run whose
    optimiser is never Muon (the DeepSpeed JSON names no optimiser; ours is the client's)."""
    for name in MUON_MODULES:
        if name not in sys.modules:
            stand_in = types.ModuleType(name)
            stand_in.__getattr__ = _muon_attribute
            sys.modules[name] = stand_in


# Where DeepSpeed 0.19.8 marks a non-finite gradient norm as -1 (its gradient-norm code at every stage).
NONFINITE_NORM_USERS = (
    "deepspeed.runtime.utils",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
)


def _mask_nonfinite_in_place(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    # DeepSpeed's version fills with torch.tensor(-1.0, device=device): a copy from pageable host
    # memory, which on CUDA waits for every kernel queued before it, once a step. A Python scalar
    # fill is a kernel argument. -1 whatever `val`, as DeepSpeed's does: its callers test for -1.
    input.masked_fill_(~torch.isfinite(input), -1.0)


def _mask_nonfinite_norm_on_the_device() -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` replaced, in each module that imported it, by
    one that queues a fill instead of copying a scalar to the device: one host wait a step fewer.
    ZeRO 3 makes its -1 inline (``stage3.get_grad_norm_direct``: ``torch.tensor(-1.0, device=...)``,
    twice a step): its module sees a ``torch`` whose ``tensor`` fills a Python number instead."""
    for name in NONFINITE_NORM_USERS:
        module = sys.modules.get(name) or __import__(name, fromlist=["_"])
        if hasattr(module, "mask_nan_or_inf_with_val_inplace"):
            module.mask_nan_or_inf_with_val_inplace = _mask_nonfinite_in_place
    stage3 = sys.modules["deepspeed.runtime.zero.stage3"]
    if stage3.torch is torch:
        stage3.torch = _TorchFillingNumbers()


class _TorchFillingNumbers:
    """``torch`` as one DeepSpeed module sees it: ``torch.tensor(number, device=...)`` is a fill queued
    on the device (``torch.full``: the same value, dtype and device) instead of a copy from pageable
    host memory, which on CUDA waits for every kernel queued before it. Everything else is torch's,
    looked up once and kept as this object's attribute (as fast as a module's)."""

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        setattr(self, name, value)
        return value

    @staticmethod
    def tensor(data, *args, device=None, dtype=None, **kwargs):
        if device is not None and type(data) in (int, float) and not args and not kwargs:
            default = torch.get_default_dtype() if type(data) is float else torch.int64
            return torch.full((), data, device=device, dtype=dtype or default)
        return torch.tensor(data, *args, device=device, dtype=dtype, **kwargs)


# DeepSpeed's BF16_Optimizer (ZeRO 1 in bf16: base.yaml's path) takes the gradient norm with one
# kernel per tensor and clips with another, after a host read of the clipping factor: on a GPU, some
# 400 launches a step for BERT-base's 201 tensors, while the device idles after the step's wait. One
# multi-tensor norm and one multi-tensor multiply do the same arithmetic (the same per-tensor norms,
# summed as DeepSpeed sums them; a factor of min(1, max_norm / (norm + eps)), where x * 1.0 is x).
_DEEPSPEEDS_OWN: dict = {}


def _global_norm_multi_tensor(input_tensors, norm_type=2, mpu=None, moe_ep_group=None, **newer):
    """DeepSpeed's ``get_global_norm_of_tensors`` for the case BF16_Optimizer meets here (a 2-norm, no
    model or expert parallelism); anything else, arguments of a newer DeepSpeed too, goes to its own.
    The norm ``will_skip_update`` took of these very gradients, if it did."""
    ahead = _NORM_AHEAD.get("grads")
    if ahead is not None and len(ahead) == len(input_tensors) and all(a is b for a, b in zip(ahead, input_tensors)):
        del _NORM_AHEAD["grads"]  # once: the same gradient tensors hold the next step's gradients
        return _NORM_AHEAD["norm"]
    if float(norm_type) != 2.0 or mpu is not None or moe_ep_group is not None or newer or not input_tensors:
        return _DEEPSPEEDS_OWN["norm"](input_tensors, norm_type=norm_type, mpu=mpu, moe_ep_group=moe_ep_group, **newer)
    with torch.no_grad():  # not detach() per tensor: each is a dispatch of host time
        total = _norm_of(input_tensors)
        _mask_nonfinite_in_place(total)
    return total


# DeepSpeed's step asks whether the gradients overflowed and whether their norm is finite with a
# ``bool`` or ``item`` of a device tensor (``is_invalid_grad_norm``, ``has_overflow``): at ZeRO 1 in
# bf16 (BF16_Optimizer) one wait for the device a step after our own (pretrain.step.decide_update), at
# ZeRO 2 four. Ours comes after the last backward, when the gradients are whole and reduced: the
# norm (and the overflow test) are taken there (``will_skip_update``), the answer read with the step's
# other numbers, and DeepSpeed's step given that norm and that answer (``norm_decided``) in place of
# taking and reading them again. The same norm, the same decision; no answer given, DeepSpeed's own.
_NORM_AHEAD: dict = {}


def will_skip_update(engine) -> torch.Tensor | None:
    """Whether the coming step of DeepSpeed's optimiser wrapper will skip its update (its gradient norm
    non-finite, or DeepSpeed's -1 for one; at ZeRO 1-2 an overflowed gradient too), as a float64 0/1
    on the device, the norm taken now. None where DeepSpeed decides alone: ZeRO 0 and 3, fp16's loss
    scaling, expert layers, offload, and where the gradients are not yet reduced (DeepSpeed's
    unmanaged accumulation reduces them in ``step()``)."""
    import deepspeed.runtime.bf16_optimizer as bf16_optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    _NORM_AHEAD.clear()
    opt = engine.optimizer
    if "decisions_ahead" not in _APPLIED.get("groups", PATCH_GROUPS):
        return None
    if not (engine.managed_gradient_accumulation() and engine.is_gradient_accumulation_boundary()):
        return None
    if isinstance(opt, bf16_optimizer.BF16_Optimizer) and not opt.has_moe_layers:
        grads, _ = opt.get_grads_for_norm()
        norm = bf16_optimizer.get_global_norm_of_tensors(input_tensors=grads, mpu=opt.mpu, norm_type=opt.norm_type)
        if not torch.is_tensor(norm):
            return None
        _NORM_AHEAD.update(grads=grads, norm=norm)
        return (~torch.isfinite(norm) | (norm < 0)).double()
    if _unfused_decides_as_we_can(opt):
        groups = [[p.grad for p in group if p.grad is not None] for group in opt.fp16_groups]
        with torch.no_grad():  # DeepSpeed's: each group's norm of its gradients in fp32, then theirs
            group_norms = [_norm_of(grads) for grads in groups if grads]
            if not group_norms:
                return None
            norm = torch.stack(group_norms).pow(2.0).sum().pow(0.5)
        firsts = [grads[0] for grads in groups if grads]
        _NORM_AHEAD.update(checker=opt.overflow_checker, groups=list(zip(firsts, group_norms)), norm=norm)
        return (~torch.isfinite(norm)).double()  # an inf or nan in any gradient: its overflow test too
    if _stage3_decides_as_we_can(opt):
        from deepspeed.runtime.zero import stage3

        groups = opt._get_norm_groups()  # DeepSpeed's own: its partitions' norms, all-reduced over ranks
        norm = stage3.combine_grad_norm_groups(groups)
        _NORM_AHEAD.update(stage3=opt, groups=groups, norm=norm)
        return (~torch.isfinite(norm) | (norm < 0)).double()
    if isinstance(opt, DeepSpeedZeroOptimizer) and _zero_decides_as_we_can(opt):
        norm = opt.scaled_global_norm()
        skip = ~torch.isfinite(norm) | (norm < 0)
        if opt.check_grad_overflow:
            skip = skip | opt.has_overflow_partitioned_grads_serial().reshape(())
        _NORM_AHEAD.update(zero=opt, norm=norm)
        return skip.double()
    return None


def _zero_decides_as_we_can(opt) -> bool:
    """ZeRO 1-2's step as our read can answer it: gradients on the device, no loss scaling (bf16, fp32),
    no experts, no autocast scaler, the norm computed by the step."""
    read = ("cpu_offload", "has_moe_layers", "zenflow", "torch_autocast_gradscaler", "compute_grad_norm", "dtype")
    if not all(hasattr(opt, name) for name in (*read, "mpu", "check_grad_overflow")):
        return False  # another DeepSpeed's optimiser: it decides alone
    plain = not (opt.cpu_offload or opt.has_moe_layers or opt.zenflow or opt.torch_autocast_gradscaler)
    return plain and opt.compute_grad_norm and opt.dtype != torch.float16 and opt.mpu is None


def _norm_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``tensors`` together, each taken in fp32, in one multi-tensor call (DeepSpeed's
    arithmetic: the per-tensor norms summed in quadrature)."""
    norms = torch._foreach_norm([t if t.dtype == torch.float32 else t.float() for t in tensors], 2.0)
    return torch.stack(norms).pow(2.0).sum().pow(0.5)


def _unfused_decides_as_we_can(opt) -> bool:
    """DeepSpeed's FP16_UnfusedOptimizer (ZeRO 0 in bf16, with any optimiser but its own fused ones) as
    our read can answer it: no loss scaling (bf16), no experts, no model parallelism, its own step
    (not the legacy fused LAMB's)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(opt, FP16_UnfusedOptimizer):
        return False
    read = ("loss_scale_config", "mpu", "fused_lamb_legacy", "overflow_checker", "fp16_groups", "fp32_groups")
    if not all(hasattr(opt, name) for name in read):
        return False  # another DeepSpeed's optimiser: it decides alone
    experts = getattr(opt.overflow_checker, "has_moe_params", False)
    plain = not (opt.loss_scale_config.use_grad_scaling or opt.fused_lamb_legacy or experts)
    return plain and opt.mpu is None


def _stage3_decides_as_we_can(opt) -> bool:
    """ZeRO 3's step as our read can answer it: gradients on the device (no offload), no loss scaling
    (bf16, fp32), no Muon updates (which change the norm inside the step)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return False
    read = ("offload_optimizer", "dtype", "averaged_gradients", "fp16_groups", "_get_norm_groups")
    if not all(hasattr(opt, name) for name in read):
        return False  # another DeepSpeed's optimiser: it decides alone
    muon = getattr(opt, "sub_groups_lacking_loss_scale", None) or getattr(opt, "_uses_muon", False)
    return not (opt.offload_optimizer or muon) and opt.dtype != torch.float16


def norm_decided(skip: bool) -> None:
    """The answer, read with the step's other numbers, that DeepSpeed's step is given."""
    if "norm" in _NORM_AHEAD:
        _NORM_AHEAD["skip"] = skip


def _is_invalid_grad_norm_decided(norm) -> bool:
    """DeepSpeed's ``is_invalid_grad_norm`` (BF16_Optimizer asks it once a step, ZeRO 1-2's optimiser up
    to three times: its step and each parameter group's clip): the decided answer for the norm
    ``will_skip_update`` took; DeepSpeed's own (a read) for any other tensor."""
    decided = _NORM_AHEAD.get("skip") if norm is _NORM_AHEAD.get("norm") else None
    return _DEEPSPEEDS_OWN["is_invalid"](norm) if decided is None else decided


def _zero_has_overflow_decided(self, partition_gradients=True) -> bool:
    if _NORM_AHEAD.get("zero") is self and "skip" in _NORM_AHEAD:
        return _NORM_AHEAD["skip"]
    return _DEEPSPEEDS_OWN["zero_has_overflow"](self, partition_gradients)


def _zero_scaled_global_norm_decided(self, norm_type=2):
    if _NORM_AHEAD.get("zero") is self and norm_type == 2:
        return _NORM_AHEAD["norm"]
    return _DEEPSPEEDS_OWN["zero_scaled_global_norm"](self, norm_type)


def _unfused_has_overflow_decided(self, params, has_moe_params=None) -> bool:
    if _NORM_AHEAD.get("checker") is self and "skip" in _NORM_AHEAD:
        del _NORM_AHEAD["checker"]  # answered once: a later question is DeepSpeed's own
        return _NORM_AHEAD["skip"]
    return _DEEPSPEEDS_OWN["has_overflow"](self, params, has_moe_params)


def _unfused_weight_norm_decided(parameters, norm_type=2, mpu=None):
    """FP16_UnfusedOptimizer's norm of a parameter group's gradients (a ``float`` and an ``item``
    each): the group's norm taken ahead, for the same gradients."""
    groups = _NORM_AHEAD.get("groups") if "skip" in _NORM_AHEAD else None
    given = list(parameters) if isinstance(parameters, (list, tuple)) else None
    if groups and given and given[0] is groups[0][0] and float(norm_type) == 2.0 and mpu is None:
        return _NORM_AHEAD["groups"].pop(0)[1]
    return _DEEPSPEEDS_OWN["weight_norm"](parameters, norm_type=norm_type, mpu=mpu)


def _unfused_global_norm_decided(norm_list):
    """The total of the group norms taken ahead is the norm taken ahead (DeepSpeed's sums their squares
    on the host)."""
    if norm_list and all(torch.is_tensor(n) for n in norm_list) and "norm" in _NORM_AHEAD and "skip" in _NORM_AHEAD:
        return _NORM_AHEAD["norm"]
    return _DEEPSPEEDS_OWN["global_norm"](norm_list)


def _unfused_unscale_and_clip_decided(self, total_norm, apply_scale=True):
    """FP16_UnfusedOptimizer's clip with the factor on the device (DeepSpeed's compares it on the host,
    then multiplies tensor by tensor): 1 / scale x min(1, max_norm / (norm / scale + 1e-6))."""
    if not torch.is_tensor(total_norm):
        return _DEEPSPEEDS_OWN["unscale_and_clip"](self, total_norm, apply_scale)
    scale = self.loss_scale_config.cur_scale
    factor = torch.ones_like(total_norm)
    if self.clip_grad > 0.0:
        factor = (self.clip_grad / (total_norm / scale + 1e-6)).clamp(max=1.0)
    grads = [p.grad for group in self.fp32_groups for p in group if p.grad is not None]
    if apply_scale and grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, factor / scale)
    return scale / factor


def _unfused_decisions_ahead() -> None:
    """FP16_UnfusedOptimizer's overflow test, group norms, norm check and clip (ZeRO 0 in bf16: one
    wait each, five a step) answered by ``will_skip_update``'s."""
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.fp16 import unfused_optimizer

    if "has_overflow" not in _DEEPSPEEDS_OWN:
        _DEEPSPEEDS_OWN["has_overflow"] = ds_utils.CheckOverflow.has_overflow
        _DEEPSPEEDS_OWN["weight_norm"] = unfused_optimizer.get_weight_norm
        _DEEPSPEEDS_OWN["global_norm"] = unfused_optimizer.get_global_norm
        _DEEPSPEEDS_OWN["unscale_and_clip"] = unfused_optimizer.FP16_UnfusedOptimizer.unscale_and_clip_grads
    _DEEPSPEEDS_OWN.setdefault("is_invalid", unfused_optimizer.is_invalid_grad_norm)
    ds_utils.CheckOverflow.has_overflow = _unfused_has_overflow_decided
    unfused_optimizer.get_weight_norm = _unfused_weight_norm_decided
    unfused_optimizer.get_global_norm = _unfused_global_norm_decided
    unfused_optimizer.is_invalid_grad_norm = _is_invalid_grad_norm_decided
    unfused_optimizer.FP16_UnfusedOptimizer.unscale_and_clip_grads = _unfused_unscale_and_clip_decided


def _stage3_norm_groups_decided(self):
    """ZeRO 3's per-group norms (each a collective over the ranks): those taken ahead, served once."""
    if _NORM_AHEAD.get("stage3") is self and "skip" in _NORM_AHEAD and "groups" in _NORM_AHEAD:
        _NORM_AHEAD["served"] = _NORM_AHEAD.pop("groups")
        return _NORM_AHEAD["served"]
    return _DEEPSPEEDS_OWN["stage3_norm_groups"](self)


def _stage3_combined_norm_decided(norm_groups, norm_type=2):
    if norm_groups is _NORM_AHEAD.get("served") and norm_type == 2:
        return _NORM_AHEAD["norm"]
    return _DEEPSPEEDS_OWN["combine_norms"](norm_groups, norm_type)


def _stage3_decisions_ahead() -> None:
    """ZeRO 3's norm and norm check (a ``bool`` a step) answered by ``will_skip_update``'s."""
    from deepspeed.runtime.zero import stage3

    if "stage3_norm_groups" not in _DEEPSPEEDS_OWN:
        _DEEPSPEEDS_OWN["stage3_norm_groups"] = stage3.DeepSpeedZeroOptimizer_Stage3._get_norm_groups
        _DEEPSPEEDS_OWN["combine_norms"] = stage3.combine_grad_norm_groups
    _DEEPSPEEDS_OWN.setdefault("is_invalid", stage3.is_invalid_grad_norm)
    stage3.DeepSpeedZeroOptimizer_Stage3._get_norm_groups = _stage3_norm_groups_decided
    stage3.combine_grad_norm_groups = _stage3_combined_norm_decided
    stage3.is_invalid_grad_norm = _is_invalid_grad_norm_decided


def _zero_decisions_ahead() -> None:
    """ZeRO 1-2's overflow test, norm and norm check answered by ``will_skip_update``'s."""
    from deepspeed.runtime.zero import stage_1_and_2

    zero = stage_1_and_2.DeepSpeedZeroOptimizer
    if "zero_has_overflow" not in _DEEPSPEEDS_OWN:
        _DEEPSPEEDS_OWN["zero_has_overflow"] = zero.has_overflow
        _DEEPSPEEDS_OWN["zero_scaled_global_norm"] = zero.scaled_global_norm
    _DEEPSPEEDS_OWN.setdefault("is_invalid", stage_1_and_2.is_invalid_grad_norm)
    zero.has_overflow = _zero_has_overflow_decided
    zero.scaled_global_norm = _zero_scaled_global_norm_decided
    stage_1_and_2.is_invalid_grad_norm = _is_invalid_grad_norm_decided


def _clip_multi_tensor(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6, **newer):
    """DeepSpeed's ``clip_tensors_by_global_norm`` without reading the factor on the host."""
    if newer:
        return _DEEPSPEEDS_OWN["clip"](input_tensors, max_norm, global_norm, mpu, eps, **newer)
    if global_norm is None:
        global_norm = _global_norm_multi_tensor(input_tensors, mpu=mpu)
    if input_tensors:
        with torch.no_grad():
            factor = (max_norm / (global_norm + eps)).clamp(max=1.0)
            torch._foreach_mul_(list(input_tensors), factor)
    return global_norm


def _update_hp_grads_multi_tensor(self, clear_lp_grads=False):
    """``BF16_Optimizer.update_hp_grads``: each micro-batch's bf16 gradients added into the fp32 ones,
    ``hp.add_(lp.to(fp32))`` per parameter in DeepSpeed (two kernels and a Python call each, 402 for
    BERT-base), here one multi-tensor add that promotes bf16 as it adds (the same sums, one kernel each
    where the dtypes differ), and the bf16 gradients freed. DeepSpeed's own where it does more
    (immediate updates, AutoEP folding)."""
    if self.immediate_grad_update or getattr(self, "autoep_folding_tp_group", None) is not None:
        return _DEEPSPEEDS_OWN["update_hp_grads"](self, clear_lp_grads=clear_lp_grads)
    with torch.no_grad():
        for i, group in enumerate(self.bf16_groups):
            hp_grads, has = self.fp32_groups_gradients[i], self.fp32_groups_has_gradients[i]
            present = [j for j, lp in enumerate(group) if lp.grad is not None]
            if not present:
                continue
            hp = [hp_grads[j] for j in present]
            lp = [g if g.shape == h.shape else g.view(h.shape) for g, h in zip((group[j].grad for j in present), hp)]
            torch._foreach_add_(hp, lp)
            for j, h in zip(present, hp):
                group[j]._hp_grad = h
                has[j] = True
                # Freed, not zeroed: DeepSpeed zeroes every bf16 gradient before each micro-batch's
                # backward (backward_prologue), and autograd then adds the new gradient into the zeros,
                # a kernel and a read and write of every gradient a micro-batch (~660 MB for BERT-base);
                # with none there, autograd hands over the gradient it made. Nothing reads the bf16
                # gradients after this sum: the reduction, the norm, the clip and the update take the
                # fp32 ones.
                group[j].grad = None


def _has_overflow_serial_once(self, params) -> bool:
    """``CheckOverflow.has_overflow_serial`` (FP16_UnfusedOptimizer's, ZeRO 0 in bf16, where our decision
    does not answer it: ``_unfused_decides_as_we_can``) decided with one read:
    DeepSpeed's own per-tensor test (``has_inf_or_nan``: a device scalar each) for every gradient,
    stacked and read once, where DeepSpeed reads each in turn (one wait for the device a tensor: 202
    a step for BERT-base). The same decision; a test that answers on the host (an older DeepSpeed's)
    is taken as it is."""
    flags = [self._has_inf_or_nan(p.grad.data, i) for i, p in enumerate(params) if p.grad is not None]
    if flags and all(torch.is_tensor(f) for f in flags):
        return bool(torch.stack(flags).any())
    return any(bool(f) for f in flags)


def _fp16_optimizer_overflow_once() -> None:
    from deepspeed.runtime import utils as ds_utils

    _DEEPSPEEDS_OWN.setdefault("has_overflow_serial", ds_utils.CheckOverflow.has_overflow_serial)
    ds_utils.CheckOverflow.has_overflow_serial = _has_overflow_serial_once


def _bf16_optimizer_multi_tensor() -> None:
    """BF16_Optimizer's norm, clip and gradient sums replaced by the multi-tensor ones above, once
    DeepSpeed's own are kept for what they do not cover."""
    import deepspeed.runtime.bf16_optimizer as bf16_optimizer

    if "norm" not in _DEEPSPEEDS_OWN:
        _DEEPSPEEDS_OWN["norm"] = bf16_optimizer.get_global_norm_of_tensors
        _DEEPSPEEDS_OWN["clip"] = bf16_optimizer.clip_tensors_by_global_norm
        _DEEPSPEEDS_OWN["update_hp_grads"] = bf16_optimizer.BF16_Optimizer.update_hp_grads
        _DEEPSPEEDS_OWN.setdefault("is_invalid", bf16_optimizer.is_invalid_grad_norm)
    bf16_optimizer.get_global_norm_of_tensors = _global_norm_multi_tensor
    bf16_optimizer.is_invalid_grad_norm = _is_invalid_grad_norm_decided
    bf16_optimizer.clip_tensors_by_global_norm = _clip_multi_tensor
    bf16_optimizer.BF16_Optimizer.update_hp_grads = _update_hp_grads_multi_tensor
