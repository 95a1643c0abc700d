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
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from data_prep.shard_format import ShardEntry, ShardError, sha256_file

log = logging.getLogger("pretrain")
ENV_DIR, ENV_GB = "MLM_DATA_CACHE_DIR", "MLM_DATA_CACHE_GB"
DOWNLOADS_LOG = "downloads.log"
_TOUCH_EVERY_S = 60.0          # a shard's last use, for eviction, is kept to this precision


def default_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"mlm-data-cache-{os.getuid()}")


def configure(cache_dir: str, limit_gb: float) -> None:
    """The cache of this process and the processes it starts (the loader's workers)."""
    os.environ[ENV_DIR] = cache_dir or default_dir()
    os.environ[ENV_GB] = str(float(limit_gb))


class ShardCache:
    def __init__(self, root: Path, limit_bytes: int):
        self.root, self.limit_bytes = Path(root), limit_bytes
        self._touched: dict[str, float] = {}

    @classmethod
    def from_env(cls) -> Optional["ShardCache"]:
        limit_gb = float(os.environ.get(ENV_GB) or 0)
        if limit_gb <= 0:
            return None
        return cls(Path(os.environ.get(ENV_DIR) or default_dir()), int(limit_gb * 2 ** 30))

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
            except FileNotFoundError:           # evicted just now by another process
                return None
        return path

    def fetch(self, store, entry: ShardEntry) -> None:
        """Download ``entry`` whole into the cache unless another process of this node is, or did."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(entry)
        with open(self.root / f".{entry.sha256}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return                          # another process of this node is downloading it
            if path.is_file():
                return
            tmp = self.root / f".{entry.sha256}.{os.getpid()}.tmp"
            try:
                store.download(entry.name, tmp)
                if tmp.stat().st_size != entry.bytes or sha256_file(tmp) != entry.sha256:
                    raise ShardError(f"{store.url(entry.name)}: downloaded whole, it is not the shard the "
                                     "manifest lists (size or sha256 differs; replaced after data prep?)")
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            with open(self.root / DOWNLOADS_LOG, "a") as f:   # one short append: whole lines across processes
                f.write(f"{entry.sha256} {entry.bytes} {store.url(entry.name)}\n")
        self.evict(keep=path)

    def evict(self, keep: Path) -> None:
        """The least recently used shards, until the cache fits its limit (``keep`` stays)."""
        with open(self.root / ".evict.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = []
            for path in self.root.glob("*.tar"):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                held.append((st.st_mtime, st.st_size, path))
            total = sum(size for _, size, _ in held)
            for _, size, path in sorted(held):
                if total <= self.limit_bytes:
                    break
                if path != keep:
                    path.unlink(missing_ok=True)
                    total -= size
