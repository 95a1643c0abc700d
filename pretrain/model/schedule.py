"""The learning-rate schedule, and what happens to it when a run continues.

``WarmupDecay`` is the multiplier of ``optim.lr`` at each step: linear warm-up over
``optim.warmup_steps``, then

* ``linear`` / ``cosine``: decay to ``min_lr_ratio`` at ``train.max_steps``;
* ``constant``: 1;
* ``wsd`` (warmup-stable-decay, ModernBERT's trapezoid): 1 until the last ``decay_steps`` steps
  (``optim.decay_steps``, or ``optim.decay_fraction`` of ``max_steps`` when that is 0), then linear
  to ``min_lr_ratio`` at ``max_steps``.

The rule on resume (``continue_schedule``): the multiplier is a function of (step, the *current*
``train.max_steps``) only. A resumed run with a longer ``max_steps`` recomputes it with the new
total, so linear and cosine stretch to the new end (at the resume step the rate jumps to where the
longer schedule would be, also for a run that had decayed to zero), and wsd keeps its stable part
going and decays before the new end. LambdaLR saves a callable object's attributes in its state
dict, and loading a checkpoint put the old total back (the run then trained at lr 0); so after every
load the schedule is set from the config again.
"""

from __future__ import annotations

import math

from pretrain.config.schema import wsd_decay_steps

SCHEDULES = ("linear", "cosine", "constant", "wsd")


class WarmupDecay:
    """lr multiplier at optimiser step ``step`` (0-based: the step about to be taken)."""

    def __init__(self, warmup: int, total: int, schedule: str, min_ratio: float, decay_steps: int = 0):
        self.warmup, self.total, self.schedule, self.min_ratio = warmup, total, schedule, min_ratio
        self.decay_steps = decay_steps  # wsd only: the length of the final decay

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        start = self.warmup
        if self.schedule == "wsd":
            start = max(self.warmup, self.total - self.decay_steps)
            if step < start:
                return 1.0
        progress = min(1.0, (step - start) / max(1, self.total - start))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def lr_schedule(cfg) -> WarmupDecay:
    o = cfg.optim
    decay = wsd_decay_steps(o, cfg.train.max_steps) if o.schedule == "wsd" else 0
    return WarmupDecay(o.warmup_steps, cfg.train.max_steps, o.schedule, o.min_lr_ratio, decay)


def continue_schedule(scheduler, cfg) -> str:
    """Set ``scheduler`` (a LambdaLR around ``WarmupDecay``) to the config's schedule at the step it
    stands at, after a checkpoint may have restored an older one; the learning rates of the next
    step follow at once. Returns the start-up log line."""
    current = lr_schedule(cfg)
    before: int | None = getattr(scheduler.lr_lambdas[0], "total", None)
    for fn in scheduler.lr_lambdas:
        fn.__dict__.update(current.__dict__)
    step = scheduler.last_epoch
    lrs = [base * current(step) for base in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)
    o = cfg.optim
    end = o.lr * current(cfg.train.max_steps)  # the rate where the run ends (warm-up may outlast a short run)
    line = (
        f"schedule: {o.schedule}, lr {_lr(o.lr * current(step))} at step {step} -> {_lr(end)} at step "
        f"{cfg.train.max_steps}"
    )
    if o.warmup_steps > cfg.train.max_steps:
        line += f" (still warming up: optim.warmup_steps={o.warmup_steps})"
    if o.schedule == "wsd":
        line += f" (stable until step {max(o.warmup_steps, cfg.train.max_steps - current.decay_steps)})"
    if step and before is not None and before != cfg.train.max_steps:
        line += f"; the checkpoint's schedule ended at step {before}, recomputed for the new end"
    return line


def _lr(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"
