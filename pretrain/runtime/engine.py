"""DeepSpeed's engine: process group, the derived DeepSpeed JSON, the ZeRO engine, its shards on
disk, whole weights at ZeRO-3. Every change to DeepSpeed's internals is ``deepspeed_patches``'s,
checked against the versions it names before it is made.

The model (``pretrain.model.mlm``) is single-device code; the optimisers are in ``pretrain.model.optim``, and
what makes a checkpoint complete and resumable is in ``pretrain.checkpoint.checkpointing``.
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
from pretrain.runtime import deepspeed_patches, graph_records, hardware
from pretrain.runtime.deepspeed_patches import give_decision as give_decision  # the step's doors to them
from pretrain.runtime.deepspeed_patches import will_skip_update as will_skip_update
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
    """The installed DeepSpeed against the floor this trainer was tested with, read from the package
    metadata; a version the patches were not checked on (``deepspeed_patches.CHECKED_VERSIONS``) is
    imported and its internals compared with theirs (seconds, only then)."""
    if installed is None:
        try:
            installed = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            return ["DeepSpeed is not installed: pip install 'deepspeed==0.19.8' (launchers/setup_env.sh)"]
    numbers = tuple(int(part) for part in re.findall(r"\d+", installed)[:3])
    if numbers < DEEPSPEED_FLOOR:
        floor = ".".join(map(str, DEEPSPEED_FLOOR))
        return [
            f"DeepSpeed {installed} is installed; this trainer needs {floor} or newer (older BF16 "
            f"optimisers crash on a non-finite step instead of skipping it): pip install "
            f"'deepspeed=={deepspeed_patches.CHECKED_VERSIONS[-1]}' (the version pyproject.toml pins)"
        ]
    if deepspeed_patches.checked(installed):
        return []
    import_deepspeed()
    changed = deepspeed_patches.internals_problems()
    return [deepspeed_patches.internals_refusal(changed)] if changed else []


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
    if hardware.weights_precision(precision) == "bf16":
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
    groups = tuple(g for g in deepspeed_patches.PATCH_GROUPS if getattr(cfg.impl.deepspeed_patches, g))
    deepspeed_patches.apply_patches("optimizer" in ds_config, groups)  # checked, or a named error
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


def compile_engine(engine, cuda_graphs: bool, autotune: bool = False) -> None:
    """``torch.compile`` the engine's module; ``cuda_graphs``: its graphs recorded and replayed;
    ``autotune``: inductor's kernels chosen by timing (``impl.autotune_kernels``). In torch's modes."""
    mode = {
        (False, False): None,
        (True, False): "reduce-overhead",
        (False, True): "max-autotune-no-cudagraphs",
        (True, True): "max-autotune",
    }[(cuda_graphs, autotune)]
    if cuda_graphs:
        graph_records.watch()  # inductor says on its debug log only when it records a graph again
    engine.compile(compile_kwargs={"mode": mode} if mode else {})


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


def zero3_local_fp32(param, grads: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(fp32 weights, gradient) of the part of a ZeRO-3 parameter this rank holds (DeepSpeed's own
    getters); the gradient only when ``grads`` (``engine.step()`` frees it)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad

    return safe_get_local_fp32_param(param), safe_get_local_grad(param) if grads else None


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
