"""The trainer's data over data_prep's shards: ``make_train_stream`` gives the run's ``Stream``, the
global sample order of one source (``stream.TrainStream``) or of a mixture (``mixture.MixtureStream``),
both read by tar random access (``shard_reader``) through one worker loop (``stream._WorkerLoop``)."""

from __future__ import annotations

from data_prep.common.manifest import Manifest
from pretrain.data.mixture import MixtureStream, is_mixture, resolve_sources, source_manifests
from pretrain.data.stream import Stream, TrainStream


def make_train_stream(
    cfg, manifest: Manifest, rank: int, world: int, num_workers: int = 0, prefetch_factor: int = 2
) -> Stream:
    """The run's training stream: ``TrainStream`` for ``data.dir``, ``MixtureStream`` for ``data.sources``."""
    micro = cfg.impl.micro_batch_size
    if micro == "auto":  # not timed yet (the checks before start): the order does not depend on how a step is cut
        micro = cfg.train.global_batch_size // world if cfg.train.global_batch_size % world == 0 else 1
    args = (cfg.data.train_split, rank, world, micro, cfg.train.global_batch_size, cfg.data.seed)
    if not is_mixture(cfg):
        return TrainStream(cfg.data.dir, manifest, *args, num_workers, prefetch_factor)
    return MixtureStream(
        resolve_sources(cfg.data), source_manifests(cfg, manifest), *args, num_workers, prefetch_factor
    )
