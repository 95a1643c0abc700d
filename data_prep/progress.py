"""Progress for long runs: a tqdm bar (documents/s, tokens/s) on a terminal, a log line every few seconds
in batch jobs, where a bar would fill the log with carriage returns."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("data_prep")


class Progress:
    def __init__(self, label: str, log_every: float = 30.0, stream=None):
        self.label = label
        self.log_every = log_every
        self.docs = self.tokens = self.shards = 0
        self.start = self._last = time.perf_counter()
        stream = stream or sys.stderr
        self._bar = None
        if getattr(stream, "isatty", lambda: False)():
            self._bar = tqdm(desc=label, unit=" docs", unit_scale=True, file=stream, dynamic_ncols=True)

    def update(self, docs: int, tokens: int, shards: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.shards += shards
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"{self.tokens / max(now - self.start, 1e-9):,.0f} tokens/s, {self.shards} shards", refresh=False
            )
            self._bar.update(docs)
        elif now - self._last >= self.log_every:
            self._last = now
            log.info("%s", self.summary())

    def summary(self) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"{self.label}: {self.docs:,} docs ({self.docs / dt:,.0f} docs/s), {self.tokens:,} tokens "
            f"({self.tokens / dt:,.0f} tokens/s), {self.shards} shards, {dt:,.1f} s"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s", self.summary())
