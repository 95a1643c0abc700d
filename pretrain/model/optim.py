"""Optimisers and the learning-rate schedule: what the engine is handed, not how ZeRO runs it.

* ``build_optimizer``: AdamW or LAMB, weight decay on matrices only (as BERT). AdamW is torch's
  fused kernel on CUDA and the CPU alike (no build step: DeepSpeed's ``FusedAdam`` JIT-builds with
  nvcc, which pip's torch does not ship, and a build killed part-way leaves a lock that every later
  run waits on), DeepSpeed's CPU Adam under optimiser offload. LAMB is ``Lamb`` below on every
  device: DeepSpeed's ``FusedLamb`` clamps the trust ratio to [0.01, 10] and folds Adam's bias
  correction into the step size (its first update is 0.32x ours), and ``impl`` settings must not
  change results.
* ``make_skippable``: lets the loop veto one update (a non-finite loss on some rank).
* ``WarmupDecay``, ``lr_schedule``: from ``pretrain.model.schedule``.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from pretrain.config.schema import Config

if TYPE_CHECKING:  # the model module imports transformers: not needed here at run time
    from pretrain.model.mlm import MLMModel


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019), the same maths on every device: bias-corrected Adam moments, then a
    per-tensor trust ratio ||w|| / ||update|| (1 where either norm is 0, unclamped) scales the step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        # Multi-tensor: each line below is one call over every tensor of the group, not one per tensor
        # (BERT-base: 4,596 op dispatches a step before, host time a GPU waits through). The same
        # arithmetic, tensor by tensor, as the formula in the class docstring.
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
            grads = [p.grad.float() for p in params]
            weights = [p.float() for p in params]
            exp_avg, exp_avg_sq = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            torch._foreach_mul_(exp_avg, b1)
            torch._foreach_add_(exp_avg, grads, alpha=1 - b1)
            torch._foreach_mul_(exp_avg_sq, b2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - b2)
            m_hat = torch._foreach_div(exp_avg, [1 - b1 ** s["step"] for s in states])
            denom = torch._foreach_sqrt(torch._foreach_div(exp_avg_sq, [1 - b2 ** s["step"] for s in states]))
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m_hat, denom)
            if group["weight_decay"]:
                torch._foreach_add_(update, weights, alpha=group["weight_decay"])
            w_norm, u_norm = torch.stack(torch._foreach_norm(weights)), torch.stack(torch._foreach_norm(update))
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            torch._foreach_mul_(update, list(trust.unbind()))
            torch._foreach_add_(params, [u.to(p.dtype) for u, p in zip(update, params)], alpha=-group["lr"])
        return None


def build_optimizer(model: MLMModel, cfg: Config) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not biases, LayerNorm, embeddings' norms), as in BERT. The
    parameters ``model.init_from`` did not provide (``model.fresh_parameters``) learn at
    ``optim.fresh_params_lr_multiplier`` times the rate."""
    o = cfg.optim
    fresh_names = model.fresh_parameters
    groups = []
    for fresh in (False, True):
        lr = o.lr * (o.fresh_params_lr_multiplier if fresh else 1.0)
        members = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (n in fresh_names) == fresh]
        decay = [p for n, p in members if p.ndim >= 2]
        no_decay = [p for n, p in members if p.ndim < 2]
        groups += [
            g
            for g in (
                {"params": decay, "weight_decay": o.weight_decay, "lr": lr},
                {"params": no_decay, "weight_decay": 0.0, "lr": lr},
            )
            if g["params"]
        ]
    fused = cfg.impl.fused_optimizer is True or cfg.impl.fused_optimizer == "auto"
    kw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    if o.name == "adamw":
        if cfg.impl.offload_optimizer:
            # lazy: DeepSpeed's op loader, only under offload
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
        else:
            # torch's fused kernel (CUDA, CPU) updates all tensors in one pass, with no build step.
            opt = torch.optim.AdamW(groups, fused=fused or None, **kw)
    else:
        opt = Lamb(groups, **kw)
    make_skippable(opt)
    return opt


def skip_next_step(opt: torch.optim.Optimizer, skip: bool) -> None:
    """Veto (or not) the next update of an optimiser ``make_skippable`` prepared."""
    opt.skip_next_step = skip


def make_skippable(opt: torch.optim.Optimizer) -> None:
    """Let the training loop veto the next update (non-finite loss on some rank). ``overflow`` is
    the attribute DeepSpeed's engine reads after a step to count it as skipped and hold the lr
    schedule; under ZeRO its own overflow check on the (non-finite) gradients also skips.

    Why the instance's ``step`` and not a subclass: DeepSpeed's ZeRO offload checks the optimiser's
    exact type (``type(opt) == DeepSpeedCPUAdam`` in ``zero/stage_1_and_2.py`` and ``zero/stage3.py``),
    and its ZeRO optimisers must run their own ``step()`` at every boundary (it zeroes their gradient
    partitions), so neither a ``Skippable*`` subclass nor skipping ``engine.step()`` is open to us."""
    original = opt.step
    opt.skip_next_step = False
    opt.overflow = False

    def step(self, *args, **kwargs):
        self.overflow, self.skip_next_step = self.skip_next_step, False
        return None if self.overflow else original(*args, **kwargs)

    # a bound method: torch's LR schedulers wrap ``optimizer.step`` and expect one
    opt.step = types.MethodType(step, opt)
