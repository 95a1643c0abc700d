"""The held-out MLM evaluation during training: a fixed set of sequences per source, the same at any layout.

``train.eval_sequences`` counts sequences, not batches: the first N of the evaluation split in file
order (all of them when 0, or when the split holds fewer). Rank ``r`` of ``world`` takes the ``r``-th
contiguous part of them; the parts differ by at most one sequence. Every rank runs the same number of
forward passes (ZeRO-3 gathers weights collectively), so a rank whose part is used up runs filler
batches whose results are thrown away.

The result depends on nothing but the weights and N: each masked token's loss (fp32, the same for a
row whatever batch it sits in) is rounded to a fixed-point int64 (2**-24 units), and counts, correct
predictions and those loss units are summed as integers and all-reduced. Integer sums do not depend
on their order, so ``eval/loss`` is bit-identical at any world size and micro-batch (a float sum
would change in its last bits with the grouping). ``train.eval_batches`` (micro-batches per rank,
deprecated) is converted once to a sequence count with the layout the config states
(``config.schema.convert_eval_batches``).

A mixture is scored per source (``eval/<name>/loss``, ``eval/<name>/accuracy``: the first N of each
source's evaluation split) and over all those sequences together (``eval/loss``, ``eval/accuracy``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from data_prep.common.errors import ShardError
from data_prep.common.manifest import Manifest, load_manifest
from data_prep.common.storage import StoreUnavailable
from pretrain import metric_names as names
from pretrain.data.mixture import resolve_sources
from pretrain.data.shard_reader import BlockReader
from pretrain.data.stream import _open_split
from pretrain.guards import bad_input
from pretrain.guards.bad_input import BAD_INPUT_KEY, OUTAGE_KEY
from pretrain.model.masking import SpecialIds, eval_masking_config, mask_batch
from pretrain.runtime import engine as eng

LOSS_UNIT = 2.0**-24  # fixed-point resolution of a token's loss: far below what a log shows


def rank_part(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s contiguous part of ``total`` sequences."""
    return total * rank // world, total * (rank + 1) // world


def eval_set_batches(
    data_dir: str | os.PathLike,
    manifest: Manifest | None,
    split: str,
    rank: int,
    world: int,
    micro_batch: int,
    sequences: int,
    keep_in_step: bool = False,
) -> Iterator[dict]:
    """This rank's batches of the evaluation set; the same count on every rank. A batch with
    ``"filler": True`` only keeps the rank in step with the others: its results must be dropped.
    A block that cannot be read raises ``ShardError``; with ``keep_in_step`` it becomes a filler
    carrying the message (``BAD_INPUT_KEY``), so that the others hear of it after their collectives."""
    _, layout = _open_split(data_dir, manifest, split)
    total = min(sequences, layout.sequences) if sequences > 0 else layout.sequences
    start, end = rank_part(total, rank, world)
    count = math.ceil(math.ceil(total / world) / micro_batch)
    ends = np.cumsum(layout.block_len)
    reader = BlockReader(layout, cache_sequences=2 * layout.block_size + micro_batch)
    try:
        for b in range(count):
            pos = np.arange(start + b * micro_batch, min(start + (b + 1) * micro_batch, end))
            filler = pos.size == 0
            if filler:
                pos = np.zeros(1, dtype=np.int64)  # any real sequence will do
            j = np.searchsorted(ends, pos, side="right")
            try:
                input_ids, word_starts, _ = reader.gather(j, pos - (ends[j] - layout.block_len[j]))
            except (ShardError, StoreUnavailable) as exc:
                if not keep_in_step:
                    raise
                yield {
                    "input_ids": torch.ones(1, layout.seq_len, dtype=torch.long),
                    "word_starts": torch.zeros(1, layout.seq_len, dtype=torch.bool),
                    "sample_ids": torch.zeros(1, dtype=torch.long),
                    "filler": True,
                    BAD_INPUT_KEY: str(exc),
                    OUTAGE_KEY: isinstance(exc, StoreUnavailable),
                }
                continue
            yield {
                "input_ids": input_ids,
                "word_starts": word_starts,
                "sample_ids": torch.from_numpy(pos),
                "filler": filler,
            }
    finally:
        reader.close()


def token_sums(model_out, device) -> torch.Tensor:
    """[loss units, correct, counted] of one batch as int64, from the model's per-token outputs."""
    token_loss, correct, counted = model_out
    # Non-finite losses are reported apart (eval/loss nan); the clamp keeps sums far from int64's limit.
    finite = torch.nan_to_num(token_loss[counted].double(), nan=0.0, posinf=0.0, neginf=0.0).clamp(-1e6, 1e6)
    units = torch.round(finite / LOSS_UNIT).to(torch.int64)
    return torch.stack([units.sum(), correct.sum(), counted.sum()]).to(device, torch.int64)


def score(engine, batches: Iterator[dict], special: SpecialIds, masking, device) -> tuple[torch.Tensor, str | None]:
    """int64 [loss units, correct, counted, batches with a non-finite loss, batches unreadable, of those
    because the store was down] of this rank's batches, and the first read error's message."""
    sums, unreadable = torch.zeros(6, dtype=torch.int64, device=device), None
    for batch in batches:
        if BAD_INPUT_KEY in batch:
            sums[4] += 1
            sums[5] += int(bool(batch.get(OUTAGE_KEY)))
            unreadable = unreadable or batch[BAD_INPUT_KEY]
        ids = batch["input_ids"].to(device)
        # Masks keyed by sample id: a sequence gets the same mask in any batch.
        m = mask_batch(
            ids, batch["word_starts"].to(device), special, masking, sample_ids=batch["sample_ids"].to(device), step=0
        )
        with eng.eager_forward(engine, eager=True):
            out = engine(m.input_ids, ids != special.pad, m.positions, m.labels, per_token=True)
        if not batch["filler"]:
            sums[:3] += token_sums(out, device)
            sums[3] += int((~torch.isfinite(out[0][out[2]])).any())
    return sums, unreadable


def figures(prefix: str, sums: list[int]) -> dict:
    units, correct, count, nonfinite = sums
    if not count:
        return {}
    loss, accuracy = names.heldout(prefix)
    return {loss: float("nan") if nonfinite else units * LOSS_UNIT / count, accuracy: correct / count}


@torch.no_grad()
def evaluate(engine, cfg, special: SpecialIds, info) -> dict:
    """Validation loss and accuracy at 15% token masking with a fixed seed, whatever training uses,
    on ``train.eval_sequences`` held-out sequences of each source (see the module docstring).
    Sources without an evaluation split are left out."""
    masking = eval_masking_config(cfg.masking)
    source_names, rows, unreadable = [], [], None
    engine.eval()
    for source in resolve_sources(cfg.data):
        manifest = load_manifest(source.dir)
        if not manifest.has_split(cfg.data.eval_split):
            continue
        batches = eval_set_batches(
            source.dir,
            manifest,
            cfg.data.eval_split,
            info.rank,
            info.world,
            cfg.impl.micro_batch_size,
            cfg.train.eval_sequences,
            keep_in_step=True,
        )
        source_names.append(source.name)
        row, error = score(engine, batches, special, masking, info.device)
        rows.append(row)
        unreadable = unreadable or error
    engine.train()
    if not rows:
        return {}
    sums = torch.stack(rows)
    dist.all_reduce(sums)  # integers: the same result in any order
    if sums[:, 4].sum() > 0:
        outage = bool(sums[:, 5].sum() > 0)
        bad_input.report_messages(unreadable, info.rank, outage)
        raise bad_input.BadInputStop(outage)
    sums = sums[:, :4]
    out = figures(names.EVAL, sums.sum(0).tolist())
    if len(source_names) > 1:
        for name, row in zip(source_names, sums.tolist()):
            out.update(figures(names.eval_source(name), row))
    return out
