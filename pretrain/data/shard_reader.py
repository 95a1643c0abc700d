"""Reading the blocks of the shards that ``data_prep`` wrote, and everything that can be wrong with them.

``check_manifest`` compares ``manifest.json`` with the model and checks that every shard it lists is
present with its recorded size and has readable tar headers (sha256 is ``data_prep verify``'s job,
not every run's). ``index_all_shards`` is the header scan alone. Both run before any process group
starts, so that a damaged shard is an exit-2 message naming it, not a traceback some hours in.

``SplitLayout`` is a split's blocks in a fixed order (shards by name, blocks in file order): the
sample id of a sequence is its index in that order. ``BlockReader`` reads blocks by tar offset and
checks each decoded block once: its shape and dtype against the manifest, and every token id below
the vocabulary size (a corrupt shard or an edited ``vocab_size`` otherwise trains for a while and
dies in the embedding lookup with an ``IndexError`` naming nothing).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from data_prep.common.commands import location, python_command
from data_prep.common.errors import ShardError
from data_prep.common.manifest import MANIFEST, Manifest, ShardEntry
from data_prep.common.shards import block_sizes, check_block, ids_dtype, index_shard, parse_block, read_span
from data_prep.common.storage import StorageError, Store, StoreUnavailable, open_store
from pretrain.data.shard_cache import CacheUnusable, ShardCache

__all__ = [
    "DataError",
    "ShardError",
    "TokenIdError",
    "check_manifest",
    "index_all_shards",
    "SplitLayout",
    "BlockReader",
]

_MAX_NAMED = 10  # problems name at most this many shards, then give a count
_OPEN_FILES = 16  # file handles kept open per reader
_INDEX_THREADS = 8
READ_AHEAD_THREADS = 8  # ranged GETs in flight per reader (a remote store only)
log = logging.getLogger("pretrain")
_cache_warned = False  # this process has said that its node cache is unusable


class DataError(ValueError):
    """The data cannot serve the requested layout (split too small, bad arguments, changed layout)."""


class TokenIdError(ShardError):
    """A decoded block holds a token id at or above the vocabulary size; the message names shard and block."""


def _named(count_label: str, items: list[str], where, hint: str = "") -> str:
    more = f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
    return f"{where}: {len(items)} {count_label}: {', '.join(items[:_MAX_NAMED])}{more}" + (
        f" ({hint})" if hint else ""
    )


# ------------------------------------------------------------------------------------ manifest


def _shard_index(path: str, entry: ShardEntry) -> np.ndarray:
    """The shard's ``block_offsets`` (int64, 8 bytes a block), scanned from its tar headers and checked
    against the manifest's where it records them."""
    offsets = index_shard(path)
    if len(offsets) != entry.blocks + 1:
        raise ShardError(
            f"{path}: its tar headers list {len(offsets) - 1} blocks, the manifest says {entry.blocks} "
            f"(a damaged header, or rewritten after finalize; run data_prep verify)"
        )
    if entry.block_offsets is not None and tuple(offsets) != entry.block_offsets:
        raise ShardError(
            f"{path}: its tar headers put the blocks elsewhere than the manifest's block_offsets "
            f"(rewritten after finalize; run data_prep verify)"
        )
    return np.asarray(offsets, dtype=np.int64)


def _index_problems(data_dir, entries: Sequence[ShardEntry]) -> list[str]:
    def problem(entry: ShardEntry) -> Optional[str]:
        try:
            _shard_index(str(Path(data_dir) / entry.name), entry)
        except ShardError as exc:
            return str(exc)
        return None

    # Threads: a cold scan waits on one small read per tar member (4x faster with 4 threads here).
    with ThreadPoolExecutor(max_workers=_INDEX_THREADS) as pool:
        failed = [p for p in pool.map(problem, entries) if p is not None]
    return [_named("shards with unreadable tar headers", failed, Path(data_dir))] if failed else []


def index_all_shards(data_dir: str | os.PathLike, manifest: Manifest, splits: Sequence[str]) -> None:
    """Read the tar headers (not the data) of every shard of ``splits``; raise one ``ShardError`` naming
    every shard that cannot be indexed or whose block count differs from the manifest's."""
    problems = _index_problems(data_dir, [s for s in manifest.shards if s.split in set(splits)])
    if problems:
        raise ShardError("\n".join(problems))


def _shard_sizes(store: Store, entries: Sequence[ShardEntry]) -> dict[str, Optional[int]]:
    """Each shard's size where it is (None: absent): a stat per file, one listing of a bucket, or a
    HEAD per object of a web folder."""
    if store.local_dir is not None:
        return {e.name: (p.stat().st_size if (p := store.local_dir / e.name).is_file() else None) for e in entries}
    try:
        listed = store.list()
    except StorageError:  # https: no listing
        with ThreadPoolExecutor(max_workers=_INDEX_THREADS) as pool:
            infos = list(pool.map(lambda e: store.stat(e.name), entries))
        return {e.name: (i.size if i else None) for e, i in zip(entries, infos)}
    return {e.name: listed.get(e.name) for e in entries}


def _shard_file_problems(
    manifest: Manifest, data_dir: str | os.PathLike, splits: Sequence[str]
) -> tuple[list[str], list[ShardEntry]]:
    """Missing, wrong-size or inconsistent shard files; and the sound entries of ``splits`` (all if none)."""
    problems: list[str] = []
    missing, wrong_size, inconsistent, sound, unindexed = [], [], [], [], []
    store = open_store(data_dir)
    sizes = _shard_sizes(store, manifest.shards)
    for entry in manifest.shards:
        size = sizes[entry.name]
        if size is None:
            missing.append(entry.name)
            continue
        if store.local_dir is None and entry.block_offsets is None:
            unindexed.append(entry.name)
            continue
        if size != entry.bytes:
            wrong_size.append(f"{entry.name} ({size} bytes, manifest says {entry.bytes})")
            continue
        try:
            block_sizes(entry, manifest.block_size)
        except ShardError as exc:
            inconsistent.append(str(exc))
            continue
        if not splits or entry.split in splits:
            sound.append(entry)
    for label, items, hint in (
        ("shard files missing", missing, "restore them or re-run data_prep"),
        (
            "shards without block_offsets in the manifest",
            unindexed,
            "a remote reader needs them: run "
            f"`{python_command('data_prep', 'finalize', location(data_dir))}` again, which records them",
        ),
        ("shard files of the wrong size", wrong_size, "truncated or rewritten; run data_prep verify"),
        ("shard entries inconsistent", inconsistent, ""),
    ):
        if items:
            problems.append(_named(label, items, store.url(), hint))
    return problems, sound


def check_manifest(
    manifest: Manifest,
    data_dir: str | os.PathLike,
    *,
    splits: Sequence[str] = (),
    vocab_size: Optional[int] = None,
    tokenizer_sha256: Optional[str] = None,
    seq_len_max: Optional[int] = None,
    max_positions: Optional[int] = None,
    index_tars: bool = True,
) -> list[str]:
    """Every reason the data in ``data_dir`` cannot feed this model, as readable lines (empty: fine).

    ``vocab_size`` is the tokenizer's (unpadded) vocabulary the model was built for,
    ``tokenizer_sha256`` the hash of the model's tokenizer folder (as data prep computes it),
    ``seq_len_max`` (alias ``max_positions``) the model's ``max_position_embeddings``; ``None`` skips a
    check. Each split in ``splits`` must have shards. Shard files are checked for presence and size,
    and with ``index_tars`` the tar headers of the shards of ``splits`` (all shards if none are named)
    are read too (``index_all_shards``).
    """
    where = open_store(data_dir).url(MANIFEST)
    seq_len_max = seq_len_max if seq_len_max is not None else max_positions
    problems: list[str] = []
    data_vocab, data_sha256, seq_len = manifest.tokenizer.vocab_size, manifest.tokenizer.sha256, manifest.seq_len
    if tokenizer_sha256 is not None and data_sha256 != tokenizer_sha256:
        problems.append(
            f"{where}: the data was tokenized with tokenizer sha256 {data_sha256[:12]}..., "
            f"the model's tokenizer is {tokenizer_sha256[:12]}... (re-run data_prep with the model's tokenizer)"
        )
    if vocab_size is not None and data_vocab != vocab_size:
        problems.append(f"{where}: tokenizer.vocab_size is {data_vocab}, the model's vocabulary is {vocab_size}")
    if seq_len_max is not None and seq_len > seq_len_max:
        problems.append(f"{where}: seq_len {seq_len} exceeds the model's max_position_embeddings {seq_len_max}")
    if manifest.dtype != ids_dtype(data_vocab).name:
        problems.append(f"{where}: dtype {manifest.dtype!r} does not hold a vocabulary of {data_vocab}")
    present = sorted({s.split for s in manifest.shards})
    for split in splits:
        if not any(s.sequences > 0 for s in manifest.shards_of(split)):
            problems.append(f"{where}: split {split!r} has no shards with sequences (splits present: {present})")
    try:
        shard_problems, sound = _shard_file_problems(manifest, data_dir, splits)
    except StorageError as exc:
        return problems + [str(exc)]
    problems += shard_problems
    if index_tars and open_store(data_dir).local_dir is not None:  # remote: offsets from the manifest
        problems += _index_problems(data_dir, sound)
    return problems


# ------------------------------------------------------------------------------------ layout


class SplitLayout:
    """The blocks of one split, in a fixed order (shards by name, blocks in file order); picklable.
    A sequence's sample id is its index in this order: ``block_first[block] + row``."""

    def __init__(self, data_dir: str | os.PathLike, manifest: Manifest, split: str):
        entries = sorted((s for s in manifest.shards_of(split) if s.blocks > 0), key=lambda s: s.name)
        self.split = split
        self.seq_len = manifest.seq_len
        self.block_size = manifest.block_size
        self.vocab_size = manifest.tokenizer.vocab_size
        self.pad_id = manifest.tokenizer.pad_id
        self.store = open_store(data_dir)  # picklable: a worker makes its own client
        self.paths = [self.store.url(s.name) for s in entries]  # for messages; files where local
        self.shard_blocks = [s.blocks for s in entries]
        self.shard_entries = entries
        # What a resumed stream must find unchanged: names, counts and content hashes of the split's shards.
        self.shards_signature = [[s.name, s.sequences, s.sha256] for s in entries]
        shard, index, size = [], [], []
        for i, entry in enumerate(entries):
            sizes = block_sizes(entry, self.block_size)
            shard += [i] * len(sizes)
            index += range(len(sizes))
            size += sizes
        self.block_shard = np.asarray(shard, dtype=np.int64)
        self.block_index = np.asarray(index, dtype=np.int64)
        self.block_len = np.asarray(size, dtype=np.int64)
        self.block_first = np.cumsum(self.block_len) - self.block_len
        self.sequences = int(self.block_len.sum())

    @property
    def num_blocks(self) -> int:
        return len(self.block_len)

    def describe_sample(self, sample_id: int) -> tuple[str, int]:
        """(shard file name, sequence index within that shard) of a sample id."""
        block = int(np.searchsorted(self.block_first, sample_id, side="right")) - 1
        row = int(sample_id - self.block_first[block])
        return (
            os.path.basename(self.paths[self.block_shard[block]]),
            int(self.block_index[block]) * self.block_size + row,
        )


class BlockReader:
    """Reads, checks and decodes blocks of one split for one process; caches handles, indexes and blocks.

    The decoded-block cache is bounded by sequences, not blocks, so that tiny blocks (short shards)
    cannot make it hold more than about ``cache_sequences`` rows. Shards are indexed lazily, each once
    per reader: after ``index_all_shards`` passed, a failure here is a real I/O fault (still a
    ``ShardError`` naming the shard)."""

    def __init__(self, layout: SplitLayout, cache_sequences: int):
        self.layout = layout
        self.cache_sequences = cache_sequences
        self._files: OrderedDict[int, object] = OrderedDict()
        self._indexes: dict[int, np.ndarray] = {}
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cached_rows = 0
        # Read-ahead from a remote store: blocks asked for before they are needed, fetched by a few
        # threads; at most about ``cache_sequences`` rows of them wait, so memory stays bounded.
        self._pending: dict[int, Future] = {}
        self._max_pending = max(READ_AHEAD_THREADS, cache_sequences // max(layout.block_size, 1))
        self._pool: Optional[ThreadPoolExecutor] = None
        # The node's cache of whole remote shards (shard_cache): one background download per shard at a
        # time, and the cached files read with pread (the read-ahead threads share the descriptors).
        self._cache = ShardCache.from_env() if layout.store.local_dir is None else None
        self._downloads: Optional[ThreadPoolExecutor] = None
        self._fetches: dict[int, Future] = {}
        self._cached_fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def prefetch(self, blocks) -> None:
        """Start fetching ``blocks`` in the background (a remote store only; a local read is cheap)."""
        lay = self.layout
        if lay.store.local_dir is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="read-ahead")
        for b in map(int, blocks):
            if b in self._blocks or b in self._pending:
                continue
            if len(self._pending) >= self._max_pending:
                return
            self._pending[b] = self._pool.submit(self._read, int(lay.block_shard[b]), int(lay.block_index[b]))

    def _file(self, shard: int):
        f = self._files.get(shard)
        if f is not None:
            self._files.move_to_end(shard)
            return f
        path = self.layout.paths[shard]
        if shard not in self._indexes:
            entry = self.layout.shard_entries[shard]
            self._indexes[shard] = (
                np.asarray(entry.block_offsets, dtype=np.int64) if entry.block_offsets else _shard_index(path, entry)
            )
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise ShardError(f"{path}: cannot open ({exc})") from exc
        self._files[shard] = f
        if len(self._files) > _OPEN_FILES:
            self._files.popitem(last=False)[1].close()
        return f

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        hit = self._blocks.get(b)
        if hit is not None:
            self._blocks.move_to_end(b)
            return hit
        lay = self.layout
        shard, index, n = int(lay.block_shard[b]), int(lay.block_index[b]), int(lay.block_len[b])
        path = lay.paths[shard]
        future = self._pending.pop(b, None)
        try:
            ids, starts = future.result() if future is not None else self._read(shard, index)
        except StoreUnavailable:
            raise  # the store is down, not the data bad: exit 3 upstream
        except StorageError as exc:
            raise ShardError(f"{path}: block {index} cannot be read ({exc})") from exc
        except ShardError as exc:
            raise ShardError(f"{exc}; run data_prep verify") from exc
        except (ValueError, OSError, EOFError) as exc:
            raise ShardError(f"{path}: block {index} cannot be decoded ({exc}); run data_prep verify") from exc
        if ids.shape != (n, lay.seq_len) or starts.shape != (n, lay.seq_len) or ids.dtype.kind != "u":
            raise ShardError(
                f"{path}: block {index} has input_ids {ids.dtype}{list(ids.shape)}, "
                f"expected unsigned [{n}, {lay.seq_len}] from the manifest"
            )
        if ids.size and int(ids.max()) >= lay.vocab_size:
            row, col = (int(x) for x in np.argwhere(ids >= lay.vocab_size)[0])
            raise TokenIdError(
                f"{path}: block {index} holds token id {int(ids[row, col])} (row {row}, sequence "
                f"{index * lay.block_size + row} of the shard, position {col}) but the vocabulary has "
                f"{lay.vocab_size} ids: the shard is corrupt or manifest.json's tokenizer.vocab_size was "
                f"edited (run data_prep verify)"
            )
        self._blocks[b] = (ids, starts)
        self._cached_rows += n
        while self._cached_rows > self.cache_sequences and len(self._blocks) > 1:
            _, (old, _) = self._blocks.popitem(last=False)
            self._cached_rows -= len(old)
        return ids, starts

    def _read(self, shard: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """A block's two arrays: a seek and a read in a local file, one ranged GET from a store; its
        bytes checked against the manifest's ``block_crc32`` first, wherever they came from."""
        lay = self.layout
        entry = lay.shard_entries[shard]
        where = f"{lay.paths[shard]}: block {index}"
        if lay.store.local_dir is None:
            offsets = entry.block_offsets  # checked present by check_manifest
            try:
                fd = self._cached_fd(shard) if self._cache is not None else None
            except CacheUnusable as exc:
                self._give_up_cache(exc)
                fd = None
            if fd is not None:
                span = os.pread(fd, offsets[index + 1] - offsets[index], offsets[index])
            else:
                span = lay.store.read_range(entry.name, offsets[index], offsets[index + 1])
        else:
            f = self._file(shard)
            start, end = (int(x) for x in self._indexes[shard][index : index + 2])
            span = read_span(f, start, end)
        check_block(entry, index, span, where)
        return parse_block(span, lay.seq_len, where)

    def _cached_fd(self, shard: int) -> Optional[int]:
        """A descriptor of the shard's cached copy; else None, its download started (once per reader;
        its failure, a replaced object or the store down, is raised here on a later read)."""
        with self._lock:
            fd, cache = self._cached_fds.get(shard), self._cache
            if fd is not None or cache is None:  # (another thread gave the cache up meanwhile)
                return fd
            fetch = self._fetches.get(shard)
            if fetch is not None and fetch.done() and isinstance(fetch.exception(), CacheUnusable):
                self._give_up_cache(fetch.exception())
                return None
            if fetch is not None and fetch.done() and fetch.exception() is not None:
                raise fetch.exception()
            path = cache.lookup(self.layout.shard_entries[shard])
            if path is not None:
                try:
                    self._cached_fds[shard] = fd = os.open(path, os.O_RDONLY)
                    return fd
                except FileNotFoundError:  # evicted between lookup and open
                    pass
            if fetch is None or (fetch.done() and fetch.exception() is None):
                if self._downloads is None:
                    self._downloads = ThreadPoolExecutor(1, thread_name_prefix="shard-download")
                self._fetches[shard] = self._downloads.submit(
                    cache.fetch, self.layout.store, self.layout.shard_entries[shard]
                )
            return None

    def _give_up_cache(self, exc: CacheUnusable) -> None:
        """Ranged reads from here on: slower, the same bytes (each still checked). Said once per process."""
        global _cache_warned
        self._cache = None
        if not _cache_warned:
            _cache_warned = True
            log.warning(
                "data.cache_dir: %s; this process reads every block by range from %s from now on "
                "(slower, the same data)",
                exc.strerror or exc,
                self.layout.store.url(),
            )

    def gather(self, blocks: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Rows ``rows[i]`` of blocks ``blocks[i]`` as an int64 [B, L] and a bool [B, L] tensor, and
        whether any of them holds padding (computed here, so the trainer needs no device sync to know)."""
        ids = np.empty((len(blocks), self.layout.seq_len), dtype=np.int64)
        starts = np.empty((len(blocks), self.layout.seq_len), dtype=bool)
        self.prefetch(np.unique(blocks))  # a remote micro-batch's blocks arrive together
        for b in np.unique(blocks):
            sel = np.flatnonzero(blocks == b)
            block_ids, block_starts = self.block(int(b))
            ids[sel] = block_ids[rows[sel]]
            starts[sel] = block_starts[rows[sel]]
        return torch.from_numpy(ids), torch.from_numpy(starts), bool((ids == self.layout.pad_id).any())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        for pool in (self._pool, self._downloads):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._downloads, self._pending, self._fetches = None, None, {}, {}
        for fd in self._cached_fds.values():
            os.close(fd)
        self._cached_fds.clear()
