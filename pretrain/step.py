"""One optimiser step and what ``fit`` keeps between steps: ``train_step`` (mask on the device,
forward, backward, step), the throughput window that the loss and speed metrics average, and the stop
signal that SIGUSR1/SIGTERM raise."""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass
from enum import IntEnum
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
    # impl.deferred_reads, where the optimiser can mask its update: a step that logs nothing reads its
    # decision one step later, its update masked on the device ("Deferred reads" below)
    deferred_reads: bool = False
    cuda_graphs: bool = False  # the compiled forward and backward replay as CUDA graphs


class Decided(IntEnum):
    """Where each of ``decide_update``'s numbers is, in ``StepResult.numbers`` and on the device."""

    LOSS_SUM = 0  # summed over ranks: non-finite where any rank's is
    PREDICTED = 1  # masked tokens predicted
    STOP = 2  # ranks asked to stop
    BAD_INPUT = 3  # ranks that could not read their batch
    OUTAGE = 4  # ... because the data's store stayed down
    DEEPSPEED_SKIPS = 5  # ranks whose DeepSpeed step will skip its update (engine.will_skip_update)


@dataclass
class StepResult:
    """What one optimiser step decided. ``numbers`` (summed over ranks, laid out as ``Decided``) is None
    until ``read_deferred`` reads it: a step that logs nothing is read by the next step's ``train_step``
    ("Deferred reads" below)."""

    step: int  # the steps done after it
    sums: torch.Tensor  # float64 [loss_sum, correct, predicted, tokens] on the device, this rank's, zero
    # where the step was skipped; correct only on a logged step (0 otherwise)
    micro_batches: list[dict]  # its batches: which one could not be read, when one could not
    grad_norm: float | None = None  # ZeRO 0 only, when asked (DeepSpeed keeps none there)
    numbers: list[float] | None = None
    applied: bool = True  # DeepSpeed counted the update as made (it did not skip it on its own)
    samples_after: int = 0  # the stream's position after the step (``fit``): a spike's samples end there
    _host: torch.Tensor | None = None  # the decision, copied to host memory behind the step's work
    _ready: object = None  # a CUDA event recorded after that copy

    def read_deferred(self) -> "StepResult":
        """The step's decision on the host. Deferred, it was copied behind the step's work and is read a
        step later, when the device is long past it: the queued work of the step after is not drained."""
        if self.numbers is None:
            if self._ready is not None:
                self._ready.synchronize()
            self.numbers = self._host.tolist()
        return self

    @property
    def loss(self) -> float:
        """The step's MLM loss over all ranks (nan when non-finite)."""
        loss_sum, predicted = self.numbers[Decided.LOSS_SUM], self.numbers[Decided.PREDICTED]
        return loss_sum / predicted if predicted and not self.nonfinite else float("nan")

    @property
    def nonfinite(self) -> bool:  # some rank's loss was not finite: the update was skipped everywhere
        return not math.isfinite(self.numbers[Decided.LOSS_SUM])

    @property
    def stop(self) -> bool:  # some rank was asked to stop
        return self.numbers[Decided.STOP] > 0

    @property
    def bad_input(self) -> bool:  # some rank could not read its batch (guards.bad_input): stop, exit 2
        return self.numbers[Decided.BAD_INPUT] > 0

    @property
    def outage(self) -> bool:  # ... because the data's store stayed down: stop, exit 3 (requeue)
        return self.numbers[Decided.OUTAGE] > 0

    @property
    def skipped(self) -> bool:
        """No update was made: a non-finite loss, an unreadable batch, or DeepSpeed's own check."""
        return self.nonfinite or self.bad_input or self.numbers[Decided.DEEPSPEED_SKIPS] > 0


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
    # In document scope padding is a group of its own that no document sees (MLMModel.encode): no mask,
    # so a micro-batch with a padded row runs the compiled graph too, not eagerly (eng.eager_forward).
    in_documents = parts.model.attention_scope == "document"
    for part, batch, inputs in zip(split_rows(m, rows, parts.masking.fixed_count), micro_batches, on_device):
        # Rows packed full have no padding: no mask lets SDPA take its fast path.
        not_pad = (inputs["input_ids"] != special.pad) if batch.get("has_padding", True) else None
        attention_mask = None if in_documents else not_pad
        tokens = part.input_ids.numel() if not_pad is None else not_pad.sum()
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
    deferred: Optional[StepResult] = None,
    defer: bool = False,
) -> StepResult:
    """Forward and backward over the micro-batches of step ``step + 1``, then one optimiser step
    (``step``: the steps done, which key the masks and the dropout). ``logged``: the step's metrics
    are logged, so its accuracy and (ZeRO 0) gradient norm are computed. ``before_step`` runs where
    the gradients are whole and the weights not yet updated (per-layer health).

    Whether to skip the update (a non-finite loss, an unreadable batch, DeepSpeed's own checks of the
    gradients: ``engine.will_skip_update``), a stop request and the loss the spike guard watches are
    decided once a step, after the last backward (``decide_update``), and read by the host before the
    update, which DeepSpeed's step then takes or skips. With ``defer`` (a step that logs, evaluates
    and checkpoints nothing) and ``parts.deferred_reads`` the update is masked on the device instead
    and the decision read by the next step's call (its ``deferred``, read before its own update:
    "Deferred reads" below). The rest stays on the device until a logged step."""
    engine, world, defer = parts.engine, parts.world, defer and parts.deferred_reads
    with phase("mask"):
        masked, predicted = mask_micro_batches(parts, step, micro_batches)
    # The loss is normalised by the masked-token count of the whole step, all ranks together:
    # DeepSpeed then divides by grad_accum and averages over ranks, which this undoes.
    predicted = predicted.double().reshape(1)
    dist.all_reduce(predicted)
    scale = world * len(masked) / predicted.clamp(min=1.0)
    level = bad_input.failure_level(micro_batches)
    sums = torch.zeros(4, dtype=torch.float64, device=parts.device)
    result = StepResult(step + 1, sums, micro_batches)
    # Compiled, the argmax is taken every step: a bool that turns on at logged steps would trace a
    # second graph (a recompile at the first logged step) for the price of one reduction per chunk.
    want_correct = logged or bool(getattr(engine, "is_compiled", False))
    for i, (m, attention_mask, tokens, sample_ids) in enumerate(masked):
        # Dropout keyed like the masks, by each row's sample id and the step (model/keyed_dropout.py).
        parts.model.key_dropout(sample_ids, step)
        eng.new_graph_step(parts.cuda_graphs)
        with phase("forward"), eng.eager_forward(engine, eager=attention_mask is not None):
            loss_sum, correct, count = engine(
                m.input_ids, attention_mask, m.positions, m.labels, want_correct=want_correct
            )
            sums[:3] += torch.stack([loss_sum.detach().double(), correct.double(), count.double()])
            sums[3] += tokens
        with phase("backward"), parts.model.recompute_context():
            engine.backward(loss_sum * scale)
        if i == len(masked) - 1:
            decided, result.numbers = decide_update(parts, sums, level, defer)
            decide_or_defer(parts, result, decided, deferred, logged)
            if before_step:
                before_step()
        with phase("optimizer"):
            engine.step()
    skip_next_step(parts.optimizer, False)
    mask_update(parts.optimizer, None)
    result.applied = engine.was_step_applied()
    if not defer and result.skipped and result.applied:
        eng.hold_schedule(engine)  # ours skipped an update DeepSpeed counted as made
    return result


def decide_or_defer(
    parts: StepParts, result: StepResult, decided: torch.Tensor, deferred: Optional[StepResult], logged: bool
) -> None:
    """Before the update: the step before read and applied if it was deferred, then this one's update
    vetoed on the host (read now) or masked on the device (``decided``: ``decide_update``'s numbers)."""
    # skipped steps are not averaged into the window: their sums count as zeros
    finite = torch.isfinite(decided[Decided.LOSS_SUM])
    result.sums = torch.where(finite, result.sums, torch.zeros_like(result.sums))
    if deferred is not None:
        apply_deferred(parts, deferred)  # before this update: a skipped step holds the schedule
    if result.numbers is not None:
        eng.give_decision(parts.engine, result.numbers[Decided.DEEPSPEED_SKIPS] > 0)
        skip_next_step(parts.optimizer, result.nonfinite or result.bad_input)  # every rank skips or stops together
        if logged and parts.zero_stage == 0:
            result.grad_norm = eng.local_grad_norm(parts.engine)
    else:
        eng.give_decision(parts.engine, False)  # DeepSpeed's step goes ahead; the mask decides
        mask_update(parts.optimizer, decided)
        result._host, result._ready = copy_deferred(decided)


def decide_update(
    parts: StepParts, sums: torch.Tensor, level: int, defer: bool
) -> tuple[torch.Tensor, list[float] | None]:
    """Summed over ranks, on the device: [loss sum, predicted, stop asked, bad input, store down,
    DeepSpeed skips], and read by the host unless ``defer`` (the step's one wait). A loss sum is non-finite where any rank's is (losses are >= 0: no inf - inf).
    Whether the gradients overflowed or their norm is invalid is DeepSpeed's question before its
    update, asked here instead (``engine.will_skip_update``; 0 where DeepSpeed asks itself)."""
    with phase("sync"):
        # On CUDA a list index or a Python number written into an element is a copy from pageable host
        # memory, which waits for the queued kernels (pytorch#186482): a strided slice and fills instead.
        decided = torch.zeros(len(Decided), dtype=torch.float64, device=parts.device)
        decided[Decided.LOSS_SUM : Decided.PREDICTED + 1] = sums[0:3:2]  # the loss sum and the predicted count
        flags = (parts.stop.requested, level >= bad_input.BAD_INPUT, level >= bad_input.OUTAGE)
        for i, flag in enumerate(flags, start=Decided.STOP):
            if flag:
                decided[i : i + 1].fill_(1.0)
        deepspeed_skips = eng.will_skip_update(parts.engine)
        if deepspeed_skips is not None:
            decided[Decided.DEEPSPEED_SKIPS] = deepspeed_skips
        dist.all_reduce(decided)
        return decided, None if defer else decided.tolist()


# Deferred reads. On a GPU the host queues a step's kernels while the device runs the step before; a
# read of a device value waits for everything queued, and the device then idles while the host queues
# the next step. A step that logs nothing therefore reads nothing: its update is masked on the device
# (torch's fused AdamW takes ``found_inf``: parameters, moments and step count untouched where it is
# 1, as under a gradient scaler), the decision is copied to host memory behind the step's work, and
# the next step reads it after its own backward, before its own update, when the device is long past
# it. What the host does with it is then one step late, and nothing else changes: a skipped step
# still holds the learning-rate schedule (undone before the next update, which so runs at the same
# rate), its loss is kept out of the window (on the device), the spike guard sees every loss with its
# own step and samples, a stop is honoured a step later. Steps that log, evaluate, checkpoint or end
# the run read at once (``fit``), and read the deferred step before them first.


def deferrable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can mask its update on the device: torch's fused Adam/AdamW."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def mask_update(optimizer: torch.optim.Optimizer, decided: torch.Tensor | None) -> None:
    """The coming update made only where ``decided`` (``decide_update``'s numbers, on the device) says
    the step stands; None: unmasked."""
    if decided is None:
        optimizer.__dict__.pop("found_inf", None)
        return
    skip = ~torch.isfinite(decided[Decided.LOSS_SUM]) | (decided[Decided.BAD_INPUT] > 0)
    skip |= decided[Decided.DEEPSPEED_SKIPS] > 0
    optimizer.found_inf = skip.float()


def copy_deferred(decided: torch.Tensor) -> tuple[torch.Tensor, object]:
    """``decided`` copied to host memory after the work queued so far, and an event that says when."""
    if decided.device.type != "cuda":
        return decided, None
    host = torch.empty(decided.shape, dtype=decided.dtype, pin_memory=True)
    host.copy_(decided, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def apply_deferred(parts: StepParts, result: StepResult) -> None:
    """The previous step's decision on the host; a skipped update DeepSpeed counted as made holds the
    schedule now, before the next update."""
    result.read_deferred()
    if result.skipped and result.applied:
        eng.hold_schedule(parts.engine)


class LogWindow:
    """Sums over the steps since the last log line: what the loss, accuracy and speed metrics average.
    Resumable: a checkpoint holds it (``TrainState.log_window``), so the first line after a resume
    averages the same steps as the uninterrupted run (pretrain/tracking/resume_log.py)."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.seconds = self.data_wait = 0.0
        self.steps = 0

    def add(self, result: StepResult, seconds: float, data_wait: float) -> None:
        self.seconds, self.data_wait, self.steps = self.seconds + seconds, self.data_wait + data_wait, self.steps + 1
        self.sums += result.sums  # zeros for a skipped step: not averaged in

    def state_dict(self) -> dict:
        """The window so far, all ranks' sums together (a collective: every rank calls it)."""
        sums = self.sums.clone()
        dist.all_reduce(sums)
        return {"sums": sums.tolist(), "steps": self.steps, "seconds": self.seconds, "data_wait": self.data_wait}

    def load_state_dict(self, saved: dict, rank: int) -> None:
        """Continue the window ``saved``; the first rank holds the sums (a log all-reduces them), so
        any world size takes it up."""
        if not saved:
            return
        if rank == 0:
            self.sums += torch.tensor(saved["sums"], dtype=self.sums.dtype, device=self.sums.device)
        self.steps, self.seconds, self.data_wait = saved["steps"], saved["seconds"], saved["data_wait"]

    def metrics(self, logged: StepResult, global_batch: int, world: int, flops_per_seq: float, peak: float) -> dict:
        """The window's means; ``train/accuracy`` is the ``logged`` step's alone (the only step whose
        argmax is computed), like ``train/grad_norm``."""
        both = torch.cat([self.sums, logged.sums[1:3]])
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
