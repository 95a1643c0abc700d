"""Everything distributed: process group, the derived DeepSpeed JSON, the ZeRO engine, checkpoints.

The model (``pretrain.model``) is single-device code; this module is the only one that knows about
ZeRO stages, precisions, optimiser kernels and how a checkpoint becomes "complete".
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from pretrain.config import Config, batch_size_problems
from pretrain import configlib
from pretrain.configlib import ConfigError

log = logging.getLogger("pretrain")

LATEST = "latest"              # DeepSpeed's own pointer file name; we write it ourselves, last
COMPLETE = "COMPLETE"          # marker inside a tag folder: every rank's files are on disk


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


def prepare_env() -> None:
    """Before the config is validated: world size must be known (global batch check), and a
    single process run with plain ``python -m`` needs rendezvous variables of its own."""
    _map_slurm_env()
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def init_distributed(cfg: Config) -> DistInfo:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    backend = cfg.impl.dist_backend
    if backend == "auto":
        backend = accel.communication_backend_name() if accel.device_name() != "cpu" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accel.device_name() == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(accel.device_name())
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def resolve_precision(cfg: Config, device: torch.device) -> str:
    from deepspeed.accelerator import get_accelerator

    wanted = cfg.impl.precision
    if wanted == "auto":
        return "bf16" if get_accelerator().is_bf16_supported() else "fp32"
    if wanted == "fp16" and device.type == "cpu":
        raise ConfigError(["impl.precision: fp16 is not supported on the CPU; use bf16 or fp32"])
    return wanted


def deepspeed_config(cfg: Config, world: int, precision: str) -> dict:
    """The DeepSpeed JSON, derived from our config: nothing in it is set by hand elsewhere."""
    problems = batch_size_problems(cfg.train.global_batch_size, cfg.impl.micro_batch_size, world)
    if problems:
        raise ConfigError(problems)
    zero: dict[str, Any] = {"stage": cfg.impl.zero_stage}
    if cfg.impl.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=torch.cuda.is_available(),
                    reduce_bucket_size=int(5e7), allgather_bucket_size=int(5e7))
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
        "steps_per_print": 10 ** 9,      # we log ourselves
        "wall_clock_breakdown": False,
        # a client optimiser other than Adam (our LAMB on CPU) under ZeRO
        "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return configlib.merge(ds, cfg.impl.deepspeed)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) for devices without DeepSpeed's fused kernel: Adam moments, then a
    per-tensor trust ratio ||w|| / ||update|| scales the step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                g = p.grad.float()
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = state["exp_avg"] / (1 - b1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p.float(), alpha=group["weight_decay"])
                w_norm, u_norm = p.float().norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_((update * trust).to(p.dtype), alpha=-group["lr"])
        return None


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not biases, LayerNorm, embeddings' norms), as in BERT."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    o = cfg.optim
    fused = cfg.impl.fused_optimizer is True or (cfg.impl.fused_optimizer == "auto" and device.type == "cuda")
    if o.name == "adamw":
        if cfg.impl.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, adamw_mode=True)
        elif fused:
            from deepspeed.ops.adam import FusedAdam
            opt = FusedAdam(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, adam_w_mode=True)
        else:
            opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    else:
        if fused:
            from deepspeed.ops.lamb import FusedLamb
            opt = FusedLamb(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        else:
            opt = Lamb(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    _make_skippable(opt)
    return opt


def _make_skippable(opt: torch.optim.Optimizer) -> None:
    """Let the training loop veto the next update (non-finite loss on some rank). ``overflow`` is
    the attribute DeepSpeed's engine reads after a step to count it as skipped and hold the lr
    schedule; under ZeRO its own overflow check on the (non-finite) gradients also skips."""
    original = opt.step
    opt.skip_next_step = False
    opt.overflow = False

    def step(self, *args, **kwargs):
        self.overflow, self.skip_next_step = self.skip_next_step, False
        return None if self.overflow else original(*args, **kwargs)

    # a bound method: torch's LR schedulers wrap ``optimizer.step`` and expect one
    opt.step = types.MethodType(step, opt)


class WarmupDecay:
    """lr multiplier: linear warmup, then linear or cosine decay to ``min_ratio`` at ``total``.
    A class (not a closure) so LambdaLR can put it in its state dict."""

    def __init__(self, warmup: int, total: int, schedule: str, min_ratio: float):
        self.warmup, self.total, self.schedule, self.min_ratio = warmup, total, schedule, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def initialize(model: torch.nn.Module, cfg: Config, info: DistInfo, precision: str):
    import deepspeed

    ds_config = deepspeed_config(cfg, info.world, precision)
    optimizer = build_optimizer(model, cfg, info.device)
    schedule = WarmupDecay(cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.schedule, cfg.optim.min_lr_ratio)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    return engine, optimizer, scheduler, ds_config


def local_grad_norm(engine) -> float:
    """Global L2 norm of the (already all-reduced) gradients, for ZeRO stage 0 where every rank
    holds them all; call after the boundary backward and before ``engine.step()``."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The client optimiser (ours), under whatever wrapper DeepSpeed put around it."""
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and not hasattr(opt, "skip_next_step"):
        opt = opt.optimizer
    return opt


# ---------------------------------------------------------------- checkpoints
def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.train.out_dir) / "checkpoints"


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(root: Path) -> list[str]:
    """Tags whose every file is on disk, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / COMPLETE).is_file())


def latest_complete_tag(root: Path) -> Optional[str]:
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if (root / tag / COMPLETE).is_file():
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, cfg: Config, step: int, client_state: dict, extra_files: dict[str, str],
                    copy_dirs: dict[str, Path] = {}) -> str:
    """A checkpoint counts only when complete: every rank writes its shards, all meet at a barrier,
    then rank 0 writes the COMPLETE marker and, last, the ``latest`` pointer. A crash anywhere
    before that leaves the previous checkpoint the one that ``resume=auto`` finds."""
    root = checkpoint_root(cfg)
    tag = tag_for_step(step)
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        folder = root / tag
        for name, text in extra_files.items():
            _write_atomic(folder / name, text)
        for name, src in copy_dirs.items():
            shutil.copytree(src, folder / name, dirs_exist_ok=True)
        _write_atomic(folder / COMPLETE, json.dumps({"step": step}) + "\n")
        _write_atomic(root / LATEST, tag)
        keep = cfg.train.keep_checkpoints
        if keep:
            for old in complete_tags(root)[:-keep]:
                shutil.rmtree(root / old, ignore_errors=True)
    dist.barrier()
    return tag


def load_checkpoint(engine, cfg: Config) -> tuple[Optional[str], dict]:
    """Honour ``train.resume``: auto (latest complete, if any), none, or a tag."""
    root = checkpoint_root(cfg)
    if cfg.train.resume == "none":
        return None, {}
    tag = latest_complete_tag(root) if cfg.train.resume == "auto" else cfg.train.resume
    if tag is None:
        return None, {}
    if not (root / tag / COMPLETE).is_file():
        raise RuntimeError(f"train.resume={tag!r}: {root / tag} is not a complete checkpoint "
                           f"(complete ones: {', '.join(complete_tags(root)) or 'none'})")
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    return tag, client_state or {}


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
