"""A hang watchdog on every rank (``train.hang_timeout_s``).

At scale the common silent failure is one rank stuck in I/O or a collective while the others wait
in theirs, idling the whole job until Slurm's time limit. A thread on each rank watches for the
next finished step. When none comes in time, every rank (the stuck one and those waiting for it,
all with the same deadline, since steps end together) writes its Python stacks to
``<out_dir>/hang-rank<N>.txt``, rank 0 tags the event on the tracking run, and each exits 3, the
requeue code: Slurm restarts the job, which resumes from the last complete checkpoint.

The deadline after a step is ``hang_timeout_s`` (0: ``max(300 s, 20 x the median step time)``).
The first steps (compilation, loader start-up), evaluation, probes and checkpoints get their own
larger allowance instead, since they legitimately take longer than a step.

A rank waiting in a collective may see its peer's exit before its own watchdog ends it: gloo (and
NCCL's error handling) then raises in the main thread, which would exit 1, a crash that ends a
multi-node job instead of requeueing it (seen in the Slurm test, one start in a few). The loop hands
such an error to ``exit_if_hung``: past the step's deadline it is the same hang, and the rank exits 3
as its peers do.

The tests make a rank hang with ``PRETRAIN_TEST_HANG`` (``pretrain/runtime/faults.py``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from pretrain.runtime import exit_codes
from pretrain.runtime.engine import release_shared_memory

log = logging.getLogger("pretrain")
EXIT_REQUEUE = exit_codes.REQUEUE
FLOOR_S, FACTOR = 300.0, 20.0
WARMUP_STEPS = 3  # steps timed with the start-up allowance, not the step timeout
GRACE_S = 5.0  # after writing its stacks, a rank waits so that its peers write theirs


class HangWatchdog:
    def __init__(self, timeout_s: float, out_dir: str, rank: int, tracker, allowance_s: float = 1800.0):
        self.fixed = timeout_s if timeout_s > 0 else None
        self.enabled = timeout_s >= 0
        self.out_dir, self.rank, self.tracker = Path(out_dir), rank, tracker
        self.allowance_s = allowance_s
        self.step_times: deque[float] = deque(maxlen=100)
        self.steps_seen = 0
        self.step = 0
        self._deadline = time.monotonic() + allowance_s
        self._stop = threading.Event()
        self._firing = threading.Lock()  # the watchdog's thread and the main thread may both end the rank
        if self.enabled:
            threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def timeout(self) -> float:
        if self.fixed is not None:
            return self.fixed
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(FLOOR_S, FACTOR * median)

    def step_started(self) -> None:
        """A step begins: it has ``timeout()`` seconds (the first ones, the start-up allowance)."""
        limit = self.timeout() if self.steps_seen >= WARMUP_STEPS else max(self.timeout(), self.allowance_s)
        self._deadline = time.monotonic() + limit

    def step_done(self, step: int, seconds: float) -> None:
        """A step finished: what follows until the next one (logging, evaluation, checkpoints, a
        recovery) is not a step, and gets the larger allowance."""
        self.step, self.steps_seen = step, self.steps_seen + 1
        if self.steps_seen > 1:  # the first step holds start-up work
            self.step_times.append(seconds)
        self.allow()

    def allow(self) -> None:
        """Until the next step starts: logging, evaluation, probes and checkpoints get the larger allowance."""
        self._deadline = time.monotonic() + max(self.timeout(), self.allowance_s)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout() / 10)):
            if time.monotonic() > self._deadline:
                self._fire()

    def exit_if_hung(self, error: BaseException) -> None:
        """The loop failed with ``error``: when the step was past its deadline, the failure is a peer's
        exit after the same hang (its collective closed under this rank), so this rank ends as the
        watchdog does, with exit 3, whichever thread gets there first. Otherwise it returns, and the
        error goes on as a crash."""
        if self.enabled and time.monotonic() > self._deadline:
            self._fire(error)

    def _fire(self, error: BaseException | None = None) -> None:
        if not self._firing.acquire(blocking=False):
            while True:  # the other thread is writing the stacks; it ends the process with exit 3
                time.sleep(60)
        waited = self.timeout()
        path = self.out_dir / f"hang-rank{self.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(
                f"rank {self.rank}: no step finished within {waited:.0f}s after step {self.step}; "
                f"Python stacks of every thread:\n"
            )
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
            if error is not None:  # where the main thread was waiting, in its traceback
                f.write("\nThe step then failed:\n" + "".join(traceback.format_exception(error)))
        message = (
            f"hang: no step finished within {waited:.0f}s after step {self.step}; stacks in "
            f"{self.out_dir}/hang-rank*.txt; exiting {EXIT_REQUEUE} to be requeued from the last checkpoint"
        )
        print(f"[rank {self.rank}] {message}", file=sys.stderr, flush=True)
        if self.rank == 0:
            self._tell_tracker(message)
        time.sleep(GRACE_S)
        # os._exit skips the trainer's own way out: its shared-memory all-reduce buffer (64 MiB a rank)
        # would stay in /dev/shm, which is RAM, until a later start on this machine removed it.
        release_shared_memory()
        os._exit(EXIT_REQUEUE)

    def _tell_tracker(self, message: str) -> None:
        """Bounded: a tracker stuck like the rank itself must not keep the job from requeueing."""

        def send():
            self.tracker.log_event("hang", message, self.step)
            self.tracker.finish("KILLED")

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(timeout=30)
