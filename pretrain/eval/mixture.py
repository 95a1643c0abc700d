"""Held-out MLM loss and accuracy of a mixture: per source (``eval/<name>/loss``, ``eval/<name>/accuracy``)
and over all sources' validation sequences together (``eval/loss``, ``eval/accuracy``).

``masked_sums`` scores any iterable of evaluation batches, so what a source's validation set is (today
``train.eval_batches`` micro-batches per rank of its eval split) is decided in one place,
``source_batches``. Every rank scores the same number of batches of every source (``eval_batches``
guarantees it), so a ZeRO-3 forward's collectives line up.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from data_prep.shard_format import load_manifest
from pretrain.runtime import engine as eng
from pretrain.data.stream import eval_batches
from pretrain.model.masking import SpecialIds, eval_masking_config, mask_batch
from pretrain.data.mixture import Source, resolve_sources


def masked_sums(engine, batches: Iterable[dict], special: SpecialIds, masking, device) -> torch.Tensor:
    """float64 [loss_sum, correct, predicted] of this rank's batches at the fixed evaluation masking."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in batches:
        ids = batch["input_ids"].to(device)
        m = mask_batch(ids, batch["word_starts"].to(device), special, masking,
                       sample_ids=batch["sample_ids"].to(device), step=0)
        with eng.eager_forward(engine, eager=True):
            loss_sum, correct, count = engine(m.input_ids, ids != special.pad, m.positions, m.labels)
        sums += torch.stack([loss_sum.double(), correct.double(), count.double()])
    return sums


def source_batches(cfg, source: Source, manifest: dict, info) -> Iterable[dict]:
    """This rank's share of ``source``'s validation sequences."""
    return eval_batches(source.dir, manifest, cfg.data.eval_split, info.rank, info.world,
                        cfg.impl.micro_batch_size, cfg.train.eval_batches)


@torch.no_grad()
def evaluate_mixture(engine, cfg, special: SpecialIds, info) -> dict:
    """Per-source and overall held-out figures; sources without an eval split are left out."""
    masking = eval_masking_config(cfg.masking)
    scored, rows = [], []
    engine.eval()
    for source in resolve_sources(cfg.data):
        manifest = load_manifest(source.dir)
        if not any(s.get("split") == cfg.data.eval_split for s in manifest["shards"]):
            continue
        scored.append(source.name)
        rows.append(masked_sums(engine, source_batches(cfg, source, manifest, info), special, masking, info.device))
    engine.train()
    if not scored:
        return {}
    sums = torch.stack(rows)
    dist.all_reduce(sums)
    out = {}
    total = sums.sum(0).tolist()
    if total[2]:
        out = {"eval/loss": total[0] / total[2], "eval/accuracy": total[1] / total[2]}
    for name, (loss_sum, correct, count) in zip(scored, sums.tolist()):
        if count:
            out[f"eval/{name}/loss"], out[f"eval/{name}/accuracy"] = loss_sum / count, correct / count
    return out
