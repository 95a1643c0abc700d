"""A node's cache of whole shards from a remote store (``data.cache_dir``, ``data.cache_limit_gb``).

The first time a process of a node needs a block of a remote shard, it reads that block by a ranged
GET (so the step does not wait for the whole shard) and starts downloading the shard whole in the
background; later blocks of that shard, in this epoch and the next ones, are read from the local
file. The node's ranks and loader workers share the folder: a per-shard file lock lets one of them
download it while the others keep reading by range, so each object is downloaded once per node.
A download is checked against the manifest's sha256 before it is renamed into place (named by that
hash, so two data sets can share a cache), and ``downloads.log`` records each one. When the folder
holds more than its limit, the least recently used shards are removed (a process still reading one
keeps its open file).

The trainer sets the folder and limit for itself and its loader workers with ``configure``; a limit
of 0 turns the cache off (every block by ranged GET).

A cache folder that cannot hold shards is the cache's problem, not the data's: one that is a file, is
not writable or has no room for a shard is refused before any process group starts, naming
``data.cache_dir`` (``cache_dir_problems``); one that fails later (its disk filled by something else)
raises ``CacheUnusable``, and the reader says so once and reads by range from then on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from data_prep.common.errors import ShardError
from data_prep.common.manifest import ShardEntry
from data_prep.common.shards import sha256_file
from data_prep.common.storage import StorageError

log = logging.getLogger("pretrain")
ENV_DIR, ENV_GB = "MLM_DATA_CACHE_DIR", "MLM_DATA_CACHE_GB"
DOWNLOADS_LOG = "downloads.log"
_TOUCH_EVERY_S = 60.0  # a shard's last use, for eviction, is kept to this precision


class CacheUnusable(OSError):
    """The cache folder cannot take a shard (full, read-only, not a folder): read by range instead."""


def default_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"mlm-data-cache-{os.getuid()}")


def configure(cache_dir: str, limit_gb: float) -> None:
    """The cache of this process and the processes it starts (the loader's workers)."""
    os.environ[ENV_DIR] = cache_dir or default_dir()
    os.environ[ENV_GB] = str(float(limit_gb))


def _writable(root: Path) -> Optional[str]:
    """Why files cannot be written in ``root`` (None: they can): a probe file written, synced, removed."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-") as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def cache_dir_problems(cache_dir: str, limit_gb: float, largest_shard: int) -> list[str]:
    """Why ``data.cache_dir`` cannot cache this data's shards (empty: it can, or the cache is off)."""
    if limit_gb <= 0:
        return []
    root = Path(cache_dir or default_dir())
    shown = f"data.cache_dir={cache_dir}" if cache_dir else f"data.cache_dir (default {root})"
    hint = "point it at a writable local disk, or data.cache_limit_gb=0 to read every block by range"
    if root.exists() and not root.is_dir():
        return [f"{shown}: is a file, not a folder; {hint}"]
    why = _writable(root)
    if why is not None:
        return [f"{shown}: cannot be written ({why}); {hint}"]
    free = shutil.disk_usage(root).free
    if free < largest_shard:
        return [f"{shown}: {free / 2**20:.1f} MiB free, less than one shard ({largest_shard / 2**20:.1f} MiB); {hint}"]
    return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class ShardCache:
    def __init__(self, root: Path, limit_bytes: int):
        self.root, self.limit_bytes = Path(root), limit_bytes
        self._touched: dict[str, float] = {}

    @classmethod
    def from_env(cls) -> Optional["ShardCache"]:
        limit_gb = float(os.environ.get(ENV_GB) or 0)
        if limit_gb <= 0:
            return None
        return cls(Path(os.environ.get(ENV_DIR) or default_dir()), int(limit_gb * 2**30))

    def path(self, entry: ShardEntry) -> Path:
        return self.root / f"{entry.sha256}.tar"

    def lookup(self, entry: ShardEntry) -> Optional[Path]:
        """The cached copy, marked as used, or None."""
        path = self.path(entry)
        if not path.is_file():
            return None
        now = time.monotonic()
        if now - self._touched.get(entry.sha256, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S:
            self._touched[entry.sha256] = now
            try:
                os.utime(path)
            except FileNotFoundError:  # evicted just now by another process
                return None
            except OSError as exc:  # a read-only or failing cache disk
                raise CacheUnusable(exc.errno, f"{self.root}: {exc.strerror or exc}") from exc
        return path

    def fetch(self, store, entry: ShardEntry) -> None:
        """Download ``entry`` whole into the cache unless another process of this node is, or did.
        Raises ``CacheUnusable`` when the folder cannot take it (the data is not at fault)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / f".{entry.sha256}.lock", "a")
        except OSError as exc:
            raise CacheUnusable(exc.errno, f"{self.root}: {exc.strerror or exc}") from exc
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another process of this node is downloading it
            path = self.path(entry)
            if path.is_file():
                return
            free = shutil.disk_usage(self.root).free
            if free < entry.bytes:
                raise CacheUnusable(
                    errno.ENOSPC,
                    f"{self.root}: {free / 2**20:.1f} MiB free, the shard needs {entry.bytes / 2**20:.1f} MiB",
                )
            tmp = self.root / f".{entry.sha256}.{os.getpid()}.tmp"
            try:
                store.download(entry.name, tmp)
                if tmp.stat().st_size != entry.bytes or sha256_file(tmp) != entry.sha256:
                    raise ShardError(
                        f"{store.url(entry.name)}: downloaded whole, it is not the shard the "
                        "manifest lists (size or sha256 differs; replaced after data prep?)"
                    )
                os.replace(tmp, path)
                with open(self.root / DOWNLOADS_LOG, "a") as f:  # one short append: whole lines across processes
                    f.write(f"{entry.sha256} {entry.bytes} {store.url(entry.name)}\n")
            except StorageError as exc:
                # A local write that failed inside the download (the disk filled meanwhile) is reported
                # by the store as its own failure: the folder decides whose it was.
                why = _writable(self.root)
                if why is not None:
                    raise CacheUnusable(errno.EIO, f"{self.root}: {why}") from exc
                raise
            except OSError as exc:
                raise CacheUnusable(exc.errno, f"{self.root}: {exc.strerror or exc}") from exc
            finally:
                tmp.unlink(missing_ok=True)
        self.evict(keep=path)

    def clean(self) -> int:
        """Remove what no live process of this node holds: the partial file of a download whose process
        was killed (``.<sha256>.<pid>.tmp``), and the lock of a shard no longer cached that nobody holds.
        Returns the bytes of the downloads still in progress (they count against the limit)."""
        in_progress = 0
        # ``.<sha256>.<pid>.tmp``, and ``.<sha256>.<pid>.tmp.<random>``: boto3's own partial file, which
        # a download before this version wrote beside ours.
        for tmp in [*self.root.glob(".*.tmp"), *self.root.glob(".*.tmp.*")]:
            try:
                pid = int(tmp.name.split(".tmp", 1)[0].rsplit(".", 1)[-1])
                size = tmp.stat().st_size
            except (ValueError, FileNotFoundError):
                continue
            if _alive(pid):
                in_progress += size
            else:
                tmp.unlink(missing_ok=True)
        for lock_path in self.root.glob(".*.lock"):
            sha = lock_path.name[1 : -len(".lock")]
            if sha == "evict" or (self.root / f"{sha}.tar").exists():
                continue
            try:
                with open(lock_path, "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    # held, so no download of it is running; one that opened it and waits downloads once more, harmlessly
                    lock_path.unlink(missing_ok=True)
            except (BlockingIOError, FileNotFoundError):
                continue
        return in_progress

    def evict(self, keep: Path) -> None:
        """The least recently used shards, until the cache fits its limit (``keep`` stays); everything
        in the folder counts, downloads in progress included."""
        with open(self.root / ".evict.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            in_progress = self.clean()
            held = []
            for path in self.root.glob("*.tar"):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                held.append((st.st_mtime, st.st_size, path))
            total = in_progress + sum(size for _, size, _ in held)
            for _, size, path in sorted(held):
                if total <= self.limit_bytes:
                    break
                if path != keep:
                    path.unlink(missing_ok=True)
                    total -= size
