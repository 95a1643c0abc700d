"""Faults the tests inject into a real run, and nothing else: never set these for a real job.

Each is an environment variable, read once per process (at the first call), and each has one call
site: the loop calls ``at_step`` after reading a step's data, the checkpoint mirror calls
``mirror_upload`` after each file it uploads. With none set, both return at once.

- ``PRETRAIN_TEST_NOISE_STEPS=A:B``: the samples of data steps A..B-1 (global batches, as counted by
  the data position) become random tokens, keyed by that position, so the samples a spike recovery
  skips are the noisy ones and a resumed run draws the same noise (``tests/pretrain/test_spike_hang.py``).
- ``PRETRAIN_TEST_HANG=RANK:STEP``: that rank blocks before optimiser step STEP (1-based), as a rank
  stuck in I/O would (the hang watchdog's test).
- ``PRETRAIN_TEST_CRASH=RANK:STEP``: that rank exits 1 at once before optimiser step STEP, as a rank
  lost to a GPU error or the out-of-memory killer would (a multi-node job must end, not requeue).
- ``MLM_TEST_LEAK_MB_PER_STEP=MB``: every step keeps MB more memory, the leak ``tests/pretrain/test_memory.py``
  must catch.
- ``MLM_TEST_MIRROR_STALL=<tag>:<n>``: the mirror's upload of checkpoint ``tag`` blocks after ``n``
  files, so that a test can kill -9 the job with an upload half done.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch

NOISE_ENV, HANG_ENV, CRASH_ENV = "PRETRAIN_TEST_NOISE_STEPS", "PRETRAIN_TEST_HANG", "PRETRAIN_TEST_CRASH"
LEAK_ENV, STALL_ENV = "MLM_TEST_LEAK_MB_PER_STEP", "MLM_TEST_MIRROR_STALL"
_leaked: list = []


@dataclass(frozen=True)
class Faults:
    noise_steps: Optional[tuple[int, int]] = None
    hang: Optional[tuple[int, int]] = None  # (rank, step)
    leak_mb: float = 0.0
    mirror_stall: Optional[str] = None  # "<tag>:<n>"
    crash: Optional[tuple[int, int]] = None  # (rank, step)

    @classmethod
    def from_environ(cls) -> "Faults":
        def pair(name: str) -> Optional[tuple[int, int]]:
            value = os.environ.get(name)
            return tuple(int(x) for x in value.split(":")) if value else None  # type: ignore[return-value]

        return cls(
            pair(NOISE_ENV),
            pair(HANG_ENV),
            float(os.environ.get(LEAK_ENV) or 0),
            os.environ.get(STALL_ENV) or None,
            pair(CRASH_ENV),
        )


@functools.cache
def faults() -> Faults:
    return Faults.from_environ()


def at_step(micro_batches: list[dict], special, rank: int, step: int) -> None:
    """After a step's data is read, before it trains (``step`` is the optimiser step about to run)."""
    f = faults()
    if f.noise_steps:
        _noise(micro_batches, special, *f.noise_steps)
    if f.hang == (rank, step):
        hang_for_test(rank, step)
    if f.crash == (rank, step):
        print(f"[rank {rank}] {CRASH_ENV}: exiting 1 before step {step}", file=sys.stderr, flush=True)
        os._exit(1)  # no clean-up, no checkpoint: as a process the kernel or a GPU error ends
    if f.leak_mb:
        _leaked.append(torch.ones(int(f.leak_mb * 2**20) // 4))


def mirror_upload(tag: str, uploaded: int) -> None:
    """After the mirror uploaded ``uploaded`` files of checkpoint ``tag``."""
    if faults().mirror_stall == f"{tag}:{uploaded}":
        print(f"{STALL_ENV}: the upload of {tag} blocks after {uploaded} files", file=sys.stderr, flush=True)
        threading.Event().wait()


def hang_for_test(rank: int, step: int) -> None:
    print(f"[rank {rank}] {HANG_ENV}: blocking before step {step}", file=sys.stderr, flush=True)
    threading.Event().wait()


def _noise(micro_batches: list[dict], special, first: int, end: int) -> None:
    low = max(special.all_special) + 1
    for batch in micro_batches:
        if first <= int(batch["global_step"]) < end:
            gen = torch.Generator().manual_seed(int(batch["sample_ids"][0]) + 1)
            ids = batch["input_ids"]
            noise = torch.randint(low, special.vocab_size, ids.shape, generator=gen, dtype=ids.dtype)
            keep = torch.isin(ids, torch.tensor(special.all_special, dtype=ids.dtype))
            batch["input_ids"] = torch.where(keep, ids, noise)
