"""Per-layer health (``train.health_every``): for the embeddings, each encoder layer and the head, the
gradient norm, the parameter norm and the update-to-parameter ratio ||delta w|| / ||w||.

OLMo, Megatron-LM and Composer's OptimizerMonitor log these to catch a layer going wrong before the
loss shows it. Every ZeRO stage: each rank sums the squares of the fp32 weights and gradients it
holds (all of them at stage 0; its optimiser partition's fragments at 1 and 2; its ZeRO-3
partition at 3), and one all-reduce of a small [3 x groups] vector makes them whole, so the cost is
a pass over the local weights every ``health_every`` steps and no gather.

Metric names group in the MLflow UI: ``health/layer_03/grad_norm``, ``health/embeddings/param_norm``,
``health/head/update_ratio``. A layer whose gradient norm is zero, not finite, or 100x its own recent
median gets a warning in the log.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections import deque

import torch
import torch.distributed as dist

from pretrain import metric_names as names
from pretrain.runtime.engine import zero3_local_fp32

log = logging.getLogger("pretrain")
_LAYER = re.compile(r"\.layers?\.(\d+)\.")
RECENT = 20  # health samples a layer's median grad norm is taken over
JUMP = 100.0  # this many times its recent median: a warning


def group_of(name: str) -> str:
    """embeddings, layer_NN or head (everything after the last layer: MLM head, final norm)."""
    m = _LAYER.search(name)
    if m:
        return f"layer_{int(m.group(1)):02d}"
    return "embeddings" if "embeddings" in name else "head"


def _mode(params, stage: int) -> str:
    """zero3: ZeRO-3 partitions; fragments: slices of flat fp32 partitions (ZeRO 1/2, and DeepSpeed's
    bf16 optimiser at stage 0); whole: every rank holds every fp32 weight and gradient."""
    if stage == 3:
        return "zero3"
    return "fragments" if stage in (1, 2) or any(hasattr(p, "_hp_mapping") for p in params) else "whole"


def _local_fragments(param, mode: str, grads: bool = True):
    """(fp32 weights, gradient) of ``param`` that this rank holds; either may be None (the gradient
    is asked for only before ``engine.step()``, which frees it)."""
    if mode == "whole":
        return param.data, param.grad
    if mode == "zero3":
        return zero3_local_fp32(param, grads)
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:  # no part of it in this rank's partition
        return None, None
    weights = mapping.get_hp_fragment()
    if not grads:
        return weights, None
    grad = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
    if grad.numel() != weights.numel():  # a full-size accumulation buffer: this rank's slice of it
        grad = grad.narrow(0, mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel)
    return weights, grad


def _norm(t: torch.Tensor) -> torch.Tensor:
    # Pairwise-summed fp32 norms with no float64 copy of the weights: float64 copies cost 14x more
    # (bench/health_cost.py) for digits the metric does not need.
    return torch.linalg.vector_norm(t, dtype=torch.float32).double()


class LayerHealth:
    """``before_step`` between the last backward and ``engine.step()``; ``after_step`` right after.
    Both run on every rank (the second is a collective)."""

    def __init__(self, engine, every: int, stage: int):
        self.every = every
        self.params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.mode = _mode([p for _, p in self.params], stage)
        groups = {group_of(n) for n, _ in self.params}
        self.groups = (
            (["embeddings"] if "embeddings" in groups else [])
            + sorted(g for g in groups if g.startswith("layer_"))
            + (["head"] if "head" in groups else [])
        )
        self.index = [self.groups.index(group_of(n)) for n, _ in self.params]
        self.recent = {g: deque(maxlen=RECENT) for g in self.groups}
        self._sums = None
        self._before: list = []

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @torch.no_grad()
    def before_step(self) -> None:
        device = self.params[0][1].device
        self._sums = torch.zeros(3, len(self.groups), dtype=torch.float64, device=device)
        self._before = []
        for (_, p), g in zip(self.params, self.index):
            weights, grad = _local_fragments(p, self.mode)
            if grad is not None:
                self._sums[0, g] += _norm(grad) ** 2
            if weights is not None:
                self._sums[1, g] += _norm(weights) ** 2
            self._before.append(None if weights is None else weights.detach().float().clone())

    @torch.no_grad()
    def after_step(self, step: int) -> dict:
        sums, self._sums = self._sums, None
        for ((_, p), g), old in zip(zip(self.params, self.index), self._before):
            if old is not None:
                sums[2, g] += torch.dist(_local_fragments(p, self.mode, grads=False)[0].float(), old).double() ** 2
        self._before = []
        if self.mode != "whole":  # partitions: each rank holds a part of every sum
            dist.all_reduce(sums)
        grad, param, update = sums.sqrt().tolist()
        metrics = {}
        for i, name in enumerate(self.groups):
            metrics[names.health(name, "grad_norm")] = grad[i]
            metrics[names.health(name, "param_norm")] = param[i]
            metrics[names.health(name, "update_ratio")] = update[i] / param[i] if param[i] else float("nan")
            self._warn(name, grad[i], step)
        return metrics

    def _warn(self, name: str, norm: float, step: int) -> None:
        recent = self.recent[name]
        median = statistics.median(recent) if len(recent) >= 3 else None
        problem = (
            "is not finite"
            if not math.isfinite(norm)
            else "is zero"
            if norm == 0.0
            else f"is {norm / median:.0f}x its recent median {median:.3g}"
            if median and norm > JUMP * median
            else None
        )
        if problem and dist.get_rank() == 0:
            log.warning("step %d: %s gradient norm %s (%.4g)", step, name, problem, norm)
        if math.isfinite(norm):
            recent.append(norm)
