"""``impl.profile_at_step``: torch.profiler over a few steps of a real run (pretrain/runtime/profiling.py).
Each rank writes a Chrome trace and a table of the profiled steps, rank 0 logs where a step's time went,
and a profiled run trains exactly as one without (it changes speed, never numbers)."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import train
from pretrain.config.schema import ConfigError, load_config
from pretrain.runtime import profiling
from pretrain.runtime.profiling import PHASES, StepProfiler

COMMON = [
    "train.max_steps=6",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.global_batch_size=16",
    "impl.micro_batch_size=4",  # two micro-batches a step on each of the two ranks
    "impl.zero_stage=1",
]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_a_profiled_run_writes_a_trace_per_rank_and_trains_as_one_without(shards, tmp_path):
    profiled, plain = tmp_path / "profiled", tmp_path / "plain"
    proc = train(shards, profiled, *COMMON, "impl.profile_at_step=3", "impl.profile_steps=2", ranks=2, check=True)
    train(shards, plain, *COMMON, ranks=2, check=True)
    assert losses(profiled) == losses(plain)  # bit for bit: the profiler only watches

    logged = [line for line in (proc.stdout + proc.stderr).splitlines() if "INFO profile:" in line]
    assert len(logged) == 1 and "steps 3-4 on rank 0" in logged[0], logged  # rank 0 says it, once
    for rank in (0, 1):
        table = (profiled / "profile" / f"step00000003-rank{rank}.txt").read_text()
        line = table.splitlines()[0]
        assert line.startswith("steps 3-4: "), line
        found = re.findall(r"(mask|forward|backward|sync|optimizer) ([\d.]+) \((\d+) ops\)", line)
        shares = {name: ms for name, ms, _ in found}
        assert sorted(shares) == sorted(PHASES), line
        assert all(float(ms) > 0 and int(ops) > 0 for _, ms, ops in found), line
        wall = float(re.search(r"([\d.]+) ms a step", line).group(1))
        assert sum(map(float, shares.values())) < wall, line  # the phases are parts of the step
        assert "aten::" in table  # the op table follows

        trace = json.loads(gzip.decompress((profiled / "profile" / f"step00000003-rank{rank}.json.gz").read_bytes()))
        ranges = Counter(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("train_step/"))
        # two steps of two micro-batches: a forward and a backward per micro-batch, one sync and
        # one optimiser step per step (DeepSpeed's step is called per micro-batch and updates at the last)
        assert ranges["train_step/mask"] == 2, ranges
        assert ranges["train_step/forward"] == ranges["train_step/backward"] == 4, ranges
        assert ranges["train_step/sync"] == 2, ranges
        assert ranges["train_step/optimizer"] == 4, ranges
    assert not list((profiled / "profile").glob(".*")), "a temporary file was left behind"
    assert not (plain / "profile").exists()


def test_a_profile_cut_short_by_the_end_of_the_run_holds_the_steps_it_saw(tmp_path):
    profiler = StepProfiler(2, 5, tmp_path, rank=0, device=torch.device("cpu"))
    x = torch.randn(64, 64, requires_grad=True)
    for done in range(3):  # steps 1, 2 and 3; the profile starts at step 2 and the run ends after 3
        profiler.before_step(done)
        assert profiling._active == (done >= 1)
        with profiling.phase("forward"):
            loss = (x @ x).sum()
        with profiling.phase("backward"):
            loss.backward()
    profiler.stop(3)
    assert not profiling._active
    line = (tmp_path / "profile" / "step00000002-rank0.txt").read_text().splitlines()[0]
    assert line.startswith("steps 2-3: "), line
    assert float(re.search(r"forward ([\d.]+)", line).group(1)) > 0, line
    assert (tmp_path / "profile" / "step00000002-rank0.json.gz").stat().st_size > 0


def test_profile_settings_are_checked_with_the_others():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["impl.profile_at_step=50", "train.max_steps=20", "impl.profile_steps=0"])
    text = str(err.value)
    assert "impl.profile_at_step (50) is after train.max_steps (20)" in text, text
    assert "profile_steps: must be >= 1, got 0" in text, text
