"""torch.profiler over a few training steps: where a step's time goes, on the host and on the device.

``impl.profile_at_step: N`` profiles steps N to N + ``impl.profile_steps`` - 1 (numbered as the log
numbers them) on every rank, and writes into ``train.out_dir/profile/``, per rank:

* ``step<N>-rank<r>.json.gz``: the Chrome trace (https://ui.perfetto.dev or chrome://tracing opens it);
* ``step<N>-rank<r>.txt``: the summary line, the step's phases, and the ops that took the time, by
  self host time and (on a GPU) by device time.

Rank 0 logs the summary: the wall time of a step, the host's time in each phase of ``train_step``
(``phase()`` names them; ``sync`` includes the one wait for the device) with the number of ops called
in it (on a GPU, about one kernel launch each; the backward's run on autograd's device thread there
and are counted in no phase), and on a GPU the device's busy time, the sum of its kernels. A step
whose device is busy for much less than its wall time waits for its host (Python, DeepSpeed's
bookkeeping, kernel launches): fewer, fused kernels help there, a faster GPU does not.

Pick steps after the first logging window (compilation, the allocator's warm-up, the attention kernel's
timing all come before) and away from an evaluation or a checkpoint, unless those are what you want to
see. The profiler costs some host time per op while it records: the profiled steps are a little slower
than the others, and their throughput window says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import ContextManager, Optional

import torch

from data_prep.common.atomic import write_atomic

log = logging.getLogger("pretrain")

# The phases of ``pretrain.step.train_step``, in the order a step runs them.
PHASES = ("mask", "forward", "backward", "sync", "optimizer")
_PREFIX = "train_step/"
_NOTHING = contextlib.nullcontext()
_active = False  # a profile is being taken in this process: phase() records


def phase(name: str) -> ContextManager:
    """A named range of the step in the profile; a shared null context when none is being taken."""
    return torch.profiler.record_function(_PREFIX + name) if _active else _NOTHING


class StepProfiler:
    """Takes the profile of ``impl.profile_at_step``'s steps; ``fit`` calls ``before_step`` at the top of
    each step (with the steps done so far) and ``stop`` when the loop ends, however it ends."""

    def __init__(self, first_step: int, steps: int, out_dir: str | Path, rank: int, device: torch.device):
        self.first, self.steps, self.rank, self.device = first_step, steps, rank, device
        self.dir = Path(out_dir) / "profile"
        self._prof: Optional[torch.profiler.profile] = None
        self._done_at_start = 0
        self._t0 = 0.0

    @classmethod
    def of(cls, cfg, rank: int, device: torch.device) -> "StepProfiler":
        return cls(cfg.impl.profile_at_step, cfg.impl.profile_steps, cfg.train.out_dir, rank, device)

    def before_step(self, steps_done: int) -> None:
        global _active
        if self._prof is None and self.first and steps_done + 1 == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # the shapes give bench/profile_kernels.py each matmul's and attention kernel's FLOPs
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()
            self._done_at_start, self._t0, _active = steps_done, time.perf_counter(), True
        elif self._prof is not None and not self._done_at_start < steps_done < self.first + self.steps - 1:
            self._finish(steps_done)  # the last profiled step is done (or a spike rollback went back before it)

    def stop(self, steps_done: int) -> None:
        """The loop ended: a profile cut short is written with the steps it holds."""
        if self._prof is not None:
            self._finish(steps_done)

    def _finish(self, steps_done: int) -> None:
        global _active
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the wall time then includes the device's backlog
        seconds = time.perf_counter() - self._t0
        prof, self._prof, _active = self._prof, None, False
        prof.stop()
        steps = steps_done - self._done_at_start
        if steps <= 0:
            return
        first = self._done_at_start + 1
        summary, tables = summarise(prof, steps, seconds, self.device.type == "cuda")
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"step{first:08d}-rank{self.rank}"
        trace = stem.with_suffix(".json.gz")
        write_atomic(stem.with_suffix(".txt"), f"steps {first}-{steps_done}: {summary}\n\n{tables}\n")
        tmp = self.dir / f".{trace.name}.tmp.gz"  # ends in .gz: torch gzips it
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        if self.rank == 0:
            log.info("profile: steps %d-%d on rank 0: %s; trace %s", first, steps_done, summary, trace)


def summarise(prof: torch.profiler.profile, steps: int, seconds: float, on_gpu: bool) -> tuple[str, str]:
    """(one line: a step's wall time, each phase's host time, the device's busy time; the op tables)."""
    events = prof.key_averages()
    by_key = {e.key: e for e in events}
    wall = 1000 * seconds / steps
    phases = {
        name: by_key[_PREFIX + name].cpu_time_total / 1000 / steps if _PREFIX + name in by_key else 0.0
        for name in PHASES
    }
    ops = Counter()  # ops called inside each phase's range, not inside another op: on a GPU, launches
    for event in prof.events():
        if event.name.startswith(_PREFIX):
            ops[event.name[len(_PREFIX) :]] += len(event.cpu_children)
    outside = max(wall - sum(phases.values()), 0.0)
    line = f"{wall:.1f} ms a step; the host's ms by phase: " + ", ".join(
        f"{n} {ms:.1f} ({ops[n] / steps:.0f} ops)" for n, ms in phases.items()
    )
    line += f", outside them (data, logging, the loop) {outside:.1f}"
    tables = events.table(sort_by="self_cpu_time_total", row_limit=25)
    if on_gpu:
        kernels = [e for e in events if not e.key.startswith(_PREFIX) and not e.key.startswith("ProfilerStep")]
        busy = sum(e.self_device_time_total for e in kernels) / 1000 / steps
        line += f"; the device busy {busy:.1f} ms ({100 * busy / wall:.0f}% of the step)"
        tables += "\n" + events.table(sort_by="self_device_time_total", row_limit=25)
    return line, tables
