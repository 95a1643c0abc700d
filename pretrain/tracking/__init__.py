"""Experiment tracking, on rank 0 only: the interface and a no-op (``base``), the ``metrics.jsonl``
writer (``jsonl``), and MLflow (``mlflow_tracker``, with the requests it may send in
``mlflow_requests``; imported only when used)."""

from __future__ import annotations

import sys
from pathlib import Path

from data_prep.common.manifest import Manifest, load_manifest
from pretrain.config import loader as configlib
from pretrain.tracking.base import NullTracker, Tracker, TrackerGroup
from pretrain.tracking.jsonl import JsonlTracker

__all__ = ["Tracker", "NullTracker", "TrackerGroup", "JsonlTracker", "make_tracker", "run_params"]


def make_tracker(cfg, rank: int, resume_step: int = 0, jsonl: bool = True) -> Tracker:
    """``cfg`` is the full :class:`pretrain.config.schema.Config`. Rank 0 writes ``metrics.jsonl`` in
    ``train.out_dir`` and, with ``tracking.backend: mlflow``, an MLflow run; other ranks nothing."""
    if rank != 0:
        return NullTracker()
    trackers: list[Tracker] = [JsonlTracker(Path(cfg.train.out_dir), resume_step)] if jsonl else []
    if cfg.tracking.backend == "mlflow":
        # lazy: pulls in mlflow (~1.5 s), which a run with another backend never needs
        from pretrain.tracking.mlflow_tracker import MlflowTracker

        trackers.append(MlflowTracker(cfg, resume_step=resume_step))
    return TrackerGroup(trackers) if len(trackers) != 1 else trackers[0]


def run_params(cfg, world: int, precision: str, manifest: Manifest) -> dict:
    """Flat parameters for the tracker: the resolved config plus what the run derived from it."""
    import torch  # lazy: the study runner imports this package (mlflow_parent) and starts without torch

    train_totals = manifest.totals.get("train", {})
    params = configlib.flatten(configlib.redact(configlib.to_dict(cfg)))
    params.update(
        {
            "derived.world_size": world,
            "derived.grad_accum_steps": cfg.grad_accum_steps(world),
            "derived.precision": precision,
            "data.seq_len": manifest.seq_len,
            "data.vocab_size": manifest.tokenizer.vocab_size,
            "data.tokenizer_sha256": manifest.tokenizer.sha256,
            "data.train_tokens": train_totals.get("tokens"),
            "data.train_sequences": train_totals.get("sequences"),
            "data.train_shards": train_totals.get("shards"),
            "launch.command": configlib.redact(" ".join(sys.argv)),
            "launch.torch": torch.__version__,
        }
    )
    params.update(source_params(cfg))
    params.update(cleaning_params(manifest))
    return params


def cleaning_params(manifest: Manifest) -> dict:
    """What ``data_prep clean`` did to the data, as ``data/clean/<name>`` (``data/clean/<i>/<name>``
    when the shards came from several cleaned folders); nothing for data that was not cleaned."""
    folders = manifest.settings.get("cleaning") or []
    out = {}
    for i, summary in enumerate(folders):
        prefix = "data/clean/" if len(folders) == 1 else f"data/clean/{i}/"
        out.update({prefix + key: value for key, value in summary.items()})
    return out


def source_params(cfg) -> dict:
    """A mixture's data, per source (``data.sources.<name>.train_tokens``, ...), and its totals; nothing
    for one folder (the manifest's figures above are all of it)."""
    # lazy: the data package imports torch, which the study runner (importing this package) starts without
    from pretrain.data.mixture import is_mixture, resolve_sources

    if not is_mixture(cfg):
        return {}
    out, totals = {}, {"tokens": 0, "sequences": 0, "shards": 0}
    for source in resolve_sources(cfg.data):
        manifest = load_manifest(source.dir)
        train = manifest.totals.get("train", {})
        out.update(
            {
                f"data.sources.{source.name}.tokenizer_sha256": manifest.tokenizer.sha256,
                f"data.sources.{source.name}.train_sequences": train.get("sequences"),
                f"data.sources.{source.name}.train_tokens": train.get("tokens"),
                f"data.sources.{source.name}.share": round(source.share, 6),
            }
        )
        totals = {k: v + (train.get(k) or 0) for k, v in totals.items()}
    return out | {f"data.train_{k}": v for k, v in totals.items()}
