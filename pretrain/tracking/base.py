"""The tracker interface, the no-op, and a fan-out to several trackers."""

from __future__ import annotations

from typing import Any, Optional


class Tracker:
    """What the trainer needs from a tracking backend. Every method must return quickly and never
    raise because a server is unreachable: implementations buffer and retry."""

    run_id: Optional[str] = None
    run_url: str | None = None  # where a person watches the run (MLflow's classic run page)

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

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        """A folder of files (e.g. the run report) to store under ``artifact_path``; may upload later."""

    def log_event(self, name: str, text: str, step: int) -> None:
        """Something a person should find on the run: a spike recovery, a hang (a tag ``event/<name>``)."""

    def finish(self, status: str = "FINISHED") -> None:
        """Flush everything buffered and close the run (status: FINISHED, FAILED or KILLED)."""


class NullTracker(Tracker):
    """For ranks other than 0, tests, and ``tracking.backend: none``."""


class TrackerGroup(Tracker):
    """Every call goes to each tracker in order; the run id is the first one any of them has."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    @property
    def run_id(self) -> Optional[str]:
        return next((t.run_id for t in self.trackers if t.run_id), None)

    @property
    def run_url(self) -> str | None:
        return next((t.run_url for t in self.trackers if t.run_url), None)

    def start(self, run_id, params, artifacts):
        ids = [t.start(run_id, params, artifacts) for t in self.trackers]
        return next((i for i in ids if i), None)

    def log_metrics(self, metrics, step):
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_checkpoint(self, tag, step, path):
        for t in self.trackers:
            t.log_checkpoint(tag, step, path)

    def log_model(self, hf_dir, step, final):
        for t in self.trackers:
            t.log_model(hf_dir, step, final)

    def log_artifacts(self, local_dir, artifact_path):
        for t in self.trackers:
            t.log_artifacts(local_dir, artifact_path)

    def log_event(self, name, text, step):
        for t in self.trackers:
            t.log_event(name, text, step)

    def finish(self, status="FINISHED"):
        for t in self.trackers:
            t.finish(status)
