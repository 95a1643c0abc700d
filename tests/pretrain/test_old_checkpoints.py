"""A checkpoint written before a change to the data stream resumes after it with the same losses.

Issue 53 put one source and a mixture on one worker loop (``pretrain.data.stream._WorkerLoop``) and
moved ``make_train_stream``. The code from before that change is taken from git (``git archive`` of
``BEFORE_ONE_STREAM``) and run for real, with the same venv: it trains 4 steps and checkpoints; this
checkout resumes its checkpoint to step 8; both must log exactly the losses that the old code logs
for steps 5 to 8 uninterrupted. One source and a two-source mixture.

Time: about 40 s per case (six 1-rank tiny runs, two of them with a fresh interpreter's imports).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, train, trainer_env
from test_mixture import sources_override

pytestmark = pytest.mark.slow
BEFORE_ONE_STREAM = "c3c09161d8a6774401098f53ac7b9ab9b9952a00"


def losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def old_train(old_tree, data_args: list[str], out_dir, steps: int):
    args = [
        "--config",
        "configs/tiny.yaml",
        *data_args,
        f"train.out_dir={out_dir}",
        "tracking.report=false",
        "tracking.backend=none",
        "train.log_every=1",
        f"train.max_steps={steps}",
        "train.eval_every=0",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pretrain.train", *args],
        cwd=old_tree,
        capture_output=True,
        text=True,
        timeout=600,
        env=trainer_env(PYTHONPATH=str(old_tree)),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    tree = tmp_path_factory.mktemp("before_one_stream")
    archive = subprocess.run(["git", "archive", BEFORE_ONE_STREAM], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


@pytest.mark.parametrize("kind", ["one source", "mixture"])
def test_a_checkpoint_from_before_the_one_stream_resumes_to_the_same_losses(
    old_tree, shards, two_sources, tmp_path, kind
):
    data_dir = shards if kind == "one source" else ""
    extra = [] if kind == "one source" else [sources_override(two_sources)]
    old_train(old_tree, [f"data.dir={data_dir}", *extra], tmp_path / "whole", 8)
    old_train(old_tree, [f"data.dir={data_dir}", *extra], tmp_path / "resumed", 4)
    train(
        data_dir,
        tmp_path / "resumed",
        *extra,
        "tracking.backend=none",
        "train.log_every=1",
        "train.max_steps=8",
        "train.eval_every=0",
        "train.resume=auto",
        check=True,
    )
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(whole) == list(range(1, 9)) and sorted(resumed) == list(range(1, 9))
    assert [resumed[s] for s in range(5, 9)] == [whole[s] for s in range(5, 9)], (whole, resumed)
