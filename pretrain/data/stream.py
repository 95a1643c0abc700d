"""The trainer's data: one global, resumable order of training sequences, and fixed evaluation batches.

Random access over the tar index, not a streaming webdataset pipeline
---------------------------------------------------------------------
The shards stay ordinary webdataset tars, but the trainer does not stream them: ``shard_reader``
indexes each tar's headers and reads the blocks it needs by offset. So the order of an epoch can be
a pure function of the manifest, and the data position one integer:

* **The position is a global count of samples consumed** (as Megatron-LM's consumed-samples
  counter): sequences of the split taken by all ranks together since the start of training. Global
  step ``k`` takes sequences ``[k*G, (k+1)*G)`` of the epoch order (``G`` the global batch), and
  the epoch order depends on ``(manifest, split, seed, epoch)`` only: not on the world size, the
  micro-batch or the number of DataLoader workers. A job requeued on another number of nodes, or
  with another micro-batch, continues exactly where it stopped: every global step holds the same
  set of sequences, none repeated or skipped. Only ``G`` must stay (``load_state_dict`` refuses a
  change, and a changed seed or data).
* **Resume is a seek**: the stream computes which sequences step ``k`` holds and reads only their
  blocks; a streaming pipeline would re-read everything consumed before.
* **Every rank gets the same number of batches by construction**, whatever the shard sizes: an
  epoch is ``sequences // G`` steps, known from the manifest; the tail (fewer than ``G`` sequences
  of the epoch order) is dropped (``dropped_per_epoch``).

Order of epoch ``e``: the split's blocks are permuted (seeded with ``(seed, e)``); the resulting
sequence order is cut into windows of ``shuffle_window_blocks * block_size`` sequences and each
window is shuffled (seeded with ``(seed, e, window)``), so that a step mixes sequences of several
blocks rather than neighbouring pieces of one document. Step ``k`` is the next ``G`` positions of
that order.

Which rank reads what: the step's ``G`` sequences are sorted back into block order, then cut
rank-major: rank ``r`` takes the ``r``-th of ``world`` equal runs and micro-step ``i`` the ``i``-th
``micro_batch`` of it. The loss and gradient are sums over the whole step, so how a step is cut into
micro-batches changes nothing but summation order. The trade-off of a global order: every rank's
sequences come from the whole window, so cut in shuffled order each rank would decode nearly every
block of it (read amplification up to ``min(world, blocks of the windows a step spans)``, where the
per-rank order had none). Sorted, rank ``r`` reads about the ``r``-th part of the window in every
step of it. Blocks decoded per block of an epoch, all ranks together (one worker each; 128 blocks of
256, windows of 8 blocks): G 256 on 8 ranks 2.75 (8 cut unsorted), G 2048 on 8 ranks 1.0, G 256 on
2 ranks 1.25, G 1024 on 32 ranks 5.7, G 4096 on 64 ranks 4.0 (32 unsorted). A micro-batch then holds
rows of a few neighbouring blocks, which matters to nothing in the step's sums.

Workers: a rank's micro-batches are numbered ``j = k * grad_accum + i``; DataLoader worker ``w`` of
``W`` yields ``j0 + w, j0 + w + W, ...`` and the DataLoader's round-robin returns them in order, so
the stream is identical for any number of workers. Each worker keeps open file handles, the tar
indexes and a cache of decoded blocks of two windows; workers do not share it, so with ``W``
workers a rank may decode a block up to ``W`` times (as with the per-rank order).

Every micro-batch is ``{"input_ids": int64 [mb, L], "word_starts": bool [mb, L], "sample_ids":
int64 [mb] (index of the sequence in the split: shards by name, blocks and rows in file order),
"has_padding": bool, "global_step": k, "micro_step": i, "epoch": e}``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_prep.common.manifest import Manifest, load_manifest
from data_prep.common.storage import StoreUnavailable
from pretrain.data.shard_reader import (
    BlockReader,
    DataError,
    ShardError,
    SplitLayout,
    TokenIdError,
    check_manifest,
    index_all_shards,
)

__all__ = [
    "DataError",
    "ShardError",
    "TokenIdError",
    "check_manifest",
    "index_all_shards",
    "Stream",
    "TrainStream",
]

# Seed domains, so that the block order of an epoch and the window shuffles never share a stream.
_BLOCK_ORDER, _WINDOW_ORDER = 0, 1
READ_AHEAD = 4  # micro-batches a worker fetches ahead from a remote store (blocks in flight: BlockReader)
MAIN = "main"  # the name of the one source that data.dir alone is


def _open_split(data_dir, manifest: Optional[Manifest], split) -> tuple[Manifest, SplitLayout]:
    """The split's layout, after the cheap manifest checks (the tar headers were read before training)."""
    manifest = load_manifest(data_dir) if manifest is None else manifest
    problems = check_manifest(manifest, data_dir, splits=(split,), index_tars=False)
    if problems:
        raise ShardError("\n".join(problems))
    return manifest, SplitLayout(data_dir, manifest, split)


# ------------------------------------------------------------------------------------ training


def cached(cache: OrderedDict, key, make, keep: int):
    """``cache[key]``, made by ``make()`` when missing; the oldest entries go beyond ``keep``."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        while len(cache) > keep:
            cache.popitem(last=False)
    return value


@dataclass(frozen=True)
class _Plan:
    """Which sequences each global step holds; a pure function of its fields (no rank, world or micro-batch)."""

    layout: SplitLayout
    global_batch: int
    seed: int
    window: int  # sequences per shuffle window; 0: no shuffle

    @property
    def steps_per_epoch(self) -> int:
        return self.layout.sequences // self.global_batch

    def block_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's block permutation and the end offset of each permuted block in the sequence order."""
        rng = np.random.Generator(np.random.PCG64([self.seed, _BLOCK_ORDER, epoch]))
        perm = rng.permutation(self.layout.num_blocks)
        return perm, np.cumsum(self.layout.block_len[perm])

    def window_order(self, epoch: int, window: int) -> np.ndarray:
        """Block-order offsets of the window's sequences, in the order steps take them."""
        lo, hi = window * self.window, min((window + 1) * self.window, self.layout.sequences)
        rng = np.random.Generator(np.random.PCG64([self.seed, _WINDOW_ORDER, epoch, window]))
        return lo + rng.permutation(hi - lo)

    def locate(self, order: tuple[np.ndarray, np.ndarray], offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Block-order offsets -> (block ids, rows within the blocks) under an epoch's block order."""
        perm, ends = order
        j = np.searchsorted(ends, offsets, side="right")
        return perm[j], offsets - (ends[j] - self.layout.block_len[perm[j]])


class _PlanCursor:
    """Caches the block orders, windows and step that consecutive micro-batches share."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._keep_windows = (plan.global_batch // plan.window + 2) if plan.window else 0
        self._step: tuple[int, tuple[np.ndarray, np.ndarray]] | None = None

    def step(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, rows) of global step ``k``'s ``G`` sequences, sorted into block order."""
        if self._step is not None and self._step[0] == k:
            return self._step[1]
        p = self.plan
        epoch, s = divmod(k, p.steps_per_epoch)
        order = cached(self._orders, epoch, lambda: p.block_order(epoch), 2)
        p0, p1 = s * p.global_batch, (s + 1) * p.global_batch
        if p.window:
            pieces = []
            for w in range(p0 // p.window, (p1 - 1) // p.window + 1):
                perm = cached(self._windows, (epoch, w), lambda: p.window_order(epoch, w), self._keep_windows)
                pieces.append(perm[max(p0 - w * p.window, 0) : p1 - w * p.window])
            offsets = np.sort(np.concatenate(pieces))
        else:
            offsets = np.arange(p0, p1)
        located = p.locate(order, offsets)
        self._step = (k, located)
        return located


@dataclass(frozen=True)
class _RankSlice:
    rank: int
    world: int
    micro_batch: int

    def take(self, step: tuple[np.ndarray, np.ndarray], micro_step: int) -> tuple[np.ndarray, np.ndarray]:
        share = len(step[0]) // self.world
        lo = self.rank * share + micro_step * self.micro_batch
        return step[0][lo : lo + self.micro_batch], step[1][lo : lo + self.micro_batch]


class _WorkerLoop(IterableDataset):
    """One rank's infinite micro-batches from micro-batch ``start``, for one source or a mixture: worker
    w of W yields j = start + w (mod W), and from a remote store fetches the blocks of its next
    ``READ_AHEAD`` micro-batches while it works. A subclass says what a planner, a prefetch and a
    micro-batch are."""

    grad_accum: int
    start: int
    remote: bool

    def readers(self) -> list[BlockReader]:
        raise NotImplementedError

    def planner(self):
        raise NotImplementedError

    def prefetch(self, readers: list[BlockReader], planner, k: int, i: int) -> None:
        raise NotImplementedError

    def batch_at(self, readers: list[BlockReader], planner, k: int, i: int) -> dict:
        raise NotImplementedError

    def __iter__(self):
        info = get_worker_info()
        w, num = (info.id, info.num_workers) if info is not None else (0, 1)
        readers, planner = self.readers(), self.planner()
        ahead = self.planner() if self.remote else None  # its own planner: it runs steps ahead
        try:
            j = self.start + w
            ahead_j = j
            while True:
                while ahead is not None and ahead_j < j + READ_AHEAD * num:
                    ahead_j += num
                    self.prefetch(readers, ahead, *divmod(ahead_j, self.grad_accum))
                k, i = divmod(j, self.grad_accum)
                yield {**self.batch_at(readers, planner, k, i), "global_step": k, "micro_step": i}
                j += num
        except Exception as exc:  # not ``except ShardError``: that name may be gone at interpreter exit
            if info is None or not isinstance(exc, (ShardError, StoreUnavailable)):
                raise
            # Re-raised by the main process as the same type with the bare message: the DataLoader's
            # own re-raise would wrap it in the worker's traceback text.
            yield {"failure": type(exc), "message": str(exc)}
        finally:
            for reader in readers:
                reader.close()


class _TrainDataset(_WorkerLoop):
    """One source's micro-batches (see ``_WorkerLoop``)."""

    def __init__(self, plan: _Plan, part: _RankSlice, grad_accum: int, start: int, cache_sequences: int):
        self.plan, self.part, self.grad_accum = plan, part, grad_accum
        self.start, self.cache_sequences = start, cache_sequences
        self.remote = plan.layout.store.local_dir is None

    def readers(self) -> list[BlockReader]:
        return [BlockReader(self.plan.layout, self.cache_sequences)]

    def planner(self) -> _PlanCursor:
        return _PlanCursor(self.plan)

    def prefetch(self, readers: list[BlockReader], planner: _PlanCursor, k: int, i: int) -> None:
        readers[0].prefetch(self.part.take(planner.step(k), i)[0])

    def batch_at(self, readers: list[BlockReader], planner: _PlanCursor, k: int, i: int) -> dict:
        blocks, rows = self.part.take(planner.step(k), i)
        input_ids, word_starts, has_padding = readers[0].gather(blocks, rows)
        return {
            "input_ids": input_ids,
            "word_starts": word_starts,
            "sample_ids": torch.from_numpy(self.plan.layout.block_first[blocks] + rows),
            "has_padding": has_padding,
            "epoch": k // self.plan.steps_per_epoch,
        }


class Stream:
    """What the trainer reads: one rank's infinite, deterministic micro-batches from a global sample
    position (``samples_consumed``, a multiple of ``global_batch``), one source (``TrainStream``) or
    several (``pretrain.data.mixture.MixtureStream``). Iterating again restarts at that position."""

    global_batch: int
    grad_accum: int
    num_workers: int
    prefetch_factor: int
    samples_consumed: int

    @property
    def global_step(self) -> int:
        """The next global step this stream yields."""
        return self.samples_consumed // self.global_batch

    def metrics(self, step: int, max_steps: int) -> dict:
        """What the trainer logs about the data at ``step`` beside its own counters."""
        return {}

    def plan_lines(self, max_steps: int) -> list[str]:
        """What ``python -m pretrain.data plan`` prints: each source's size, share and epochs."""
        raise NotImplementedError

    def dataset(self, start: int) -> _WorkerLoop:
        raise NotImplementedError

    def __iter__(self) -> Iterator[dict]:
        start = self.global_step * self.grad_accum
        yield from ordered_batches(self, self.dataset(start), start)


class TrainStream(Stream):
    """One rank's infinite, deterministic stream of training micro-batches (see the module docstring).

    ``samples_consumed`` counts the sequences of all complete global steps this stream has yielded,
    plus ``start_samples``: a multiple of ``global_batch``. Iterating again restarts at that count;
    ``state_dict`` taken between optimizer steps resumes exactly after the last one. The stream is
    infinite: one iterator serves a whole run, so DataLoader workers start once.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        manifest: Optional[Manifest],
        split: str,
        rank: int,
        world: int,
        micro_batch: int,
        global_batch: int,
        seed: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        *,
        start_samples: int = 0,
        shuffle_window_blocks: int = 8,
    ):
        bad = [
            f"{name} must be >= {low}, got {value}"
            for name, value, low in (
                ("world", world, 1),
                ("micro_batch", micro_batch, 1),
                ("global_batch", global_batch, 1),
                ("seed", seed, 0),
                ("num_workers", num_workers, 0),
                ("prefetch_factor", prefetch_factor, 1),
                ("start_samples", start_samples, 0),
                ("shuffle_window_blocks", shuffle_window_blocks, 0),
            )
            if value < low
        ]
        if not 0 <= rank < max(world, 1):
            bad.append(f"rank must be in [0, {world}), got {rank}")
        if not bad and global_batch % (micro_batch * world):
            bad.append(f"global_batch {global_batch} is not a multiple of micro_batch {micro_batch} x world {world}")
        if not bad and start_samples % global_batch:
            bad.append(f"start_samples {start_samples} is not a multiple of global_batch {global_batch}")
        if bad:
            raise DataError("TrainStream: " + "; ".join(bad))
        self.manifest, layout = _open_split(data_dir, manifest, split)
        self._plan = _Plan(layout, global_batch, seed, shuffle_window_blocks * layout.block_size)
        if self._plan.steps_per_epoch == 0:
            raise DataError(
                f"split {split!r} of {data_dir} has {layout.sequences} sequences: too few for "
                f"one global batch of {global_batch} (prepare more data or lower train.global_batch_size)"
            )
        self._part = _RankSlice(rank, world, micro_batch)
        self.split, self.rank, self.world, self.micro_batch, self.seed = split, rank, world, micro_batch, seed
        self.global_batch, self.shuffle_window_blocks = global_batch, shuffle_window_blocks
        self.grad_accum = global_batch // (micro_batch * world)
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.samples_consumed = start_samples
        # Two windows (a step may straddle them) or two steps, plus blocks at their edges.
        self._cache_sequences = 2 * max(self._plan.window, global_batch) + 2 * layout.block_size

    # -- sizes, from the manifest alone
    @property
    def steps_per_epoch(self) -> int:
        return self._plan.steps_per_epoch

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
        """Sequences of the split that no step takes in an epoch (the tail that does not fill a global batch)."""
        return self.sequences_in_split - self.steps_per_epoch * self.global_batch

    @property
    def epoch(self) -> int:
        return self.global_step // self.steps_per_epoch

    def split_fingerprint(self) -> str:
        text = json.dumps([self.split, self._plan.layout.shards_signature])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        lay = self._plan.layout
        return (
            f"{self.split}: {lay.sequences} sequences of {lay.seq_len} tokens in {lay.num_blocks} blocks of "
            f"{len(lay.paths)} shards; {self.steps_per_epoch} steps of {self.global_batch} per epoch "
            f"({self.world} ranks x micro-batch {self.micro_batch} x accumulation {self.grad_accum}); "
            f"{self.dropped_per_epoch} sequences dropped per epoch"
        )

    def step_sample_ids(self, k: int) -> np.ndarray:
        """Sample ids of all ``G`` sequences of global step ``k`` (all ranks), in block order."""
        blocks, rows = _PlanCursor(self._plan).step(k)
        return self._plan.layout.block_first[blocks] + rows

    def describe_sample(self, sample_id: int) -> tuple[str, int]:
        """(shard file name, sequence index in that shard) of a sample id."""
        return self._plan.layout.describe_sample(sample_id)

    # -- resume
    _MUST_MATCH = ("global_batch", "seed", "split", "sequences_in_split", "split_fingerprint", "shuffle_window_blocks")

    def state_dict(self) -> dict:
        """The position and what it means; ``world`` and ``micro_batch`` are for the record only."""
        return {
            "samples_consumed": self.samples_consumed,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "split": self.split,
            "sequences_in_split": self.sequences_in_split,
            "split_fingerprint": self.split_fingerprint(),
            "shuffle_window_blocks": self.shuffle_window_blocks,
            "epoch": self.epoch,
            "world": self.world,
            "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["samples_consumed"]``, under any world size and micro-batch. A state of
        another global batch, seed, split, data or shuffle window is refused, naming every difference."""
        mine = self.state_dict()
        changed = [
            f"{k}: {state.get(k)!r} in the checkpoint, {mine[k]!r} now"
            for k in self._MUST_MATCH
            if state.get(k) != mine[k]
        ]
        if changed:
            raise DataError(
                "the data stream's checkpointed position does not apply to this run ("
                + "; ".join(changed)
                + "): the same sequences in the same order need the same "
                "global batch, data seed, split and shards"
            )
        self.samples_consumed = checked_position(state, self.global_batch)

    def plan_lines(self, max_steps: int) -> list[str]:
        n = self.sequences_in_split  # less the tail each epoch drops
        return [
            (
                f"{MAIN}: {n} sequences, share of the steps 1.000, epochs at step {max_steps}: "
                f"{max_steps / self.steps_per_epoch:.3f}"
            )
        ]

    def dataset(self, start: int) -> _TrainDataset:
        return _TrainDataset(self._plan, self._part, self.grad_accum, start, self._cache_sequences)


def checked_position(state: dict, global_batch: int) -> int:
    consumed = state.get("samples_consumed")
    if not isinstance(consumed, int) or consumed < 0 or consumed % global_batch:
        raise DataError(
            f"the data stream's samples_consumed {consumed!r} is not a multiple of the global batch {global_batch}"
        )
    return consumed


def ordered_batches(stream, dataset, start: int) -> Iterator[dict]:
    """``dataset``'s micro-batches from ``stream.num_workers`` workers, checked to come in order (the
    worker round-robin is what makes resume exact); keeps ``stream.samples_consumed`` up to date."""
    workers = stream.num_workers
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=stream.prefetch_factor if workers else None,
        pin_memory=torch.cuda.is_available(),
    )
    expected = start
    for batch in loader:
        if "failure" in batch:
            raise batch["failure"](batch["message"])
        j = batch["global_step"] * stream.grad_accum + batch["micro_step"]
        if j != expected:
            raise RuntimeError(f"data stream out of order: got micro-batch {j}, expected {expected}")
        expected += 1
        if batch["micro_step"] == stream.grad_accum - 1:
            stream.samples_consumed = (batch["global_step"] + 1) * stream.global_batch
        yield batch
