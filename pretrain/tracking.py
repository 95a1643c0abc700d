"""Experiment tracking: a small interface, a no-op implementation, and a factory.

Only rank 0 ever holds a real tracker; every other rank gets :class:`NullTracker`. The MLflow
implementation lives in ``pretrain.tracking_mlflow`` so that importing this module stays cheap.
"""
from __future__ import annotations

from typing import Any, Optional


class Tracker:
    """What the trainer needs from a tracking backend. Every method must return quickly and never
    raise because a server is unreachable: implementations buffer and retry."""

    run_id: Optional[str] = None

    def start(self, run_id: Optional[str], params: dict[str, Any], artifacts: dict[str, str]) -> Optional[str]:
        """Open (run_id given: continue) the job's run; log ``params`` (flat) and text ``artifacts``
        (name -> content, e.g. ``config.yaml``) when the run is new. Returns the run id."""
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Metrics at a global step. A step already logged (after a resume) must not be duplicated."""

    def log_checkpoint(self, tag: str, step: int, path: str) -> None:
        """A complete checkpoint was saved."""

    def log_model(self, hf_dir: str, step: int, final: bool) -> None:
        """A Hugging Face export folder to store as an artifact (and register when configured)."""

    def finish(self, status: str = "FINISHED") -> None:
        """Flush everything buffered and close the run (status: FINISHED, FAILED or KILLED)."""


class NullTracker(Tracker):
    """For ranks other than 0, tests, and ``tracking.backend: none``."""


def make_tracker(cfg, rank: int) -> Tracker:
    """``cfg`` is the full :class:`pretrain.config.Config`."""
    if rank != 0 or cfg.tracking.backend == "none":
        return NullTracker()
    from pretrain.tracking_mlflow import MlflowTracker

    return MlflowTracker(cfg)


def share_run_id(run_id: Optional[str]) -> Optional[str]:
    """Rank 0's run id on every rank (e.g. so all ranks write the same id into a checkpoint's
    client state). A collective: every rank must call it. Without a process group it returns
    ``run_id`` unchanged."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return run_id
    box = [run_id]
    dist.broadcast_object_list(box, src=0)
    return box[0]
