"""Data mixtures: several corpora in one resumable training order (``data.sources``).

The order is a pure function of (every source's manifest, the weights, the seed, the global sample
position), as for one source (``pretrain.data.stream``), so a resume at any world size or micro-batch
continues exactly.

* **Which source fills each slot.** The first ``P`` sequences of the run hold ``C_s(P)`` sequences of
  source ``s``: the largest-remainder apportionment of ``P`` by the normalised weights ``w_s``, so
  ``|C_s(P) - w_s P| < 1`` at every step boundary: the smallest error any assignment can have
  (Megatron-LM's ``BlendedDataset`` gives each next sample to the source that lags its share most;
  this is the same rule, evaluated at any position in O(sources) instead of walked sample by sample,
  which a resume at step one million would need). Step ``k`` takes ``C_s((k+1)G) - C_s(kG)`` sequences
  of source ``s``: never negative while every ``w_s G >= 1`` (checked before the run: a source with
  less than one sequence per step is refused).
* **Each source has its own epochs.** Source ``s``'s ``c``-th sequence is position ``c mod N_s`` of
  its epoch ``c // N_s`` (``N_s`` its training sequences): the block permutation and shuffle windows
  of ``pretrain.data.stream``, seeded per source. A small source repeats; no tail is dropped. A source's
  shuffle window is ``shuffle_window_blocks x share`` blocks (at least one): a step takes only its
  share of the source's sequences, so with full windows they would spread over 1/share times as many
  blocks, and the readers would look up that many more blocks per micro-batch.
* **Sample ids** are unique over the mixture: source ``s``'s ids follow those of the sources before
  it, so masking (keyed by sample id) never gives two sources' sequences the same draw.

Micro-batches carry the keys of ``pretrain.data.stream``'s (less ``epoch``: each source has its own) plus
``source`` (int64 [mb], each row's source index). Within a step the sources' sequences are concatenated in source order, each in block order; rank
``r`` takes the ``r``-th contiguous part, as in ``pretrain.data.stream``. One source is not a mixture: it
runs ``pretrain.data.stream.TrainStream`` unchanged (its checkpoints stay valid); both are a
``pretrain.data.stream.Stream`` and read through one worker loop (``_WorkerLoop``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from data_prep.common.manifest import Manifest, load_manifest
from pretrain import metric_names as names
from pretrain.config.seeds import derive_seed
from pretrain.data.shard_reader import BlockReader
from pretrain.data.stream import MAIN, DataError, Stream, _open_split, _Plan, _WorkerLoop, cached, checked_position


@dataclass(frozen=True)
class Source:
    name: str
    dir: str
    share: float  # normalised weight


def resolve_sources(data_cfg) -> list[Source]:
    """``data.sources`` with normalised weights, or ``data.dir`` as the one source ``main``."""
    if not data_cfg.sources:
        return [Source(MAIN, data_cfg.dir, 1.0)]
    total = sum(s.weight for s in data_cfg.sources)
    return [Source(s.name, s.dir, s.weight / total) for s in data_cfg.sources]


def is_mixture(cfg) -> bool:
    return len(cfg.data.sources) > 1


# ------------------------------------------------------------------------------------ apportionment


def apportion(shares, position: int) -> list[int]:
    """Sequences of each source among the first ``position`` of the run (largest remainder; ties to
    the earlier source). Sums to ``position``; within 1 of ``share * position`` for every source.
    Plain Python: a handful of sources, evaluated twice a step."""
    quota = [float(s) * position for s in shares]
    counts = [math.floor(q) for q in quota]
    left = position - sum(counts)
    if left > 0:
        for i in sorted(range(len(quota)), key=lambda i: (counts[i] - quota[i], i))[:left]:
            counts[i] += 1
    return counts


def min_share_problems(cfg) -> list[str]:
    """A source must get at least one sequence per step, or its cumulative count could step back."""
    if not is_mixture(cfg):
        return []
    g = cfg.train.global_batch_size
    return [
        f"data.sources[{s.name}]: weight share {s.share:.4g} x train.global_batch_size {g} < 1 sequence per "
        f"step; raise its weight or the global batch"
        for s in resolve_sources(cfg.data)
        if s.share * g < 1
    ]


# ------------------------------------------------------------------------------------ one source's order


class _SourceCursor:
    """Positions ``[a, b)`` of one source's endless order (its epochs one after another) -> (blocks, rows)."""

    def __init__(self, plan: _Plan, keep_windows: int):
        self.plan, self.keep_windows = plan, keep_windows
        self._orders: OrderedDict = OrderedDict()
        self._windows: OrderedDict = OrderedDict()

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's block permutation, the end and the start of each permuted block in its order."""
        order = self._orders.get(epoch)
        if order is None:
            perm, ends = self.plan.block_order(epoch)
            order = self._orders[epoch] = (perm, ends, ends - self.plan.layout.block_len[perm])
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return order

    def _epoch_piece(self, epoch: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.plan
        if p.window:
            first, last = lo // p.window, (hi - 1) // p.window
            pieces = []
            for w in range(first, last + 1):
                perm = cached(self._windows, (epoch, w), lambda w=w: p.window_order(epoch, w), self.keep_windows)
                pieces.append(perm[max(lo - w * p.window, 0) : hi - w * p.window])
            offsets = np.sort(pieces[0] if first == last else np.concatenate(pieces))  # block order, as pretrain.data
        else:
            offsets = np.arange(lo, hi)
        perm, ends, starts = self._order(epoch)
        j = ends.searchsorted(offsets, side="right")
        return perm[j], offsets - starts[j]

    def take(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, rows) of positions ``[a, b)``, in the epoch's block order."""
        n = self.plan.layout.sequences
        pieces = []
        while a < b:
            epoch, lo = divmod(a, n)
            hi = min(n, lo + b - a)
            pieces.append(self._epoch_piece(epoch, lo, hi))
            a += hi - lo
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        # A step across the source's epoch boundary: the two pieces merged into block id order.
        blocks, rows = np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])
        order = np.lexsort((rows, blocks))
        return blocks[order], rows[order]


@dataclass(frozen=True)
class _MixPlan:
    """Which sequences of which source each global step holds; no rank, world or micro-batch in it."""

    plans: tuple[_Plan, ...]
    shares: np.ndarray
    global_batch: int

    def counts(self, step: int) -> list[int]:
        return apportion(self.shares, step * self.global_batch)

    def cursors(self) -> list[_SourceCursor]:
        return [_SourceCursor(p, self.global_batch // max(p.window, 1) + 2) for p in self.plans]

    def step(self, cursors: list[_SourceCursor], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(blocks, rows) of each source's part of step ``k`` (the step is the parts one after another)."""
        c0, c1 = self.counts(k), self.counts(k + 1)
        return [cur.take(a, b) for cur, a, b in zip(cursors, c0, c1)]


def _sample_id_firsts(plan: _MixPlan) -> list[np.ndarray]:
    """Per source, the mixture's sample id of each block's first row: ids follow the sources before."""
    offsets = np.cumsum([0] + [p.layout.sequences for p in plan.plans])
    return [int(off) + p.layout.block_first for off, p in zip(offsets, plan.plans)]


class _MixCursor:
    """The sources' cursors, and the step that consecutive micro-batches share."""

    def __init__(self, dataset: "_MixtureDataset"):
        self.dataset, self.cursors = dataset, dataset.plan.cursors()
        self._step: tuple[int, tuple] | None = None

    def step(self, k: int) -> tuple:
        if self._step is None or self._step[0] != k:
            self._step = (k, self.dataset._step(self.cursors, self.dataset.firsts, k))
        return self._step[1]


class _MixtureDataset(_WorkerLoop):
    """One rank's micro-batches of a mixture (see ``pretrain.data.stream._WorkerLoop``)."""

    def __init__(self, plan: _MixPlan, rank: int, world: int, micro_batch: int, grad_accum: int, start: int):
        self.plan, self.rank, self.world, self.micro_batch = plan, rank, world, micro_batch
        self.grad_accum, self.start = grad_accum, start
        self.firsts = _sample_id_firsts(plan)
        self.remote = any(p.layout.store.local_dir is None for p in plan.plans)

    def readers(self) -> list[BlockReader]:
        g = self.plan.global_batch
        return [BlockReader(p.layout, 2 * max(p.window, g) + 2 * p.layout.block_size) for p in self.plan.plans]

    def planner(self) -> _MixCursor:
        return _MixCursor(self)

    def prefetch(self, readers: list[BlockReader], planner: _MixCursor, k: int, i: int) -> None:
        for s, blocks, _ in self._pieces(planner.step(k), i):
            readers[s].prefetch(np.unique(blocks))

    def batch_at(self, readers: list[BlockReader], planner: _MixCursor, k: int, i: int) -> dict:
        return self._batch(readers, planner.step(k), i)

    def _span(self, step, i: int) -> tuple[int, int]:
        """Micro-batch ``i`` of this rank: positions ``[lo, hi)`` of the step."""
        lo = self.rank * (step[3][-1] // self.world) + i * self.micro_batch
        return lo, lo + self.micro_batch

    def _pieces(self, step, i: int):
        """(source, blocks, rows) of micro-batch ``i``: a step holds the sources one after another, so
        a micro-batch is one or a few contiguous runs."""
        _, parts, _, edges = step
        lo, hi = self._span(step, i)
        for s, (blocks, rows) in enumerate(parts):
            a, b = max(lo, edges[s]) - edges[s], min(hi, edges[s + 1]) - edges[s]
            if a < b:
                yield s, blocks[a:b], rows[a:b]

    def _batch(self, readers, step, i: int) -> dict:
        source, _, sample_ids, _ = step
        lo, hi = self._span(step, i)
        pieces, padded = [], False
        for s, blocks, rows in self._pieces(step, i):
            ids, starts, pad = readers[s].gather(blocks, rows)
            pieces.append((ids, starts))
            padded = padded or pad
        if len(pieces) == 1:
            ids, starts = pieces[0]
        else:
            ids, starts = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        return {
            "input_ids": ids,
            "word_starts": starts,
            "sample_ids": torch.from_numpy(sample_ids[lo:hi]),
            "has_padding": padded,
            "source": torch.from_numpy(source[lo:hi]),
        }

    def _step(self, cursors, firsts: list[np.ndarray], k: int) -> tuple:
        """Step ``k`` with what every micro-batch of it needs: each source's part, the sample ids and
        where each part starts in the step (``firsts[s]``: sample id of each block's first row)."""
        parts = self.plan.step(cursors, k)
        lengths = [len(b) for b, _ in parts]
        source = np.repeat(np.arange(len(parts)), lengths)
        sample_ids = np.concatenate([first[b] + r for first, (b, r) in zip(firsts, parts)])
        return source, parts, sample_ids, [0, *itertools.accumulate(lengths)]


# ------------------------------------------------------------------------------------ the stream


class MixtureStream(Stream):
    """One rank's infinite, deterministic stream of micro-batches from several sources; the same
    interface and resume rules as ``pretrain.data.stream.TrainStream`` (``samples_consumed`` is the position)."""

    def __init__(
        self,
        sources: list[Source],
        manifests: list[Manifest],
        split: str,
        rank: int,
        world: int,
        micro_batch: int,
        global_batch: int,
        seed: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        *,
        shuffle_window_blocks: int = 8,
    ):
        if global_batch % (micro_batch * world) or not 0 <= rank < world:
            raise DataError(
                f"MixtureStream: global_batch {global_batch} is not a multiple of micro_batch "
                f"{micro_batch} x world {world}, or rank {rank} is outside it"
            )
        plans = []
        for i, (src, manifest) in enumerate(zip(sources, manifests)):
            _, layout = _open_split(src.dir, manifest, split)
            # Seeded per source by its place in the list: two sources never share an order. The
            # shuffle window shrinks with the share, so that a step's sequences of a source span as
            # few of its blocks as one source's do (twice the block lookups per micro-batch otherwise).
            blocks = max(1, round(shuffle_window_blocks * src.share)) if shuffle_window_blocks else 0
            plans.append(_Plan(layout, 1, derive_seed("mixture-source", seed, i), blocks * layout.block_size))
        self.sources = sources
        self._plan = _MixPlan(tuple(plans), np.asarray([s.share for s in sources]), global_batch)
        self.split, self.rank, self.world, self.micro_batch, self.seed = split, rank, world, micro_batch, seed
        self.global_batch, self.shuffle_window_blocks = global_batch, shuffle_window_blocks
        self.grad_accum = global_batch // (micro_batch * world)
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.samples_consumed = 0

    @property
    def seq_len(self) -> int:
        return self._plan.plans[0].layout.seq_len

    def source_sequences(self) -> list[int]:
        return [p.layout.sequences for p in self._plan.plans]

    def consumed(self, step: int) -> list[int]:
        """Sequences of each source taken by the first ``step`` steps."""
        return self._plan.counts(step)

    def epochs(self, step: int) -> list[float]:
        """Epochs of each source completed by step ``step`` (fractional)."""
        return [float(c) / n for c, n in zip(self.consumed(step), self.source_sequences())]

    def step_sample_ids(self, k: int) -> np.ndarray:
        """Sample ids of all ``G`` sequences of global step ``k`` (all ranks), in the order ranks cut them."""
        whole = _MixtureDataset(self._plan, 0, 1, self.global_batch, 1, 0)
        return whole._step(self._plan.cursors(), _sample_id_firsts(self._plan), k)[2]

    def describe(self) -> str:
        return "; ".join(
            f"{s.name}: {n} sequences, share {s.share:.3f}" for s, n in zip(self.sources, self.source_sequences())
        ) + (
            f"; {self.global_batch} sequences a step ({self.world} ranks x micro-batch {self.micro_batch} x "
            f"accumulation {self.grad_accum})"
        )

    # -- resume
    def _fingerprints(self) -> dict[str, list]:
        return {
            s.name: [
                round(s.share, 12),
                p.layout.sequences,
                hashlib.sha256(json.dumps(p.layout.shards_signature).encode()).hexdigest()[:16],
            ]
            for s, p in zip(self.sources, self._plan.plans)
        }

    def state_dict(self) -> dict:
        return {
            "samples_consumed": self.samples_consumed,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "split": self.split,
            "shuffle_window_blocks": self.shuffle_window_blocks,
            "sources": self._fingerprints(),
            "world": self.world,
            "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["samples_consumed"]``; another source, weight or data is refused by name."""
        changed = [
            f"{k}: {state.get(k)!r} in the checkpoint, {getattr(self, k)!r} now"
            for k in ("global_batch", "seed", "split", "shuffle_window_blocks")
            if state.get(k) != getattr(self, k)
        ]
        saved, mine = state.get("sources"), self._fingerprints()
        if not isinstance(saved, dict):
            changed.append("the checkpoint was trained on one source (data.dir), this run is a mixture")
        else:
            changed += [f"source {n!r}: only in the checkpoint" for n in saved if n not in mine]
            changed += [f"source {n!r}: not in the checkpoint" for n in mine if n not in saved]
            for n in sorted(set(saved) & set(mine)):
                what = [
                    label for label, a, b in zip(("weight share", "sequences", "shards"), saved[n], mine[n]) if a != b
                ]
                if what:
                    changed.append(f"source {n!r}: {', '.join(what)} changed ({saved[n]} -> {mine[n]})")
        if changed:
            raise DataError(
                "the mixture's checkpointed position does not apply to this run ("
                + "; ".join(changed)
                + "): the same sequences in the same order need the same sources, weights, "
                "global batch and data seed"
            )
        self.samples_consumed = checked_position(state, self.global_batch)

    def metrics(self, step: int, max_steps: int) -> dict:
        """Per-source tokens consumed (sequence slots x length, as train/tokens_seen), epochs so far and
        epochs the run reaches by ``max_steps``."""
        out = {}
        for src, count, n, final in zip(
            self.sources, self.consumed(step), self.source_sequences(), self.consumed(max_steps)
        ):
            out[names.data_source(src.name, "tokens")] = int(count) * self.seq_len
            out[names.data_source(src.name, "epochs")] = float(count) / n
            out[names.data_source(src.name, "epochs_at_max_steps")] = float(final) / n
        return out

    def plan_lines(self, max_steps: int) -> list[str]:
        final = self.consumed(max_steps)
        return [
            (
                f"{s.name}: {n} sequences, share of the steps {s.share:.3f} ({int(c)} sequences by step "
                f"{max_steps}), epochs at step {max_steps}: {c / n:.3f}"
            )
            for s, n, c in zip(self.sources, self.source_sequences(), final)
        ]

    def dataset(self, start: int) -> _MixtureDataset:
        return _MixtureDataset(self._plan, self.rank, self.world, self.micro_batch, self.grad_accum, start)


# ------------------------------------------------------------------------------------ the trainer's view


def source_manifests(cfg, first: Manifest | None = None) -> list[Manifest]:
    return [
        first if (first is not None and i == 0) else load_manifest(s.dir)
        for i, s in enumerate(resolve_sources(cfg.data))
    ]
