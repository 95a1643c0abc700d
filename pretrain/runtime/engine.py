"""DeepSpeed, and only DeepSpeed: process group, the derived DeepSpeed JSON, the ZeRO engine, its
shards on disk, whole weights at ZeRO-3.

The model (``pretrain.model.mlm``) is single-device code; the optimisers are in ``pretrain.model.optim``, and
what makes a checkpoint complete and resumable is in ``pretrain.checkpoint.store``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import socket
import sys
import threading
import types
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from pretrain.config import loader as configlib
from pretrain.config.loader import ConfigError
from pretrain.config.schema import Config, batch_size_problems
from pretrain.model.optim import build_optimizer
from pretrain.model.schedule import lr_schedule
from pretrain.runtime.launcher import GIVEN_DEVICES

if TYPE_CHECKING:  # DeepSpeed is imported when an engine is built (import_deepspeed), not at start-up
    from deepspeed import DeepSpeedEngine as Engine
else:
    Engine = Any

log = logging.getLogger("pretrain")


@dataclass
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def _map_slurm_env() -> None:
    """Ranks started straight by ``srun`` (no deepspeed/torchrun launcher) only have SLURM_*."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def _keep_given_devices() -> None:
    given = os.environ.get(GIVEN_DEVICES, "")
    if given and os.environ.get("CUDA_VISIBLE_DEVICES") != given:
        os.environ["CUDA_VISIBLE_DEVICES"] = given  # before torch initialises CUDA (it is lazy)


def cuda_index(local_rank: int, device_count: int) -> int:
    """The GPU of a node's ``local_rank``-th rank. A rank that sees one GPU (``srun --gpus-per-task=1``,
    each task its own) uses it whatever its local rank; more ranks than GPUs is an error."""
    if device_count == 1:
        return 0
    if local_rank >= device_count:
        raise RuntimeError(
            f"local rank {local_rank} but only {device_count} GPUs are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    return local_rank


def prepare_env() -> None:
    """Before the config is validated: world size must be known (global batch check), and a
    single process run with plain ``python -m`` needs rendezvous variables of its own."""
    _map_slurm_env()
    _keep_given_devices()
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        train_on_cpu()
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(port)),
        )


def train_on_cpu() -> None:
    """A CPU run on a machine with GPUs (``impl.device=cpu``, or DeepSpeed told ``cpu``): torch sees
    no GPU either, so that nothing picks CUDA paths (pinned memory, flash attention, NCCL). Before
    torch first asks CUDA for its devices."""
    os.environ["DS_ACCELERATOR"] = "cpu"  # read at DeepSpeed's first get_accelerator()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def import_deepspeed():
    """DeepSpeed, imported without the ``import mlflow`` its autotuner makes at import time: 2 s of
    every rank's start-up, for a feature this trainer does not use. mlflow stays importable after."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # a None entry makes `import mlflow` fail, quietly, there
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def init_distributed(cfg: Config) -> DistInfo:
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    backend = cfg.impl.dist_backend
    if backend == "auto":
        backend = accel.communication_backend_name() if accel.device_name() != "cpu" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accel.device_name() == "cuda":
        device = torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device(accel.device_name())
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


# Before 0.19.8, DeepSpeed's BF16_Optimizer (ZeRO 1 with bf16 and fp32 accumulation: configs/base.yaml)
# asserted a positive gradient norm, so a non-finite step crashed every rank instead of being skipped.
DEEPSPEED_FLOOR = (0, 19, 8)


def deepspeed_problems(installed: str | None = None) -> list[str]:
    """The installed DeepSpeed against the floor this trainer was tested with; read from the package
    metadata, without importing it."""
    if installed is None:
        try:
            installed = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            return ["DeepSpeed is not installed: pip install 'deepspeed>=0.19.8' (launchers/setup_env.sh)"]
    numbers = tuple(int(part) for part in re.findall(r"\d+", installed)[:3])
    if numbers < DEEPSPEED_FLOOR:
        floor = ".".join(map(str, DEEPSPEED_FLOOR))
        return [
            f"DeepSpeed {installed} is installed; this trainer needs {floor} or newer (older BF16 "
            f"optimisers crash on a non-finite step instead of skipping it): pip install 'deepspeed>={floor}'"
        ]
    return []


def deepspeed_config(
    cfg: Config, world: int, precision: str, node_local: bool = False, num_params: int | None = None
) -> dict:
    """The DeepSpeed JSON, derived from our config: nothing in it is set by hand elsewhere.
    ``node_local``: each node's first rank also writes the model states rank 0 writes (train.out_dir
    on node-local disks, pretrain.checkpoint.nodes). ``num_params``: the model's size, which caps the
    ZeRO buckets."""
    problems = batch_size_problems(cfg.train.global_batch_size, cfg.impl.micro_batch_size, world)
    if problems:
        raise ConfigError(problems)
    zero: dict[str, Any] = {"stage": cfg.impl.zero_stage}
    if cfg.impl.zero_stage >= 1:
        # ZeRO 1-2 allocate the contiguous reduce bucket at its full size on every micro-step (200 MB
        # in fp32 at 5e7): no larger than the model, which changes nothing else (all of a smaller
        # model's gradients fit one bucket either way). Rounded up to a multiple of 64 elements:
        # DeepSpeed asserts an even all-gather bucket, and a vocabulary such as RoBERTa's 50,265 makes
        # the parameter count odd.
        bucket = -(-int(min(5e7, num_params)) // 64) * 64 if num_params else int(5e7)
        zero.update(
            contiguous_gradients=True,
            overlap_comm=torch.cuda.is_available(),
            reduce_bucket_size=bucket,
            allgather_bucket_size=bucket,
        )
    if cfg.impl.zero_stage == 3:
        # The MLM head is gathered on every step; keeping small params resident avoids re-gathering.
        zero.update(stage3_param_persistence_threshold=int(1e5), stage3_gather_16bit_weights_on_model_save=False)
    if cfg.impl.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    ds = {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.impl.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps(world),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on unless the JSON says otherwise) synchronises the device at
        # the start and end of every micro-batch: 2 waits a micro-batch, 64 a step at base.yaml's shape
        # on one GPU. Our step timing needs none of it.
        "timers": {"throughput": {"enabled": False}},
        # a client optimiser other than Adam (our LAMB on CPU) under ZeRO
        "zero_allow_untested_optimizer": True,
    }
    if node_local:
        ds["checkpoint"] = {"use_node_local_storage": True}
    if precision == "bf16":
        # Gradients are summed over micro-steps and reduced across ranks in fp32, as NVIDIA's BERT and
        # Megatron do: a bf16 sum keeps 8 mantissa bits. At ZeRO 1 DeepSpeed takes its BF16_Optimizer
        # for this; ZeRO 0 has no fp32 accumulation (DeepSpeed refuses the mix).
        ds["bf16"] = {"enabled": True}
        ds["communication_data_type"] = "fp32"
        if cfg.impl.zero_stage >= 1:
            ds["data_types"] = {"grad_accum_dtype": "fp32"}
    elif precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return configlib.merge(ds, cfg.impl.deepspeed)


def initialize(model: torch.nn.Module, cfg: Config, info: DistInfo, precision: str, node_local: bool = False):
    """The ZeRO engine around ``model``, our optimiser and schedule; returns (engine, scheduler,
    the DeepSpeed JSON used, our own optimiser inside DeepSpeed's wrappers)."""
    import deepspeed

    ds_config = deepspeed_config(cfg, info.world, precision, node_local, num_parameters(model))
    if "optimizer" not in ds_config:
        _skip_muon_import()
    _mask_nonfinite_norm_on_the_device()
    _bf16_optimizer_multi_tensor()
    _zero_decisions_ahead()
    _unfused_decisions_ahead()
    _stage3_decisions_ahead()
    _fp16_optimizer_overflow_once()
    schedule = lr_schedule(cfg)
    if cfg.impl.zero_stage == 3 and getattr(model, "fused_loss", False):
        # The fused loss reads the decoder's weight (the word embeddings) outside the decoder's own
        # forward: ZeRO-3 must gather it for the whole model's forward and backward.
        for param in model.decoder.parameters():
            deepspeed.zero.register_external_parameter(model, param)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=build_optimizer(model, cfg),
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
    )
    return engine, scheduler, ds_config, inner_optimizer(engine)


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
    The norm ``grad_norm_ahead`` took of these very gradients, if it did."""
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
# norm (and the overflow test) are taken there (``grad_norm_ahead``), the answer read with the step's
# other numbers, and DeepSpeed's step given that norm and that answer (``norm_decided``) in place of
# taking and reading them again. The same norm, the same decision; no answer given, DeepSpeed's own.
_NORM_AHEAD: dict = {}


def grad_norm_ahead(engine) -> torch.Tensor | None:
    """Whether the coming step of DeepSpeed's optimiser wrapper will skip its update (its gradient norm
    non-finite, or DeepSpeed's -1 for one; at ZeRO 1-2 an overflowed gradient too), as a float64 0/1
    on the device, the norm taken now. None where DeepSpeed decides alone: ZeRO 0 and 3, fp16's loss
    scaling, expert layers, offload, and where the gradients are not yet reduced (DeepSpeed's
    unmanaged accumulation reduces them in ``step()``)."""
    import deepspeed.runtime.bf16_optimizer as bf16_optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    _NORM_AHEAD.clear()
    opt = engine.optimizer
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
    ``grad_norm_ahead`` took; DeepSpeed's own (a read) for any other tensor."""
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
    wait each, five a step) answered by ``grad_norm_ahead``'s."""
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
    """ZeRO 3's norm and norm check (a ``bool`` a step) answered by ``grad_norm_ahead``'s."""
    from deepspeed.runtime.zero import stage3

    if "stage3_norm_groups" not in _DEEPSPEEDS_OWN:
        _DEEPSPEEDS_OWN["stage3_norm_groups"] = stage3.DeepSpeedZeroOptimizer_Stage3._get_norm_groups
        _DEEPSPEEDS_OWN["combine_norms"] = stage3.combine_grad_norm_groups
    _DEEPSPEEDS_OWN.setdefault("is_invalid", stage3.is_invalid_grad_norm)
    stage3.DeepSpeedZeroOptimizer_Stage3._get_norm_groups = _stage3_norm_groups_decided
    stage3.combine_grad_norm_groups = _stage3_combined_norm_decided
    stage3.is_invalid_grad_norm = _is_invalid_grad_norm_decided


def _zero_decisions_ahead() -> None:
    """ZeRO 1-2's overflow test, norm and norm check answered by ``grad_norm_ahead``'s."""
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


def hold_schedule(engine) -> None:
    """An update DeepSpeed's step counted as made (its own checks passed) that ours skipped (a
    non-finite loss, an unreadable batch, or a masked update: pretrain/step.py, "Deferred reads"): counted
    as DeepSpeed counts its own skips, and the learning-rate schedule moved back the one step that
    DeepSpeed's step advanced it, so the next update runs at the skipped one's rate."""
    engine.skipped_steps += 1
    scheduler = engine.lr_scheduler
    if scheduler is None:
        return
    scheduler.last_epoch -= 1
    # ours is a LambdaLR (``initialize``): its rates are the base rates times the schedule's factor
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


def local_grad_norm(engine) -> float:
    """Global L2 norm of the (already all-reduced) gradients, for ZeRO stage 0 where every rank
    holds them all; call after the boundary backward and before ``engine.step()``."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0  # torch 2.6+, the floor


def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The client optimiser (ours), under whatever wrapper DeepSpeed put around it. Without it,
    non-finite steps could not be skipped: a DeepSpeed version that hides it is an error."""
    opt, seen = engine.optimizer, []
    while not hasattr(opt, "skip_next_step"):
        seen.append(type(opt).__name__)
        opt = getattr(opt, "optimizer", None)
        if opt is None:
            raise RuntimeError(
                f"our optimiser is not inside DeepSpeed's wrappers ({' > '.join(seen)}): "
                "non-finite steps could not be skipped"
            )
    return opt


def eager_forward(engine, eager: bool):
    """Run a compiled engine's forward (and so its backward) eagerly when ``eager``.

    A compiled model is traced once, for full rows (``attention_mask`` None) in training mode. The
    rare padded batch (a data-prep task's last row) and evaluation (no grad, eval mode, a few
    batches) would each make torch.compile build and keep another graph, tens of seconds of
    compilation inside the run for a handful of batches; eagerly they cost no compilation at all.
    Eager and compiled compute the same maths, so resume stays exact either way."""
    if not eager or not getattr(engine, "is_compiled", False) or not hasattr(torch.compiler, "set_stance"):
        return contextlib.nullcontext()  # torch < 2.6 has no stance: it recompiles, as before
    return torch.compiler.set_stance("force_eager")


def cuda_graphs_plan(cfg: Config, device_type: str, compiled: bool) -> tuple[bool, str]:
    """Whether the compiled step replays as CUDA graphs (``impl.cuda_graphs``), and why, for the start
    line. The config's own checks (``schema.cuda_graphs_problems``) have refused what cannot work."""
    asked = cfg.impl.cuda_graphs
    if asked is False:
        return False, "off (impl.cuda_graphs=false)"
    if asked == "auto":
        return False, "off (impl.cuda_graphs=auto: off until a GPU lease has measured them against eager)"
    if device_type != "cuda":
        return False, "off: impl.cuda_graphs=true, but this run has no CUDA device"
    if not compiled:
        return False, "off: impl.cuda_graphs=true, but this launch does not compile (impl.compile=auto, few steps)"
    return True, "on (torch.compile's reduce-overhead: the forward and backward replayed as CUDA graphs)"


def compile_engine(engine, cuda_graphs: bool) -> None:
    """``torch.compile`` the engine's module; ``cuda_graphs``: its graphs recorded and replayed."""
    engine.compile(compile_kwargs={"mode": "reduce-overhead"} if cuda_graphs else {})


def new_graph_step(cuda_graphs: bool) -> None:
    """Before each micro-batch's forward under CUDA graphs: the outputs of the one before (its loss,
    read into the step's sums) may be overwritten by this replay."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


def num_parameters(module: torch.nn.Module) -> int:
    """Whole-model count also at ZeRO-3, where each rank holds only a partition."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


@contextlib.contextmanager
def full_weights(engine):
    """The whole model's weights on every rank for the duration (a no-op below ZeRO-3)."""
    if engine.zero_optimization_stage() < 3:
        yield engine.module
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield engine.module


def full_fp32_weights(engine, keep: bool) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master weights, whole, and the module's persistent buffers: what an
    export needs when no one folder holds every rank's shards (node-local disks). A collective: each
    parameter's partitions meet over the process group, one at a time; only a rank that ``keep``s
    holds the result (the others return an empty dict)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    persistent = set(module.state_dict().keys())
    state = {}
    for name, param in module.named_parameters():
        full = safe_get_full_fp32_param(param)  # None without a ZeRO/BF16 master: the weight itself
        if keep:
            state[name] = (param.detach() if full is None else full).float().cpu().clone()
    if keep:
        state.update({name: buf.detach().cpu().clone() for name, buf in module.named_buffers() if name in persistent})
    return state


def rank0_value(value):
    """The first rank's ``value`` on every rank (e.g. the tracking run id, so that all ranks write
    the same one into a checkpoint). A collective; without a process group, ``value`` unchanged."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def release_shared_memory() -> None:
    """DeepSpeed's CPU shared-memory all-reduce creates one /dev/shm segment per rank and never
    removes it (64 MiB each): on a machine that runs many jobs they fill /dev/shm, which is RAM.
    Unlinking our own segment at exit is safe: peers mapped it at start, and mappings outlive names.
    Only one this process maps: a rank that failed before creating its own (its master port taken by
    another job, say) would otherwise remove that job's live segment by name, and its peers wait forever."""
    name = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}"
    )
    try:
        with open("/proc/self/maps") as maps:
            if not any(line.rstrip("\n").endswith(" " + name) for line in maps):
                return
        os.unlink(name)
    except OSError:
        pass


def end_process(code: int) -> NoReturn:
    """End a rank that has left its process group with ``code``, without the interpreter's final
    teardown of C++ objects.

    Why: after a ZeRO-3 run the engine stays reachable (DeepSpeed defines autograd Function classes
    per module whose methods close over the module, and every parameter names its process group), so
    the process groups and gloo's threads (``pt_gloo_runloop``, ``gloo_tcp_loop``; the TCPStore's on
    rank 0) outlive ``destroy_process_group``: neither it nor the backend's ``shutdown``/``abort``
    joins them. They were then destroyed during interpreter finalisation, where a C++ thread that
    needs the GIL is ended inside a frame that must not unwind: "terminate called without an active
    exception", SIGABRT, and the launcher exits 250 for a finished run.
    Python's own exit steps still run, in its order: non-daemon threads joined with their exit hooks
    (concurrent.futures'), atexit handlers (MLflow's, logging's), standard streams flushed. Only the
    teardown after them is skipped: every file the run writes is closed by then."""
    threading._shutdown()  # private, but it is exactly Py_FinalizeEx's first step
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
