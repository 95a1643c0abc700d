"""A study's parent run in MLflow: the variants' runs are its children, and it holds the comparison
(per-variant metrics, the summary as its description and artifacts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from data_prep.common.atomic import write_atomic
from pretrain.tracking.mlflow_ui import quiet_mlflow_links, run_url

PARENT_ID_FILE = "mlflow_parent_run_id"  # in the study folder
SET_FOR_THIS_PROCESS_ONLY: list[str] = []  # environment variables the variants must not inherit


class ParentRun:
    """A study's MLflow run; its variants log into its store as its children. No id without MLflow.
    ``cfg`` is the first variant's config (the tracking settings they share); the run's id is kept in
    ``study_dir``, so that a re-run of the study continues it."""

    def __init__(self, cfg, study_dir: Path, name: str):
        self.study_dir, self.name, self.client, self.run_id = Path(study_dir), name, None, ""
        base = cfg
        self.enabled = base.tracking.backend == "mlflow"
        self.uri = ""
        if self.enabled:
            # lazy: pulls in mlflow (~1.5 s), which a study with another tracking backend never needs
            from pretrain.tracking.mlflow_requests import default_local_store

            self.uri = base.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
            self.artifact_root = None
            if not self.uri:  # one local store for the whole study, not one per variant
                self.uri, self.artifact_root = default_local_store(str(self.study_dir))
            self.experiment = base.tracking.experiment

    def open(self, plan: dict) -> str:
        """Continue the study's run or create it, with ``plan`` (the study's description) as params."""
        if not self.enabled:
            return ""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        # Fail in seconds, not after MLflow's minutes of HTTP retries, when the server is down. Only
        # this process: the variants' trackers choose their own retry settings.
        for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")):
            if name not in os.environ:
                os.environ[name] = value
                SET_FOR_THIS_PROCESS_ONLY.append(name)
        self.client = MlflowClient(tracking_uri=self.uri)
        quiet_mlflow_links()
        id_file = self.study_dir / PARENT_ID_FILE
        if id_file.is_file():
            try:
                run = self.client.get_run(id_file.read_text().strip())
                if run.info.lifecycle_stage == "active":
                    self.run_id = run.info.run_id
                    if run.info.status != "RUNNING":
                        self.client.update_run(self.run_id, status="RUNNING")
                    return self.run_id
            except MlflowException:
                pass  # deleted, or another store: start a new parent run
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(self.experiment, artifact_location=self.artifact_root)
            except MlflowException:  # created meanwhile by another process
                exp_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        # MLflow 3's UI shows an experiment without this tag in its GenAI layout.
        self.client.set_experiment_tag(exp_id, "mlflow.experimentKind", "custom_model_development")
        run = self.client.create_run(
            exp_id, run_name=f"study-{self.name}", tags={"study.name": self.name, "study.kind": "parent"}
        )
        self.run_id = run.info.run_id
        params = {
            "study.name": plan["name"],
            "study.ranks": plan["ranks"],
            "study.variants": len(plan["variants"]),
            "study.config": plan["config"],
            **{f"study.grid.{k}": json.dumps(v) for k, v in plan["grid"].items()},
            **{f"study.shared.{k}": json.dumps(v) for k, v in plan["shared"].items()},
        }
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k[:250], str(v)[:6000]) for k, v in params.items()])
        self.client.log_text(self.run_id, json.dumps(plan, indent=1, default=str), "study.json")
        id_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(id_file, self.run_id + "\n")
        return self.run_id

    def log_summary(self, files: list[Path], comparison: list[tuple[str, float, int]], note: str) -> None:
        if self.client is None:
            return
        for path in files:
            self.client.log_artifact(self.run_id, str(path), "summary")
        from mlflow.entities import Metric, RunTag

        # A fixed timestamp: a re-run's summary re-sends identical points, which the store drops.
        metrics = [Metric(k, v, 0, step) for k, v, step in comparison]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.client.log_batch(self.run_id, tags=[RunTag("mlflow.note.content", note[:5000])])
        print(f"study: compare the variants at {self.url()}", flush=True)

    def url(self) -> str:
        return run_url(self.uri, self.client.get_run(self.run_id).info.experiment_id, self.run_id)

    def close(self, status: str) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status)
