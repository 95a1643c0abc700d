"""What a resumed run logs: the same rows as the uninterrupted run, each metric once per step.

Two things a checkpoint carries for this (``TrainState.log_window`` and ``TrainState.logged``):

* The log window in progress. Its sums (all ranks together) are saved with the checkpoint and taken
  up again on resume, so the first ``train/loss`` logged after a resume averages the same steps as the
  uninterrupted run did (equal up to summation order), not only the steps since the resume.
* The metrics logged at the last step that logged. A kill can cut the last line of ``metrics.jsonl``
  short; when that line was the checkpoint step's own, the resumed run logs those metrics again.
  Trackers keep each metric once per step (``JsonlTracker`` and MLflow drop a point at a step they
  already hold), so re-logging is harmless when nothing was lost, and a relaunch that evaluates the
  final checkpoint again (killed before its export) writes no second ``eval/loss`` row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def window_state(window) -> dict:
    """The log window so far, all ranks' sums together (a collective: every rank calls it)."""
    sums = window.sums.clone()
    dist.all_reduce(sums)
    return {"sums": sums.tolist(), "steps": window.steps, "seconds": window.seconds, "data_wait": window.data_wait}


def restore_window(window, saved: dict, rank: int) -> None:
    """Continue the window ``saved`` by :func:`window_state`; the first rank holds the sums (the
    log all-reduces them), so any world size takes it up."""
    if not saved:
        return
    if rank == 0:
        window.sums += torch.tensor(saved["sums"], dtype=window.sums.dtype, device=window.sums.device)
    window.steps, window.seconds, window.data_wait = saved["steps"], saved["seconds"], saved["data_wait"]


def remember(state, metrics: dict, step: int) -> None:
    """Keep what was logged at ``step`` (everything logged at one step, merged) in the train state."""
    if state.logged.get("step") != step:
        state.logged = {"step": step}
    state.logged.update(metrics)


def relog(tracker, state) -> None:
    """On resume: the checkpoint step's metrics again, for the trackers that lost them."""
    if state.logged:
        metrics = {k: v for k, v in state.logged.items() if k != "step"}
        tracker.log_metrics(metrics, state.logged["step"])
