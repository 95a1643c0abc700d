"""A line on rank 0 whenever the run has said nothing for ``train.progress_every_s`` (60 s by default).

A run logs every ``train.log_every`` steps, and the first step of a launch compiles the model: at
BERT-base's shape on an H100 ~45 s, minutes with ``impl.autotune_kernels`` (inductor times each
kernel's candidates), with nothing printed meanwhile. Slow steps (a large model on a CPU) leave
minutes between log lines too, and so may an evaluation or a checkpoint. Where none of our lines
came for that long, this one says where the run is: the step of the total, the time a step takes and
what is left, or, for the first step, how long it has been at it and how long the first step at this
shape on this device took the last time (kept beside the other timings in the cache,
``pretrain.runtime.hardware``), so that a compile says its time left too.

Any line of ours counts as said (the log handler this installs on the ``pretrain`` logger sees them),
so a run whose log lines come often prints nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

from pretrain.runtime import hardware
from pretrain.tracking.console import duration

log = logging.getLogger("pretrain")
RATE_OVER = 20  # the time a step takes: the mean of the last this many (the first step of a launch apart)


class Heartbeat(logging.Handler):
    """``step_started`` / ``step_done`` from the loop; ``stop`` at its end. ``first_step``: what the first
    step of a launch does besides training (compiling, starting the data loader); ``cache_key``: the
    shape, device and settings its time is kept under."""

    def __init__(
        self,
        every_s: float,
        start_step: int,
        max_steps: int,
        log_every: int,
        first_step: str,
        cache_key: str,
        cache_path: Optional[Path] = None,
    ):
        super().__init__(level=logging.INFO)
        self.every_s, self.max_steps, self.log_every = every_s, max_steps, log_every
        self.first_step, self.cache_key = first_step, cache_key
        self.cache_path = cache_path or hardware.default_cache_path().with_name("first_step.json")
        self.last_time = hardware.read_cache(self.cache_path).get(cache_key) if every_s > 0 else None
        self.step_seconds: deque[float] = deque(maxlen=RATE_OVER)
        self.steps_this_launch = 0
        self.step, self.running = start_step, False  # the last step begun; whether it is still running
        self.phase = (
            f"before step {start_step + 1} of {max_steps}: getting ready (the probe's baselines, the first batches)"
        )
        self.since = self.said_at = time.monotonic()
        self._stop = threading.Event()
        if every_s > 0:
            log.addHandler(self)
            threading.Thread(target=self._watch, name="heartbeat", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        self.said_at = time.monotonic()  # any line of ours, this one's too

    def step_started(self, step: int) -> None:
        self.step, self.running, self.since = step, True, time.monotonic()

    def step_done(self, step: int, seconds: float) -> None:
        self.running, self.since = False, time.monotonic()
        self.phase = f"after step {step} of {self.max_steps}: logging, evaluating or checkpointing"
        if self.steps_this_launch == 0 and self.every_s > 0:
            record = {"seconds": round(seconds, 1), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
            hardware.add_to_cache(self.cache_path, self.cache_key, record, "the first step's time")
        else:
            self.step_seconds.append(seconds)
        self.steps_this_launch += 1

    def doing(self, what: str) -> None:
        """Between steps, what the run does now (evaluating, checkpointing), timed from here."""
        self.phase, self.since = f"after step {self.step} of {self.max_steps}: {what}", time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        log.removeHandler(self)

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.every_s / 4)):
            if time.monotonic() - self.said_at >= self.every_s:
                log.info("progress: %s", self.line(time.monotonic()))

    def line(self, now: float) -> str:
        """Where the run is, at ``now`` (``time.monotonic()``)."""
        took = duration(now - self.since)
        if not self.running:
            return f"{self.phase}, {took} so far"
        head = f"step {self.step} of {self.max_steps}"
        if self.steps_this_launch == 0:
            return f"{head}, the first of this launch ({self.first_step}): {took} so far{self._first_step_left(now)}"
        if not self.step_seconds:  # only the first step has ended, and it compiled or warmed up
            return f"{head}: {took} into it; the time a step takes is known after this one"
        rate = sum(self.step_seconds) / len(self.step_seconds)
        next_line = min(self.max_steps, (self.step + self.log_every - 1) // self.log_every * self.log_every)
        into = min(now - self.since, rate)  # of this step's time, what is behind it

        def left(last: int) -> str:  # to the end of step ``last``
            return duration(max(0.0, (last - self.step + 1) * rate - into))

        return (
            f"{head}: {took} into it; {rate:.3g} s a step; the next log line at step {next_line}, in about "
            f"{left(next_line)}; the end in about {left(self.max_steps)}"
        )

    def _first_step_left(self, now: float) -> str:
        if not self.last_time:
            return " (none at this shape on this device before it, to tell the time left by)"
        before, elapsed = self.last_time["seconds"], now - self.since
        if elapsed > before:
            return f", longer than the {duration(before)} it took here on {self.last_time['when']}"
        return f"; it took {duration(before)} here on {self.last_time['when']}: about {duration(before - elapsed)} left"
