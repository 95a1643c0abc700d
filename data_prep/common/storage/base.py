"""What every store is: the ``Store`` interface, its errors, and how transient failures are retried.
A ``StorageError`` is bad input (exit 2 naming the URL); ``StoreUnavailable`` a store that stayed down
past the retry window (the trainer exits 3, requeue)."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("data_prep")

RETRY_ENV = "MLM_STORE_RETRY_S"  # how long transient failures are retried (the trainer sets data.remote_timeout_s)
DEFAULT_RETRY_S = 30.0
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(Exception):
    """A URL that cannot be used: unsupported scheme, no access, no such bucket or object."""


class StoreUnavailable(StorageError):
    """Transient failures (connection errors, 5xx, throttling) outlasted the retry window: the store is
    down, not the data bad. The trainer exits 3 (requeue) on it; the last checkpoint resumes."""


def is_url(location: str | os.PathLike) -> bool:
    return bool(SCHEME.match(str(location)))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    sha256: Optional[str]  # recorded at upload (S3) or None where not known without reading


class Store:
    """A folder of named objects. Names are relative, '/'-separated; ``url(name)`` is for messages."""

    root: str

    def url(self, name: str = "") -> str:
        return f"{self.root.rstrip('/')}/{name}" if name else self.root

    @property
    def local_dir(self) -> Optional[Path]:
        """The folder itself where the store is local, else None."""
        return None

    def read_bytes(self, name: str) -> bytes:
        raise NotImplementedError

    def read_range(self, name: str, start: int, end: int) -> bytes:
        raise NotImplementedError

    def stat(self, name: str) -> Optional[ObjectInfo]:
        raise NotImplementedError

    def list(self, prefix: str = "") -> dict[str, int]:
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def put_file(self, local: Path, name: str, sha256: str, keep_local: bool = False) -> None:
        """Publish the complete file ``local`` as ``name`` whole (the object appears only complete);
        ``local`` is consumed unless ``keep_local``."""
        raise NotImplementedError

    def delete(self, names: list[str]) -> None:
        raise NotImplementedError

    def check(self, write: bool) -> None:
        raise NotImplementedError

    def delete_folder(self, prefix: str) -> None:
        """Every object under ``prefix/``."""
        self.delete(sorted(self.list(prefix)))

    def download(self, name: str, local: Path) -> None:
        """The object into the local file ``local``."""
        Path(local).write_bytes(self.read_bytes(name))

    def read_text(self, name: str) -> Optional[str]:
        """The object as text, or None where it does not exist."""
        if self.stat(name) is None:
            return None
        return self.read_bytes(name).decode("utf-8")

    def staging_dir(self) -> Path:
        """A local folder where files are written before ``put_file`` publishes them."""
        raise NotImplementedError

    def discard_staging(self) -> None:
        """Removes what ``staging_dir`` still holds: files never published, which no rerun can find
        again. Nothing where files are staged in place (a local folder's are its output)."""


def set_retry_window(seconds: float) -> None:
    """How long this process and the ones it starts retry transient failures."""
    os.environ[RETRY_ENV] = str(float(seconds))


def retry_window_s() -> float:
    try:
        return max(0.0, float(os.environ.get(RETRY_ENV) or DEFAULT_RETRY_S))
    except ValueError:
        return DEFAULT_RETRY_S


def attempt_timeouts() -> tuple[float, float]:
    """(connect, read) seconds of one request: a server that accepts and then says nothing (frozen)
    costs at most this per attempt, and no attempt outlasts the retry window, so the wait from the
    first failure to ``StoreUnavailable`` is the window plus at most one attempt."""
    window = max(1.0, retry_window_s())
    return min(20.0, window), min(120.0, window)


def with_retries(store: "Store", name: str, what: str, call: Callable, transient: Callable[[BaseException], bool]):
    """``call()``, again after a transient failure (backoff 0.5 s doubling to 16 s, jittered) until the
    retry window (``MLM_STORE_RETRY_S``, default 30 s) has passed, then ``StoreUnavailable``; the first
    retry of each store is logged, not every one."""
    started, attempt = time.monotonic(), 0
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 -- classified just below
            if not transient(exc):
                raise
            waited = time.monotonic() - started
            if waited >= retry_window_s():
                raise StoreUnavailable(
                    f"{store.url(name)}: {what} failed for {waited:.0f} s "
                    f"({type(exc).__name__}: {exc}); the store looks unavailable"
                ) from None
            if not getattr(store, "_retry_logged", False):
                store._retry_logged = True
                log.warning("%s: %s failed (%s); retrying with backoff", store.url(), what, type(exc).__name__)
            time.sleep(min(16.0, 0.5 * 2**attempt, max(0.05, retry_window_s() - waited)) * (0.5 + random.random() / 2))
            attempt += 1
