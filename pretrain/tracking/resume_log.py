"""What a resumed run logs: the same rows as the uninterrupted run, each metric once per step.

Two things a checkpoint carries for this (``TrainState.log_window`` and ``TrainState.logged``):

* The log window in progress (``pretrain.step.LogWindow``'s ``state_dict``). Its sums (all ranks
  together) are saved with the checkpoint and taken up again on resume, so the first ``train/loss`` logged after a resume averages the same steps as the
  uninterrupted run did (equal up to summation order), not only the steps since the resume.
* The metrics logged at the last step that logged. A kill can cut the last line of ``metrics.jsonl``
  short; when that line was the checkpoint step's own, the resumed run logs those metrics again.
  Trackers keep each metric once per step (``JsonlTracker`` and MLflow drop a point at a step they
  already hold), so re-logging is harmless when nothing was lost, and a relaunch that evaluates the
  final checkpoint again (killed before its export) writes no second ``eval/loss`` row.
"""

from __future__ import annotations


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
