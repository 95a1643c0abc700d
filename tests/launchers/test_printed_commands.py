"""Commands the project prints for a user to copy work when copied: from another directory than the
one that printed them, for a run or data folder given as a relative and as an absolute path.

The demo's own last line (``launchers/demo.sh``, an absolute ``RUN``) is checked the same way by
``tests/launchers/test_demo.py``; the trainer logs the same ``ui_command`` line."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import urllib.request

import pytest

from mlflow_server import MlflowServer

pytestmark = pytest.mark.slow


def backticked(message: str) -> str:
    found = re.search(r"`([^`]+)`", message)
    assert found, message
    return found.group(1)


def served_run(command: str, run_id: str, root, cwd) -> dict:
    """Run a printed ``mlflow ui ...`` command from ``cwd`` on a free loopback port and fetch the run."""
    with MlflowServer(root, command=shlex.split(command), cwd=cwd) as server:
        with urllib.request.urlopen(f"{server.uri}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as resp:
            return json.loads(resp.read())["run"]


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_the_mlflow_ui_command_for_a_local_store_shows_the_run(tmp_path, monkeypatch, absolute):
    from mlflow.tracking import MlflowClient

    from pretrain.tracking.mlflow_requests import default_local_store
    from pretrain.tracking.mlflow_ui import ui_command

    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "runs" / "x" if absolute else "runs/x"
    uri, artifacts = default_local_store(out_dir)
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("printed", artifact_location=artifacts))
    client.log_metric(run.info.run_id, "train/loss", 7.5, step=3)
    client.set_terminated(run.info.run_id)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = served_run(ui_command(uri), run.info.run_id, tmp_path / "ui", elsewhere)
    assert shown["data"]["metrics"] == [
        {"key": "train/loss", "value": 7.5, "timestamp": shown["data"]["metrics"][0]["timestamp"], "step": 3}
    ]


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_the_finalize_command_printed_for_a_folder_without_manifest_finalizes_it(
    shards, tmp_path, monkeypatch, absolute
):
    from data_prep.common.errors import ShardError
    from data_prep.common.manifest import MANIFEST, load_manifest
    from pretrain.config.schema import _data_dir_problems

    monkeypatch.chdir(tmp_path)
    shutil.copytree(shards, tmp_path / "data" / "shards")
    (tmp_path / "data" / "shards" / MANIFEST).unlink()
    folder = str(tmp_path / "data" / "shards") if absolute else "data/shards"

    with pytest.raises(ShardError) as raised:
        load_manifest(folder)
    command = backticked(str(raised.value))
    (problem,) = _data_dir_problems(folder)
    assert backticked(problem) == command

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(command, shell=True, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "data" / "shards" / MANIFEST).read_bytes() == (shards / MANIFEST).read_bytes()
