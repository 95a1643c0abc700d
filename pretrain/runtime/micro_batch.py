"""``impl.micro_batch_size: auto``: the micro-batch chosen by measured throughput.

Among the micro-batches that divide the global batch at this world size (powers of two, up to
``LARGEST`` on this kind of device), the one whose forward and backward pass runs the most tokens a
second, timed on the first rank with the model the run builds, in the run's precision, at its
sequence length and masking rate. Smallest first; the walk stops at the first that does not fit in
memory or runs 5% slower than the best so far (throughput rises with the micro-batch until the
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


def choose(
    model,
    sizes: list[int],
    seq_len: int,
    masking_rate: float,
    dtype: torch.dtype,
    device: torch.device,
    shape: str,
    cache_path: Optional[Path] = None,
) -> tuple[int, str]:
    """(the micro-batch, why, with the timings): from the cache, or timed now and cached."""
    path = cache_path or default_cache_path().with_name("micro_batch.json")
    key = f"{device_key(device)}|{shape}|{dtype}|seq={seq_len}|masking={masking_rate}|sizes={','.join(map(str, sizes))}"
    announce = (
        f"impl.micro_batch_size=auto: timing micro-batches of {', '.join(map(str, sizes))} sequences (once per "
        f"device and shape, then cached in {path})"
    )

    def timed() -> dict:
        rates = measure(model, sizes, seq_len, masking_rate, dtype, device)
        return {"tokens_per_s": {str(size): rate for size, rate in rates.items()}}

    record, source = timed_once(path, key, "the micro-batch timing", announce, timed)
    rates = {int(size): rate for size, rate in record["tokens_per_s"].items()}
    fits = {size: rate for size, rate in rates.items() if rate}
    if not fits:
        return sizes[0], f"auto: {sizes[0]}, the smallest: none of {sizes} ran ({source})"
    best = max(fits, key=lambda size: (fits[size], size))
    said = ", ".join(f"{size}: {rate:,.0f}" if rate else f"{size}: out of memory" for size, rate in rates.items())
    return best, f"auto: {best}, the most tokens a second of those timed ({said}; {source})"


def measure(
    model, sizes: list[int], seq_len: int, masking_rate: float, dtype: torch.dtype, device: torch.device
) -> dict:
    """Tokens a second of forward and backward at each size, smallest first, until one does not fit
    (None) or runs below ``SLOWER_STOP`` of the best; a copy of ``model`` in ``dtype`` on ``device``,
    the run's random state untouched."""
    probe = copy.deepcopy(model).to(device=device, dtype=dtype)
    probe.train()
    rates: dict[int, float | None] = {}
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
    del probe
    return rates


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
        loss_sum.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            took = time.perf_counter() - start
        else:
            took = (time.process_time() - start) / torch.get_num_threads()
        if attempt:  # the first warms the allocator and the kernels' choice
            best = min(best, took)
    return best
