"""``impl.micro_batch_size: auto`` (issue 84, item 2): the micro-batch of the most tokens a second among
those that divide the global batch here, timed at start on the CPU as it would be on a GPU, said on
one line with the timings, cached; a run with it computes what the same run with that number does.

Time: under a minute on the AMX Xeon, 1.2 minutes on the AVX2-only EPYC under the README's command
(2026-11-29): 10 runs forked from the rank pool, each timing its candidates' forward and backward
passes before its first step."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import REPO, free_port, rank_pool, train
from pretrain.config.schema import ConfigError, load_config
from pretrain.runtime.micro_batch import candidates, engine_state_bytes

CHOSEN = re.compile(r"micro-batch: (\d+) sequences \(auto: \1, the most tokens a second of those timed \((.*)\)\)")
RUN = [
    "train.max_steps=6",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=16",
    "train.checkpoint_every=0",
    "train.global_batch_size=8",
    "model.max_position_embeddings=64",
    "optim.warmup_steps=2",
]


def test_candidates_are_the_powers_of_two_that_divide_a_ranks_share():
    assert candidates(64, 2, "cpu") == [1, 2, 4, 8, 16, 32]
    assert candidates(24, 1, "cpu") == [1, 2, 4, 8]  # 16 does not divide 24
    assert candidates(256, 1, "cpu") == [1, 2, 4, 8, 16, 32]  # the CPU's largest timed
    assert candidates(2048, 2, "cuda")[-1] == 512
    assert candidates(10, 4, "cpu") == []


def test_auto_is_a_setting_and_nonsense_is_refused_with_the_rest(shards):
    cfg = load_config("configs/tiny.yaml", [f"data.dir={shards}", "impl.micro_batch_size=auto"])
    assert cfg.impl.micro_batch_size == "auto" and cfg.grad_accum_steps(1) == 1
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", [f"data.dir={shards}", "impl.micro_batch_size=0", "train.max_steps=-1"])
    assert "micro_batch_size: must be positive or auto" in str(err.value) and "max_steps" in str(err.value)


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_a_run_with_auto_times_chooses_says_and_trains_as_that_number_does(shards, tmp_path):
    auto = train(shards, tmp_path / "auto", *RUN, "impl.micro_batch_size=auto", ranks=2, check=True)
    said = CHOSEN.search(auto.stdout + auto.stderr)
    assert said, (auto.stdout + auto.stderr)[-3000:]
    chosen, timings = int(said.group(1)), said.group(2)
    assert chosen in (1, 2, 4) and "1: " in timings and "measured now in" in timings, said.group(0)
    saved = (tmp_path / "auto" / "checkpoints" / "step00000006" / "config.yaml").read_text()
    assert f"micro_batch_size: {chosen}\n" in saved  # the resolved config holds the number
    again = train(shards, tmp_path / "again", *RUN, "impl.micro_batch_size=auto", ranks=2, check=True)
    assert "cached in" in CHOSEN.search(again.stdout + again.stderr).group(2)
    train(shards, tmp_path / "fixed", *RUN, f"impl.micro_batch_size={chosen}", ranks=2, check=True)
    assert losses(tmp_path / "auto") == losses(tmp_path / "fixed") == losses(tmp_path / "again")


@pytest.mark.slow
def test_the_memory_held_for_the_engine_while_timing_is_what_deepspeed_holds_at_every_stage(tmp_path):
    """On a GPU the timing holds the memory the engine's states will take, so that the micro-batch chosen
    fits beside them (``engine_state_bytes``): at one and two ranks, every ZeRO stage, fp32 and bf16, it
    is at least what DeepSpeed's engine holds after a step's backward beyond the weights and gradients
    (every tensor storage counted, tests/engine_memory_worker.py), and at most 2 bytes a parameter more."""
    layouts = [f"{stage}:{precision}" for precision in ("fp32", "bf16") for stage in range(4)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    rows = []
    for ranks in (1, 2):
        dump, worker = tmp_path / f"held{ranks}.json", "tests.engine_memory_worker"
        args = ["--dump", str(dump), "--out-dir", str(tmp_path / f"run{ranks}"), *layouts]
        proc = rank_pool(preload=(worker,)).run(worker, args, env, ranks, free_port() if ranks > 1 else None, 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows += json.loads(dump.read_text())
    assert len(rows) == 16
    for row in rows:
        params = row["parameters"]
        estimate = engine_state_bytes(params, row["precision"], row["stage"], row["world"])
        # the tiny model's buffers (position ids and the like) are ~0.07 bytes a parameter beside
        assert row["held"] - 0.1 * params <= estimate <= row["held"] + 2 * params, (row, estimate / params)
