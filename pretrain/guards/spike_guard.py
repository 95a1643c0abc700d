"""Loss-spike recovery (``train.spike_guard``): detect a spike in the all-ranks step loss, go back to
the last complete checkpoint from before it, skip the samples that led to it, and continue.

Large runs (OPT-175B, BLOOM, PaLM) handled spikes by hand this way; here it happens in-process. The
detector's recent losses and every skipped window live in ``TrainState``: a job resumed from any
checkpoint, before or after a recovery, sees the same spike and skips the same samples, so its
losses equal the uninterrupted run's.

The tests make a spike with ``PRETRAIN_TEST_NOISE_STEPS`` (``pretrain/runtime/faults.py``).
"""

from __future__ import annotations

import logging
import math

import torch.distributed as dist

from pretrain import metric_names as names
from pretrain.checkpoint import checkpointing
from pretrain.checkpoint.state import STATE_KEY, TrainState
from pretrain.config.schema import SpikeGuardConfig

log = logging.getLogger("pretrain")


class SpikesExhausted(Exception):
    """A spike after ``max_recoveries`` recoveries, or one with no checkpoint before it."""


class SpikeDetector:
    """Mean and spread of the last ``window`` accepted step losses; ``consecutive`` steps above
    mean + ``sigmas`` x std make a spike. Steps above the line wait in ``pending``: if the run of
    them ends short of ``consecutive``, they were ordinary steps and join the window."""

    def __init__(self, cfg: SpikeGuardConfig, state: dict | None = None):
        self.cfg = cfg
        self.history: list[float] = list((state or {}).get("history", []))
        self.pending: list[list] = [list(p) for p in (state or {}).get("pending", [])]

    def state_dict(self) -> dict:
        return {"history": list(self.history), "pending": [list(p) for p in self.pending]}

    def threshold(self) -> float | None:
        if len(self.history) < self.cfg.min_window:
            return None
        n = len(self.history)
        mean = sum(self.history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / max(n - 1, 1))
        # A flat stretch would otherwise call the smallest wobble a spike.
        return mean + self.cfg.sigmas * max(std, 1e-3 * abs(mean), 1e-6)

    def observe(self, step: int, loss: float) -> tuple[int, int] | None:
        """Feed step ``step``'s loss; returns (first, last) spiking step once a spike is confirmed."""
        if not math.isfinite(loss):
            return None  # the non-finite skip handles these
        line = self.threshold()
        if line is not None and loss > line:
            self.pending.append([step, loss])
            if len(self.pending) >= self.cfg.consecutive:
                return self.pending[0][0], self.pending[-1][0]
            return None
        for value in [p[1] for p in self.pending] + [loss]:
            self.history.append(value)
        self.pending = []
        del self.history[: -self.cfg.window]
        return None


class SpikeGuard:
    """What ``fit`` calls: ``check`` after every step, ``recover`` when it returns a spike."""

    def __init__(self, cfg: SpikeGuardConfig, global_batch: int, root, tracker):
        self.cfg, self.global_batch, self.root, self.tracker = cfg, global_batch, root, tracker

    def check(self, loss: float, state: TrainState, step: int) -> tuple[int, int] | None:
        """``loss``: step ``step``'s MLM loss over all ranks (``StepResult.loss``, read with the step's
        flags: a step that logs nothing is read by the next one)."""
        detector = SpikeDetector(self.cfg, state.spike_detector)
        spike = detector.observe(step, loss)
        state.spike_detector = detector.state_dict()
        return spike

    def checkpoint_before(self, first: int) -> str | None:
        tags = [t for t in checkpointing.complete_tags(self.root) if t.startswith("step") and int(t[4:]) < first]
        return tags[-1] if tags else None

    def recover(self, engine, cfg, nodes, state: TrainState, stream, batches, spike: tuple[int, int], spike_end: int):
        """Reload the checkpoint before ``spike`` and move the data stream past it (at least to
        ``spike_end``, the stream's position after the spike's last step); returns the new batch
        iterator. Raises SpikesExhausted past the cap or with no checkpoint to go back to."""
        first, last = spike
        done = list(state.skipped_windows)
        tag = self.checkpoint_before(first)
        where = f"loss spike from step {first} to {last}"
        if len(done) >= self.cfg.max_recoveries:
            raise SpikesExhausted(
                f"{where} after {len(done)} recoveries (train.spike_guard.max_recoveries="
                f"{self.cfg.max_recoveries}); the checkpoints are untouched. Lower optim.lr, "
                "raise warmup or look at the data of those steps."
            )
        if tag is None:
            raise SpikesExhausted(
                f"{where}, and no complete checkpoint from before step {first} to go back "
                "to; set train.checkpoint_every lower"
            )
        batches.close()  # stops its DataLoader workers
        state.load_state_dict(checkpointing.load(engine, cfg, tag, nodes)[STATE_KEY])
        stream.load_state_dict(state.data)
        start = stream.samples_consumed
        end = max(start + self.cfg.skip_steps * self.global_batch, spike_end)
        record = {"spike_from": first, "spike_to": last, "checkpoint": tag, "samples": [start, end]}
        state.skipped_windows = done + [record]
        stream.samples_consumed = end
        message = f"{where}: back to {tag}, samples {start} to {end} skipped"
        if dist.get_rank() == 0:
            log.warning("%s (recovery %d of at most %d)", message, len(state.skipped_windows), self.cfg.max_recoveries)
        self.tracker.log_event("spike_recovery", message, last)
        # The steps from the checkpoint to the spike train again; every store keeps their first values
        # (the spike stays on the curves) and one row per step.
        # A cumulative count: a chart in MLflow, and the report marks the step where it grows.
        self.tracker.log_metrics({names.TRAIN_SPIKE_RECOVERIES: len(state.skipped_windows)}, last)
        return iter(stream)
