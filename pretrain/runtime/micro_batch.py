"""``impl.micro_batch_size: auto``: the micro-batch chosen by measured throughput.

Among the micro-batches that divide the global batch at this world size (powers of two, up to
``LARGEST`` on this kind of device), the one whose forward and backward pass runs the most tokens a
second, timed on the first rank with the model the run builds, in the run's precision, at its
sequence length and masking rate. Smallest first; the walk stops at the first that does not fit in
memory beside what the engine will hold (on a GPU its optimiser's states, ``STATE_BYTES``, and a margin
are taken while timing) or runs 5% slower than the best so far (throughput rises with the micro-batch until the
device is busy, then flattens or falls). Cached by device, threads, model shape, precision,
sequence length, masking and the candidates, as ``impl.precision`` and ``impl.attention`` are, and
said in one line with the timings. Results do not depend on it: a step is the same sum over its
samples however it is cut (``pretrain.data.stream``), and a run resumes at any micro-batch.

No encoder trainer we know of picks its micro-batch this way: DeepSpeed's autotuner times its own
forward, backward and step only, Hugging Face's ``auto_find_batch_size`` and Composer's ``auto``
react to out-of-memory errors only.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from pretrain.runtime.hardware import default_cache_path, device_key, timed_once
from pretrain.runtime.step_speed import probe_inputs

log = logging.getLogger("pretrain")

# What DeepSpeed's engine holds beyond the model's weights and gradients in the run's dtype (which the
# timing's copy holds too), in bytes a parameter: (whole on every rank, split over the ranks), by the
# weights' precision and ZeRO stage. Measured with DeepSpeed 0.19.8 at one and two ranks after a step's
# backward, every tensor storage counted (tests/engine_memory_worker.py, checked against this table in
# tests/pretrain/test_micro_batch_auto.py): Adam's two moments and fp32 master weights, split at ZeRO
# 1-3; in bf16 at ZeRO 0-1 the whole fp32 gradient sums (BF16_Optimizer), less the bf16 gradients freed.
STATE_BYTES = {
    ("fp32", 0): (8, 0),
    ("fp32", 1): (4, 12),
    ("fp32", 2): (0, 12),
    ("fp32", 3): (4, 12),
    ("bf16", 0): (12, 0),
    ("bf16", 1): (2, 12),
    ("bf16", 2): (0, 16),
    ("bf16", 3): (4, 14),
}
# Held back besides, a share of the device: what the run adds that the timing does not (NCCL's buffers,
# the compiler's and cuBLAS's workspaces, the allocator's fragments over a long run).
MARGIN_SHARE = 0.05
LARGEST = {"cpu": 32, "cuda": 512}  # sequences a micro-batch, at most, timed on each kind of device
SLOWER_STOP = 0.95  # a candidate below this share of the best tokens/s ends the walk
REPEATS = 2  # timed passes a candidate, after one to warm up; the fastest counts


def candidates(global_batch: int, world: int, device_type: str) -> list[int]:
    """The powers of two that divide the global batch's share of a rank, smallest first."""
    if global_batch <= 0 or world <= 0 or global_batch % world:
        return []
    share, largest = global_batch // world, LARGEST.get(device_type, LARGEST["cuda"])
    sizes, size = [], 1
    while size <= min(share, largest):
        if share % size == 0:
            sizes.append(size)
        size *= 2
    return sizes


def engine_state_bytes(parameters: int, precision: str, zero_stage: int, world: int, offload: bool = False) -> int:
    """Bytes a rank's device holds for DeepSpeed's engine beyond the weights and gradients in the run's
    dtype (``STATE_BYTES``; fp8 keeps bf16 weights); with the optimiser offloaded, none."""
    if offload:
        return 0
    whole, split = STATE_BYTES[("fp32" if precision == "fp32" else "bf16", zero_stage)]
    return parameters * whole + parameters * split // max(1, world)


def choose(
    model,
    sizes: list[int],
    seq_len: int,
    masking_rate: float,
    dtype: torch.dtype,
    device: torch.device,
    shape: str,
    cache_path: Optional[Path] = None,
    held_bytes: int = 0,
) -> tuple[int, str]:
    """(the micro-batch, why, with the timings): from the cache, or timed now and cached. ``held_bytes``:
    on a GPU, the device memory the engine's states will take (``engine_state_bytes``), held while timing."""
    path = cache_path or default_cache_path().with_name("micro_batch.json")
    held = held_bytes if device.type == "cuda" else 0  # a CPU's memory is the host's: LARGEST bounds it
    key = f"{device_key(device)}|{shape}|{dtype}|seq={seq_len}|masking={masking_rate}|sizes={','.join(map(str, sizes))}"
    key += f"|held={held / 2**30:.1f}GiB" if held else ""
    announce = (
        f"impl.micro_batch_size=auto: timing micro-batches of {', '.join(map(str, sizes))} sequences (once per "
        f"device and shape, then cached in {path})"
    )

    def timed() -> dict:
        rates = measure(model, sizes, seq_len, masking_rate, dtype, device, held)
        return {"tokens_per_s": {str(size): rate for size, rate in rates.items()}}

    record, source = timed_once(path, key, "the micro-batch timing", announce, timed)
    rates = {int(size): rate for size, rate in record["tokens_per_s"].items()}
    fits = {size: rate for size, rate in rates.items() if rate}
    if not fits:
        return sizes[0], f"auto: {sizes[0]}, the smallest: none of {sizes} ran ({source})"
    best = max(fits, key=lambda size: (fits[size], size))
    said = ", ".join(f"{size}: {rate:,.0f}" if rate else f"{size}: out of memory" for size, rate in rates.items())
    if held:
        said += f"; {held / 2**30:.1f} GiB held for the optimiser's states and {MARGIN_SHARE:.0%} of the device besides"
    return best, f"auto: {best}, the most tokens a second of those timed ({said}; {source})"


def measure(
    model,
    sizes: list[int],
    seq_len: int,
    masking_rate: float,
    dtype: torch.dtype,
    device: torch.device,
    held_bytes: int = 0,
) -> dict:
    """Tokens a second of forward and backward at each size, smallest first, until one does not fit
    (None) or runs below ``SLOWER_STOP`` of the best; a copy of ``model`` in ``dtype`` on ``device``,
    the run's random state untouched. On a GPU ``held_bytes`` and ``MARGIN_SHARE`` of the device are
    taken first, so that a micro-batch fits here only where it fits beside the engine's states."""
    probe = copy.deepcopy(model).to(device=device, dtype=dtype)
    probe.train()
    rates: dict[int, float | None] = {}
    try:
        ballast = _hold(device, held_bytes)
    except torch.OutOfMemoryError:  # the states alone do not fit: the smallest, to fail as the run would
        return {size: None for size in sizes[:1]}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for size in sizes:
            try:
                rates[size] = size * seq_len / _fastest_pass(probe, size, seq_len, masking_rate, device)
            except torch.OutOfMemoryError:
                rates[size] = None
                break
            finally:
                for p in probe.parameters():
                    p.grad = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if rates[size] < SLOWER_STOP * max(r for r in rates.values() if r):
                break
    del probe, ballast
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the held memory back to the device, for the engine
    return rates


def _hold(device: torch.device, held_bytes: int) -> Optional[torch.Tensor]:
    """Device memory taken while timing: the engine's states and the margin (none on a CPU)."""
    if device.type != "cuda":
        return None
    margin = int(MARGIN_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return torch.empty(held_bytes + margin, dtype=torch.uint8, device=device)


def _fastest_pass(model, size: int, seq_len: int, masking_rate: float, device: torch.device) -> float:
    """Seconds of the fastest of ``REPEATS`` forward and backward passes (CPU: CPU time per thread, so
    that a busy machine slows each candidate alike, as the precision timing does)."""
    ids, positions, labels = (
        t.to(device) for t in probe_inputs(model.config.vocab_size, size, seq_len, round(masking_rate * size * seq_len))
    )
    best = float("inf")
    for attempt in range(REPEATS + 1):
        for p in model.parameters():
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter() if device.type == "cuda" else time.process_time()
        loss_sum, _, _ = model(ids, None, positions, labels)
        with model.recompute_context():  # as the trainer's backward runs
            loss_sum.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            took = time.perf_counter() - start
        else:
            took = (time.process_time() - start) / torch.get_num_threads()
        if attempt:  # the first warms the allocator and the kernels' choice
            best = min(best, took)
    return best
