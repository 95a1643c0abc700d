"""Progress for long runs: a tqdm bar on a terminal, a log line every few seconds in batch jobs, where a
bar would fill the log with carriage returns. Given the bytes of input a task reads (``total_bytes``),
both say how much of it was read, the rate and the time left; documents, tokens and shards as far as
the caller counts them."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("data_prep")
MIB = 1 << 20


def time_left(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    def __init__(self, label: str, log_every: float = 30.0, stream=None, total_bytes: int = 0):
        self.label = label
        self.log_every = log_every
        self.total_bytes = total_bytes
        self.docs = self.tokens = self.shards = self.bytes_read = 0
        self.start = self._last = time.perf_counter()
        stream = stream or sys.stderr
        self._bar = None
        if getattr(stream, "isatty", lambda: False)():
            if total_bytes:
                self._bar = tqdm(
                    desc=label, total=total_bytes, unit="B", unit_scale=True, file=stream, dynamic_ncols=True
                )
            else:
                self._bar = tqdm(desc=label, unit=" docs", unit_scale=True, file=stream, dynamic_ncols=True)

    def update(self, docs: int, tokens: int = 0, shards: int = 0, bytes_read: int | None = None) -> None:
        """``docs``, ``tokens``, ``shards`` more; ``bytes_read``: of the input so far, in all."""
        self.docs += docs
        self.tokens += tokens
        self.shards += shards
        moved = 0
        if bytes_read is not None:
            moved, self.bytes_read = bytes_read - self.bytes_read, bytes_read
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(self._counts(now), refresh=False)
            self._bar.update(moved if self.total_bytes else docs)
        elif now - self._last >= self.log_every:
            self._last = now
            log.info("%s", self.summary())

    def _counts(self, now: float) -> str:
        dt = max(now - self.start, 1e-9)
        out = f"{self.docs:,} documents ({self.docs / dt:,.0f}/s)"
        if self.tokens:
            out += f", {self.tokens:,} tokens ({self.tokens / dt:,.0f} tokens/s), {self.shards} shards"
        return out

    def summary(self) -> str:
        now = time.perf_counter()
        dt = max(now - self.start, 1e-9)
        line = f"{self.label}: {self._counts(now)}"
        if self.total_bytes:
            share = min(1.0, self.bytes_read / self.total_bytes)
            rate = self.bytes_read / dt
            left = (self.total_bytes - self.bytes_read) / rate if rate > 0 else float("inf")
            line += (
                f", {self.bytes_read / MIB:,.1f} of {self.total_bytes / MIB:,.1f} MiB read ({share:.0%}, "
                f"{rate / MIB:,.2f} MiB/s), {time_left(left) if left != float('inf') else '?'} left"
            )
        return f"{line}, {dt:,.1f} s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s", self.summary())


class Steps:
    """Progress through a known number of like pieces of work (a stage's key ranges, band units, the
    files the join reads): done of total, rate and time left, as ``Progress`` says it for input bytes."""

    def __init__(self, label: str, total: int, unit: str, log_every: float = 30.0, stream=None):
        self.label, self.total, self.unit, self.log_every = label, total, unit, log_every
        self.done = 0
        self.start = self._last = time.perf_counter()
        stream = stream or sys.stderr
        self._bar = None
        if getattr(stream, "isatty", lambda: False)():
            self._bar = tqdm(desc=label, total=total, unit=f" {unit}", file=stream, dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(n)
        elif now - self._last >= self.log_every:
            self._last = now
            log.info("%s", self.summary())

    def summary(self) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        rate = self.done / dt
        left = time_left((self.total - self.done) / rate) if rate > 0 else "?"
        share = self.done / self.total if self.total else 1.0
        return (
            f"{self.label}: {self.done:,} of {self.total:,} {self.unit} ({share:.0%}, {rate:,.2f}/s), "
            f"{left} left, {dt:,.1f} s"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s", self.summary())
