"""One optimiser step and what ``fit`` keeps between steps: ``train_step`` (mask on the device,
forward, backward, step), the throughput window that the loss and speed metrics average, and the stop
signal that SIGUSR1/SIGTERM raise."""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pretrain import metric_names as names
from pretrain.config.objective import MaskingConfig
from pretrain.guards import bad_input
from pretrain.model.masking import SpecialIds, mask_batch, rate_at_step, split_rows
from pretrain.model.mlm import MLMModel
from pretrain.model.optim import skip_next_step
from pretrain.runtime import engine as eng
from pretrain.runtime.profiling import phase


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit or preemption) and SIGTERM ask the loop to
    finish the current step, checkpoint and exit. Further signals during the save change nothing."""

    def __init__(self, signums=(signal.SIGUSR1, signal.SIGTERM)):
        self.requested, self.name = False, ""
        for s in signums:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if not self.requested:
            self.name = signal.Signals(signum).name
            print(
                f"[rank {os.environ.get('RANK', '?')}] received {self.name}: will checkpoint after this step",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True


MASK_INPUTS = ("input_ids", "word_starts", "sample_ids")  # what masking reads of a micro-batch


@dataclass(frozen=True)
class StepParts:
    """What an optimiser step reads besides its batches and the step number (``Run.step_parts``)."""

    engine: eng.Engine
    optimizer: torch.optim.Optimizer  # ours, inside DeepSpeed's wrappers: the step may veto its update
    model: MLMModel  # the engine's module: its dropout is keyed per micro-batch
    device: torch.device
    world: int
    special: SpecialIds
    masking: MaskingConfig
    max_steps: int  # where a masking-rate schedule ends
    zero_stage: int  # at 0 the gradient norm is ours to compute on a logged step
    stop: StopSignal


@dataclass
class StepResult:
    sums: torch.Tensor  # float64 [loss_sum, correct, predicted, tokens] on the device, this rank's;
    # correct only on a logged step (0 otherwise)
    loss: float  # the step's MLM loss over all ranks (nan when non-finite)
    nonfinite: bool  # some rank's loss was not finite: the update was skipped everywhere
    stop: bool  # some rank was asked to stop
    grad_norm: float | None  # ZeRO 0 only, when asked (DeepSpeed keeps none there)
    bad_input: bool = False  # some rank could not read its batch (guards.bad_input): stop, exit 2
    outage: bool = False  # ... because the data's store stayed down: stop, exit 3 (requeue)


def mask_micro_batches(parts: StepParts, step: int, micro_batches: list[dict]) -> tuple[list[tuple], torch.Tensor]:
    """(masked batch, attention mask, tokens, sample ids) per micro-batch, on the device, and the
    masked tokens of them all. The micro-batches are masked together, in one call: keyed by each
    sequence's identity (and the step, unless static), a row's mask is the same in any batch, at any
    world size or micro-batch, and one call launches a step's masking kernels once, not per
    micro-batch (on a GPU they follow the step's wait for the device, with nothing queued before them)."""
    device, special = parts.device, parts.special
    on_device = [{k: batch[k].to(device, non_blocking=True) for k in MASK_INPUTS} for batch in micro_batches]
    rows = [b["input_ids"].shape[0] for b in on_device]
    ids, starts, sample_ids = (_stacked([b[k] for b in on_device]) for k in MASK_INPUTS)
    rate = rate_at_step(parts.masking, step, parts.max_steps)
    m = mask_batch(ids, starts, special, parts.masking, sample_ids=sample_ids, step=step, rate=rate)
    masked = []
    for part, batch, inputs in zip(split_rows(m, rows, parts.masking.fixed_count), micro_batches, on_device):
        # Rows packed full have no padding: no mask lets SDPA take its fast path.
        attention_mask = (inputs["input_ids"] != special.pad) if batch.get("has_padding", True) else None
        tokens = part.input_ids.numel() if attention_mask is None else attention_mask.sum()
        masked.append((part, attention_mask, tokens, inputs["sample_ids"]))
    return masked, m.num_masked


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def train_step(
    parts: StepParts,
    step: int,
    micro_batches: list[dict],
    logged: bool,
    before_step: Optional[Callable[[], None]] = None,
) -> StepResult:
    """Forward and backward over the micro-batches of step ``step + 1``, then one optimiser step
    (``step``: the steps done, which key the masks and the dropout). ``logged``: the
    step's metrics are logged, so its accuracy and (ZeRO 0) gradient norm are computed. ``before_step``
    runs where the gradients are whole and the weights not yet updated (per-layer health).

    The host reads from the device once per step (``decide_update``), after the last backward and
    before the update: whether to skip the update (a non-finite loss, an unreadable batch) is a branch
    of DeepSpeed's step on the host, and the spike guard and a stop signal are decided from the same
    numbers; so are DeepSpeed's own checks of the gradients (``engine.grad_norm_ahead``). Everything
    else stays on the device until a logged step (``ThroughputWindow``)."""
    engine, device, world = parts.engine, parts.device, parts.world
    with phase("mask"):
        masked, predicted = mask_micro_batches(parts, step, micro_batches)
    # The loss is normalised by the masked-token count of the whole step, all ranks together:
    # DeepSpeed then divides by grad_accum and averages over ranks, which this undoes.
    predicted = predicted.double().reshape(1)
    dist.all_reduce(predicted)
    scale = world * len(masked) / predicted.clamp(min=1.0)
    level = bad_input.failure_level(micro_batches)
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    grad_norm = None
    # Compiled, the argmax is taken every step: a bool that turns on at logged steps would trace a
    # second graph (a recompile at the first logged step) for the price of one reduction per chunk.
    want_correct = logged or bool(getattr(engine, "is_compiled", False))
    for i, (m, attention_mask, tokens, sample_ids) in enumerate(masked):
        # Dropout keyed like the masks, by each row's sample id and the step (model/keyed_dropout.py).
        parts.model.key_dropout(sample_ids, step)
        with phase("forward"), eng.eager_forward(engine, eager=attention_mask is not None):
            loss_sum, correct, count = engine(
                m.input_ids, attention_mask, m.positions, m.labels, want_correct=want_correct
            )
            sums[:3] += torch.stack([loss_sum.detach().double(), correct.double(), count.double()])
            sums[3] += tokens
        with phase("backward"):
            engine.backward(loss_sum * scale)
        if i == len(masked) - 1:
            loss_total, predicted_total, stop, bad, outage, deepspeed_skips = decide_update(parts, sums, level)
            eng.norm_decided(deepspeed_skips > 0)
            nonfinite = not math.isfinite(loss_total)
            skip_next_step(parts.optimizer, nonfinite or bad > 0)  # every rank skips or stops together
            if logged and parts.zero_stage == 0:
                grad_norm = eng.local_grad_norm(engine)
            if before_step:
                before_step()
        with phase("optimizer"):
            engine.step()
    skip_next_step(parts.optimizer, False)
    loss = loss_total / predicted_total if predicted_total and not nonfinite else float("nan")
    return StepResult(sums, loss, nonfinite, stop > 0, grad_norm, bad > 0, outage > 0)


def decide_update(parts: StepParts, sums: torch.Tensor, level: int) -> list[float]:
    """Summed over ranks: [loss sum, predicted, stop asked, bad input, store down, DeepSpeed skips],
    the step's one read from the device. A loss sum is non-finite where any rank's is (losses are >= 0:
    no inf - inf). Whether the gradients overflowed or their norm is invalid is DeepSpeed's question
    before its update, asked here instead (``engine.grad_norm_ahead``; 0 where DeepSpeed asks itself)."""
    with phase("sync"):
        decided = torch.zeros(6, dtype=torch.float64, device=parts.device)
        decided[:2] = sums[[0, 2]]
        decided[2], decided[3] = float(parts.stop.requested), float(level >= bad_input.BAD_INPUT)
        decided[4] = float(level >= bad_input.OUTAGE)
        deepspeed_skips = eng.grad_norm_ahead(parts.engine)
        if deepspeed_skips is not None:
            decided[5] = deepspeed_skips
        dist.all_reduce(decided)
        return decided.tolist()


class ThroughputWindow:
    """Sums over the steps since the last log line: what the loss and speed metrics average."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.seconds = self.data_wait = 0.0
        self.steps = 0

    def add(self, result: StepResult, seconds: float, data_wait: float) -> None:
        self.seconds, self.data_wait, self.steps = self.seconds + seconds, self.data_wait + data_wait, self.steps + 1
        if not result.nonfinite:  # skipped steps are not averaged in
            self.sums += result.sums

    def metrics(self, logged: StepResult, global_batch: int, world: int, flops_per_seq: float, peak: float) -> dict:
        """The window's means; ``train/accuracy`` is the ``logged`` step's alone (the only step whose
        argmax is computed), like ``train/grad_norm``."""
        both = torch.cat([self.sums, logged.sums[1:3] if not logged.nonfinite else torch.zeros_like(self.sums[:2])])
        dist.all_reduce(both)
        loss_sum, _, count, tokens, correct, predicted = both.tolist()
        seqs_per_s = global_batch * self.steps / self.seconds
        out = {
            names.TRAIN_LOSS: loss_sum / count if count else float("nan"),
            names.TRAIN_ACCURACY: correct / predicted if predicted else float("nan"),
            names.PERF_TOKENS_PER_S: tokens / self.seconds,
            names.PERF_SAMPLES_PER_S: seqs_per_s,
            names.PERF_MFU: flops_per_seq * seqs_per_s / world / (peak * 1e12),
            names.PERF_STEP_TIME_S: self.seconds / self.steps,
            names.PERF_DATA_WAIT_S: self.data_wait / self.steps,
        }
        self.__init__(self.sums.device)
        return out
