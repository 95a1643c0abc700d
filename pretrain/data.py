"""The trainer's data loader over the shards that ``data_prep`` wrote (``data_prep/shard_format.py``).

Random access over the tar index, not a streaming webdataset pipeline
---------------------------------------------------------------------
The shards stay ordinary webdataset tars, but the trainer does not stream them. It indexes each
tar's headers once (``index_shard``) and reads the blocks it needs by offset. Two properties follow
that a streaming pipeline (shard list -> split by node -> split by worker -> shuffle buffer) cannot
give cheaply:

* **Exact resume is a seek.** The whole order of an epoch is a pure function of the manifest and
  ``(seed, epoch, rank, world, micro_batch)``; a stream's position is one integer, the global
  micro-batch counter ``g``. Resuming at ``g`` computes which sequences batch ``g`` holds and reads
  only their blocks; a streaming pipeline would have to re-read (or skip through) everything
  consumed before, and its shuffle buffer's state is not part of any checkpoint.
* **Every rank gets the same number of batches by construction.** Shards have any sizes (a Slurm
  task's last shard is short); splitting *shards* over ranks gives ranks unequal counts, and the rank
  that runs out first leaves the others waiting in a collective forever. Here the epoch's sequences
  are split into equal contiguous shares, so ``batches_per_epoch`` is the same on every rank and is
  known from the manifest alone; the tail (fewer than ``world * micro_batch`` sequences) is dropped.

Order of an epoch ``e``: the split's blocks are permuted by a generator seeded with ``(seed, e)``;
rank ``r`` takes the ``r``-th of ``world`` equal contiguous runs of the resulting sequence order
(contiguous, so a rank touches about ``1/world`` of the blocks); within that run, windows of about
``shuffle_window_blocks`` blocks are shuffled (seeded with ``(seed, e, rank, window)``) so that a
micro-batch mixes sequences of several blocks rather than neighbouring pieces of one document.

Workers: DataLoader worker ``w`` of ``W`` yields batches ``g0 + w, g0 + w + W, ...``; the
DataLoader's round-robin over workers then returns ``g0, g0 + 1, ...`` in order, so the stream is
identical for any number of workers. Each worker keeps open file handles, the tar indexes and a
small cache of decoded blocks (a worker's consecutive batches come from the same window).

The loader trusts only ``manifest.json``: ``check_manifest`` compares it with the model and checks
that every shard it lists is present with its recorded size (sha256 is ``data_prep verify``'s job,
not every run's); a shard that fails to index or decode when read raises ``ShardError`` naming it.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_prep.shard_format import (
    BlockRef,
    ShardError,
    block_sizes,
    ids_dtype,
    index_shard,
    load_manifest,
    read_block,
)

__all__ = [
    "DataError", "ShardError", "check_manifest", "TrainStream", "eval_batches", "eval_batch_count",
]

# Seed domains, so that the block order of an epoch and the window shuffles never share a stream.
_BLOCK_ORDER, _WINDOW_ORDER = 0, 1
_MAX_NAMED = 10            # problems name at most this many shards, then give a count
_OPEN_FILES = 16           # file handles kept open per worker


class DataError(ValueError):
    """The data cannot serve the requested layout (split too small, bad arguments, changed layout)."""


# ------------------------------------------------------------------------------------ manifest


def check_manifest(manifest: dict, data_dir: str | os.PathLike, *, splits: Sequence[str] = (),
                   vocab_size: Optional[int] = None, tokenizer_sha256: Optional[str] = None,
                   seq_len_max: Optional[int] = None, max_positions: Optional[int] = None) -> list[str]:
    """Every reason the data in ``data_dir`` cannot feed this model, as readable lines (empty: fine).

    ``vocab_size`` is the tokenizer's (unpadded) vocabulary the model was built for,
    ``tokenizer_sha256`` the hash of the model's tokenizer folder (as data prep computes it),
    ``seq_len_max`` (alias ``max_positions``) the model's ``max_position_embeddings``; ``None`` skips a
    check. Each split in
    ``splits`` must have shards. Shard files are checked for presence and size only.
    """
    where = Path(data_dir) / "manifest.json"
    seq_len_max = seq_len_max if seq_len_max is not None else max_positions
    problems: list[str] = []
    missing_keys = [k for k in ("seq_len", "block_size", "tokenizer", "shards") if k not in manifest]
    if missing_keys:
        return [f"{where}: missing keys {missing_keys} (not written by data_prep finalize?)"]
    tok = manifest["tokenizer"]
    data_vocab = tok.get("vocab_size")
    if tokenizer_sha256 is not None and tok.get("sha256") != tokenizer_sha256:
        problems.append(f"{where}: the data was tokenized with tokenizer sha256 {str(tok.get('sha256'))[:12]}..., "
                        f"the model's tokenizer is {tokenizer_sha256[:12]}... (re-run data_prep with the model's tokenizer)")
    if vocab_size is not None and data_vocab != vocab_size:
        problems.append(f"{where}: tokenizer.vocab_size is {data_vocab}, the model's vocabulary is {vocab_size}")
    seq_len = manifest["seq_len"]
    if seq_len_max is not None and seq_len > seq_len_max:
        problems.append(f"{where}: seq_len {seq_len} exceeds the model's max_position_embeddings {seq_len_max}")
    if isinstance(data_vocab, int) and "dtype" in manifest and manifest["dtype"] != ids_dtype(data_vocab).name:
        problems.append(f"{where}: dtype {manifest['dtype']!r} does not hold a vocabulary of {data_vocab}")
    present = sorted({s.get("split") for s in manifest["shards"]} - {None})
    for split in splits:
        if not any(s.get("split") == split and s.get("sequences", 0) > 0 for s in manifest["shards"]):
            problems.append(f"{where}: split {split!r} has no shards with sequences (splits present: {present})")
    missing, wrong_size, inconsistent = [], [], []
    for entry in manifest["shards"]:
        path = Path(data_dir) / entry["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            missing.append(entry["name"])
            continue
        if "bytes" in entry and size != entry["bytes"]:
            wrong_size.append(f"{entry['name']} ({size} bytes, manifest says {entry['bytes']})")
        try:
            block_sizes(entry, manifest["block_size"])
        except (ShardError, KeyError) as exc:
            inconsistent.append(str(exc))
    for label, items, hint in (
            ("shard files missing", missing, "restore them or re-run data_prep"),
            ("shard files of the wrong size", wrong_size, "truncated or rewritten; run data_prep verify"),
            ("shard entries inconsistent", inconsistent, "")):
        if items:
            more = f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
            problems.append(f"{Path(data_dir)}: {len(items)} {label}: {', '.join(items[:_MAX_NAMED])}{more}"
                            + (f" ({hint})" if hint else ""))
    return problems


# ------------------------------------------------------------------------------------ layout


class _Split:
    """The blocks of one split, in a fixed order (shards by name, blocks in file order); picklable."""

    def __init__(self, data_dir: str | os.PathLike, manifest: dict, split: str):
        entries = sorted((s for s in manifest["shards"] if s.get("split") == split and s.get("blocks", 0) > 0),
                         key=lambda s: s["name"])
        self.split = split
        self.seq_len = int(manifest["seq_len"])
        self.block_size = int(manifest["block_size"])
        self.paths = [str(Path(data_dir) / s["name"]) for s in entries]
        self.shard_blocks = [int(s["blocks"]) for s in entries]
        shard, index, size = [], [], []
        for i, entry in enumerate(entries):
            sizes = block_sizes(entry, self.block_size)
            shard += [i] * len(sizes)
            index += range(len(sizes))
            size += sizes
        self.block_shard = np.asarray(shard, dtype=np.int64)
        self.block_index = np.asarray(index, dtype=np.int64)
        self.block_len = np.asarray(size, dtype=np.int64)
        self.sequences = int(self.block_len.sum())

    @property
    def num_blocks(self) -> int:
        return len(self.block_len)

    def describe_sequence(self, block: int, row: int) -> tuple[str, int]:
        """(shard file name, sequence index within that shard)."""
        return (os.path.basename(self.paths[self.block_shard[block]]),
                int(self.block_index[block]) * self.block_size + int(row))


def _open_split(data_dir, manifest, split) -> tuple[dict, _Split]:
    manifest = load_manifest(data_dir) if manifest is None else manifest
    problems = check_manifest(manifest, data_dir, splits=(split,))
    if problems:
        raise ShardError("\n".join(problems))
    return manifest, _Split(data_dir, manifest, split)


class _BlockReader:
    """Reads and decodes blocks of one split for one process; caches handles, indexes and blocks.

    The decoded-block cache is bounded by sequences, not blocks, so that tiny blocks (short shards)
    cannot make it hold more than about ``cache_sequences`` rows."""

    def __init__(self, layout: _Split, cache_sequences: int):
        self.layout = layout
        self.cache_sequences = cache_sequences
        self._files: OrderedDict[int, object] = OrderedDict()
        self._indexes: dict[int, list[BlockRef]] = {}
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cached_rows = 0

    def _file(self, shard: int):
        f = self._files.get(shard)
        if f is not None:
            self._files.move_to_end(shard)
            return f
        path = self.layout.paths[shard]
        if shard not in self._indexes:
            refs = index_shard(path)
            if len(refs) != self.layout.shard_blocks[shard]:
                raise ShardError(f"{path}: holds {len(refs)} blocks, the manifest says "
                                 f"{self.layout.shard_blocks[shard]} (rewritten after finalize? run data_prep verify)")
            self._indexes[shard] = refs
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
        f = self._file(shard)
        try:
            ids, starts = read_block(f, self._indexes[shard][index], lay.seq_len)
        except (ValueError, OSError, EOFError) as exc:
            raise ShardError(f"{lay.paths[shard]}: block {index} cannot be decoded ({exc}); "
                             f"run data_prep verify") from exc
        if ids.shape != (n, lay.seq_len) or starts.shape != (n, lay.seq_len) or ids.dtype.kind != "u":
            raise ShardError(f"{lay.paths[shard]}: block {index} has input_ids {ids.dtype}{list(ids.shape)}, "
                             f"expected unsigned [{n}, {lay.seq_len}] from the manifest")
        self._blocks[b] = (ids, starts)
        self._cached_rows += n
        while self._cached_rows > self.cache_sequences and len(self._blocks) > 1:
            _, (old, _) = self._blocks.popitem(last=False)
            self._cached_rows -= len(old)
        return ids, starts

    def gather(self, blocks: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows[i]`` of blocks ``blocks[i]`` as an int64 [B, L] and a bool [B, L] tensor."""
        ids = np.empty((len(blocks), self.layout.seq_len), dtype=np.int64)
        starts = np.empty((len(blocks), self.layout.seq_len), dtype=bool)
        for b in np.unique(blocks):
            sel = np.flatnonzero(blocks == b)
            block_ids, block_starts = self.block(int(b))
            ids[sel] = block_ids[rows[sel]]
            starts[sel] = block_starts[rows[sel]]
        return torch.from_numpy(ids), torch.from_numpy(starts)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# ------------------------------------------------------------------------------------ training


@dataclass(frozen=True)
class _Plan:
    """Which sequences each micro-batch of a rank's stream holds; a pure function of its fields."""
    layout: _Split
    rank: int
    world: int
    micro_batch: int
    seed: int
    window_batches: int        # batches per shuffle window; 0: no shuffle within the rank's run

    @property
    def per_rank(self) -> int:
        return self.layout.sequences // self.world

    @property
    def batches_per_epoch(self) -> int:
        return self.per_rank // self.micro_batch

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's block permutation and the end offset of each permuted block in the sequence order."""
        rng = np.random.Generator(np.random.PCG64([self.seed, _BLOCK_ORDER, epoch]))
        perm = rng.permutation(self.layout.num_blocks)
        return perm, np.cumsum(self.layout.block_len[perm])

    def window_order(self, epoch: int, window: int) -> np.ndarray:
        """Offsets (within the rank's run) of the window's sequences, in the order batches take them."""
        used = self.batches_per_epoch * self.micro_batch
        span = self.window_batches * self.micro_batch
        lo, hi = window * span, min((window + 1) * span, used)
        rng = np.random.Generator(np.random.PCG64([self.seed, _WINDOW_ORDER, epoch, self.rank, window]))
        return lo + rng.permutation(hi - lo)

    def locate(self, order: tuple[np.ndarray, np.ndarray], offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rank-run offsets -> (block ids, rows within the blocks) under an epoch order."""
        perm, ends = order
        pos = self.rank * self.per_rank + offsets
        j = np.searchsorted(ends, pos, side="right")
        return perm[j], pos - (ends[j] - self.layout.block_len[perm[j]])


class _PlanCursor:
    """Caches the epoch order and window order that consecutive batches share."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._window: tuple[tuple[int, int], np.ndarray] | None = None

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.plan
        epoch, b = divmod(g, p.batches_per_epoch)
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = p.epoch_order(epoch)
            if len(self._orders) > 2:
                self._orders.popitem(last=False)
        if p.window_batches:
            window, j = divmod(b, p.window_batches)
            if self._window is None or self._window[0] != (epoch, window):
                self._window = ((epoch, window), p.window_order(epoch, window))
            offsets = self._window[1][j * p.micro_batch:(j + 1) * p.micro_batch]
        else:
            offsets = np.arange(b * p.micro_batch, (b + 1) * p.micro_batch)
        return p.locate(order, offsets)


class _TrainDataset(IterableDataset):
    """Infinite stream of one rank's micro-batches from ``start``; worker w of W yields g = start + w (mod W)."""

    def __init__(self, plan: _Plan, start: int, cache_sequences: int):
        self.plan, self.start, self.cache_sequences = plan, start, cache_sequences

    def __iter__(self):
        info = get_worker_info()
        w, num = (info.id, info.num_workers) if info is not None else (0, 1)
        cursor = _PlanCursor(self.plan)
        reader = _BlockReader(self.plan.layout, self.cache_sequences)
        bpe = self.plan.batches_per_epoch
        try:
            g = self.start + w
            while True:
                blocks, rows = cursor.batch(g)
                input_ids, word_starts = reader.gather(blocks, rows)
                yield {"input_ids": input_ids, "word_starts": word_starts, "position": g, "epoch": g // bpe}
                g += num
        finally:
            reader.close()


class TrainStream:
    """One rank's infinite, deterministic stream of training micro-batches.

    Iterating yields dicts ``{"input_ids": LongTensor [B, L], "word_starts": BoolTensor [B, L],
    "position": g, "epoch": e}`` (CPU tensors, pinned when CUDA is available). ``position`` is the
    index of the *next* batch to be yielded; save ``state_dict()`` in a checkpoint and pass
    ``start_position`` (or ``load_state_dict``) to resume exactly there. The stream is infinite: one
    iterator serves a whole run, so DataLoader workers start once (``persistent_workers`` would only
    matter for re-iteration, which here restarts from ``position`` with fresh workers instead).
    """

    def __init__(self, data_dir: str | os.PathLike, manifest: Optional[dict], split: str, rank: int, world: int,
                 micro_batch: int, seed: int, num_workers: int = 0, prefetch_factor: int = 2, *,
                 start_position: int = 0, shuffle_window_blocks: int = 8):
        bad = [f"{name} must be >= {low}, got {value}" for name, value, low in (
            ("world", world, 1), ("micro_batch", micro_batch, 1), ("seed", seed, 0), ("num_workers", num_workers, 0),
            ("prefetch_factor", prefetch_factor, 1), ("start_position", start_position, 0),
            ("shuffle_window_blocks", shuffle_window_blocks, 0))
            if value < low]
        if not 0 <= rank < max(world, 1):
            bad.append(f"rank must be in [0, {world}), got {rank}")
        if bad:
            raise DataError("TrainStream: " + "; ".join(bad))
        self.manifest, layout = _open_split(data_dir, manifest, split)
        window_batches = math.ceil(shuffle_window_blocks * layout.block_size / micro_batch)
        self._plan = _Plan(layout, rank, world, micro_batch, seed, window_batches)
        if self._plan.batches_per_epoch == 0:
            raise DataError(f"split {split!r} of {data_dir} has {layout.sequences} sequences: too few for "
                            f"{world} rank(s) x micro-batch {micro_batch} = {world * micro_batch} per step "
                            f"(prepare more data or lower impl.micro_batch_size)")
        self.split, self.rank, self.world, self.micro_batch, self.seed = split, rank, world, micro_batch, seed
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.position = start_position
        # Two windows' worth of rows, plus a block for windows that straddle one.
        self._cache_sequences = 2 * max(window_batches, 1) * micro_batch + layout.block_size

    # -- sizes, from the manifest alone
    @property
    def batches_per_epoch(self) -> int:
        return self._plan.batches_per_epoch

    @property
    def tokens_per_batch(self) -> int:
        return self.micro_batch * self._plan.layout.seq_len

    @property
    def seq_len(self) -> int:
        return self._plan.layout.seq_len

    @property
    def sequences_in_split(self) -> int:
        return self._plan.layout.sequences

    @property
    def dropped_per_epoch(self) -> int:
        """Sequences of the split that no rank sees in an epoch (the tail that does not fill a step)."""
        return self.sequences_in_split - self.world * self.batches_per_epoch * self.micro_batch

    @property
    def epoch(self) -> int:
        return self.position // self.batches_per_epoch

    @property
    def batch_in_epoch(self) -> int:
        return self.position % self.batches_per_epoch

    def describe(self) -> str:
        lay = self._plan.layout
        return (f"{self.split}: {lay.sequences} sequences of {lay.seq_len} tokens in {lay.num_blocks} blocks of "
                f"{len(lay.paths)} shards; {self.batches_per_epoch} micro-batches of {self.micro_batch} per rank "
                f"per epoch x {self.world} ranks; {self.dropped_per_epoch} sequences dropped per epoch")

    def batch_sequences(self, g: int) -> list[tuple[str, int]]:
        """Which sequences batch ``g`` holds, as (shard file name, sequence index in that shard)."""
        blocks, rows = _PlanCursor(self._plan).batch(g)
        return [self._plan.layout.describe_sequence(b, r) for b, r in zip(blocks, rows)]

    # -- resume
    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "batches_per_epoch": self.batches_per_epoch, "world": self.world, "micro_batch": self.micro_batch,
                "seed": self.seed, "split": self.split, "sequences": self.sequences_in_split}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue at ``state["position"]``. The position only means the same data under the same
        layout; with ``strict=False`` a changed layout (e.g. another world size) resumes at the same
        epoch and fraction of it instead, which is close but not exact."""
        mine = self.state_dict()
        changed = [f"{k}: {state.get(k)!r} -> {mine[k]!r}"
                   for k in ("batches_per_epoch", "world", "micro_batch", "seed", "split", "sequences")
                   if state.get(k) != mine[k]]
        if not changed:
            self.position = int(state["position"])
        elif strict:
            raise DataError("data stream state is from a different layout (" + "; ".join(changed) + "); "
                            "an exact resume needs the same data, seed, world size and micro-batch")
        else:
            fraction = state["batch_in_epoch"] / state["batches_per_epoch"]
            self.position = state["epoch"] * self.batches_per_epoch + int(fraction * self.batches_per_epoch)

    # -- iteration
    def __iter__(self) -> Iterator[dict]:
        dataset = _TrainDataset(self._plan, self.position, self._cache_sequences)
        workers = self.num_workers
        loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                            prefetch_factor=self.prefetch_factor if workers else None,
                            pin_memory=torch.cuda.is_available())
        expected = self.position
        for batch in loader:
            if batch["position"] != expected:  # the worker round-robin is what makes resume exact
                raise RuntimeError(f"data stream out of order: got batch {batch['position']}, expected {expected}")
            expected += 1
            self.position = expected
            yield batch


# ------------------------------------------------------------------------------------ evaluation


def _eval_layout(per_rank: int, micro_batch: int, max_batches: int) -> int:
    batches = math.ceil(per_rank / micro_batch)
    return min(batches, max_batches) if max_batches > 0 else batches


def eval_batch_count(manifest: dict, split: str, world: int, micro_batch: int, max_batches: int = 0) -> int:
    """How many batches ``eval_batches`` yields on every rank."""
    n = sum(s["sequences"] for s in manifest["shards"] if s.get("split") == split)
    return _eval_layout(n // world, micro_batch, max_batches)


def eval_batches(data_dir: str | os.PathLike, manifest: Optional[dict], split: str, rank: int, world: int,
                 micro_batch: int, max_batches: int = 0) -> Iterator[dict]:
    """A fixed sequence of evaluation batches: the split in file order, rank ``r`` the ``r``-th of
    ``world`` equal contiguous parts, so every rank has the same number of batches (and the same
    shapes: the last batch may be shorter than ``micro_batch`` on every rank alike). Fewer than
    ``world`` sequences of the split go unused. ``max_batches`` > 0 takes only the first ones.
    Read in the calling process: evaluation reads each block once, in order."""
    _, layout = _open_split(data_dir, manifest, split)
    per_rank = layout.sequences // world
    if per_rank == 0:
        raise DataError(f"split {split!r} of {data_dir} has {layout.sequences} sequences, fewer than the "
                        f"{world} ranks that evaluate it")
    count = _eval_layout(per_rank, micro_batch, max_batches)
    ends = np.cumsum(layout.block_len)
    reader = _BlockReader(layout, cache_sequences=2 * layout.block_size + micro_batch)
    try:
        for b in range(count):
            pos = rank * per_rank + np.arange(b * micro_batch, min((b + 1) * micro_batch, per_rank))
            j = np.searchsorted(ends, pos, side="right")
            input_ids, word_starts = reader.gather(j, pos - (ends[j] - layout.block_len[j]))
            yield {"input_ids": input_ids, "word_starts": word_starts, "position": b}
    finally:
        reader.close()
