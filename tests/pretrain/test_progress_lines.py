"""A run that has said nothing for ``train.progress_every_s`` says where it is (pretrain.tracking.heartbeat):
the step of the total, a step's time and what is left; the first step of a launch, compiling, its time
the last time on this device at this shape, so that the wait says its time left too.

Time: about 75 s alone, 2.5 min under the README's command: the last test's two launches that compile
(a launch that does not compile has no first step long enough to say anything); the others, 3 s."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from conftest import explain, train
from pretrain.tracking.heartbeat import Heartbeat

KEY = "cpu|a CPU|bert L2 H64|fp32|compiling the model with torch.compile|micro=8x2|seq=64|world=1"


def heartbeat(tmp_path, every_s: float = 3600.0, start_step: int = 0) -> Heartbeat:
    """max_steps 1000, a log line every 100 steps; its first-step times in ``tmp_path``."""
    return Heartbeat(every_s, start_step, 1000, 100, "compiling the model with torch.compile", KEY, tmp_path / "c.json")


def test_the_first_step_says_how_long_it_has_compiled_and_how_long_it_took_the_last_time(tmp_path):
    first = heartbeat(tmp_path)
    first.step_started(1)
    assert first.line(first.since + 75) == (
        "step 1 of 1000, the first of this launch (compiling the model with torch.compile): 1m15s so far "
        "(none at this shape on this device before it, to tell the time left by)"
    )
    first.step_done(1, 112.4)
    first.stop()
    kept = json.loads((tmp_path / "c.json").read_text())[KEY]
    assert kept["seconds"] == 112.4

    resumed = heartbeat(tmp_path, start_step=400)  # a later launch, resumed at step 400
    assert resumed.line(resumed.since + 61).startswith("before step 401 of 1000: getting ready")
    resumed.step_started(401)
    assert resumed.line(resumed.since + 60) == (
        "step 401 of 1000, the first of this launch (compiling the model with torch.compile): 1m00s so far; "
        f"it took 1m52s here on {kept['when']}: about 0m52s left"
    )
    assert resumed.line(resumed.since + 130).endswith(
        f"2m10s so far, longer than the 1m52s it took here on {kept['when']}"
    )
    resumed.stop()


def test_later_steps_say_their_time_the_next_log_line_and_the_end(tmp_path):
    beat = heartbeat(tmp_path)
    beat.step_started(1)
    beat.step_done(1, 90.0)  # the compiling step does not count in a step's time
    beat.step_started(2)
    assert beat.line(beat.since + 70) == "step 2 of 1000: 1m10s into it; the time a step takes is known after this one"
    beat.step_done(2, 2.0)
    assert beat.line(beat.since + 65) == "after step 2 of 1000: logging, evaluating or checkpointing, 1m05s so far"
    beat.doing("checkpointing and exporting")  # timed from when it began
    assert beat.line(beat.since + 61) == "after step 2 of 1000: checkpointing and exporting, 1m01s so far"
    for step in range(3, 38):
        beat.step_started(step)
        beat.step_done(step, 3.0 if step % 2 else 4.0)
    beat.step_started(38)
    # the last 20 steps: 10 of 3 s and 10 of 4 s; 1.5 s into step 38 of 38-100 to the next line, 38-1000 to the end
    assert beat.line(beat.since + 1.5) == (
        "step 38 of 1000: 0m02s into it; 3.5 s a step; the next log line at step 100, in about 3m39s; "
        "the end in about 56m09s"
    )
    late = "step 38 of 1000: 1m00s into it; 3.5 s a step; the next log line at step 100, in about 3m37s;"
    assert beat.line(beat.since + 60).startswith(late)  # a slow step: at most its own share behind it
    beat.stop()


def test_a_line_comes_only_when_the_run_has_said_nothing_for_that_long(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pretrain")
    beat = heartbeat(tmp_path, every_s=0.5)
    beat.step_started(1)
    ours = logging.getLogger("pretrain.anything")
    try:
        until = time.monotonic() + 1.5
        while time.monotonic() < until:  # a line of ours every 25 ms: nothing more is said
            ours.info("a line of the run's own")
            time.sleep(0.025)
        said = [r.getMessage() for r in caplog.records if r.name == "pretrain"]
        assert said == []
        time.sleep(1.3)  # quiet: a line every half second
        said = [r.getMessage() for r in caplog.records if r.name == "pretrain"]
        assert 1 <= len(said) <= 3 and all(
            s.startswith("progress: step 1 of 1000, the first of this launch") for s in said
        ), said
    finally:
        beat.stop()
    time.sleep(0.8)
    assert len([r for r in caplog.records if r.name == "pretrain"]) == len(said)  # stopped: silent


@pytest.mark.slow
def test_a_compiling_first_step_says_its_time_left_from_the_launch_before(shards, tmp_path):
    """Two launches of one compiled run, quiet between log lines: the first says how long its first step
    has compiled, and keeps its time (the step's own, as logged); the resumed launch's first step says
    that time and what is left of it."""
    env = {"MLM_PRETRAIN_CACHE": str(tmp_path / "cache")}
    common = ["impl.compile=true", "impl.precision=fp32", "train.progress_every_s=1", "train.eval_every=0"]
    first = train(shards, tmp_path / "run", "train.max_steps=2", "train.log_every=1", *common, env=env)
    assert first.returncode == 0, explain(first)
    said = first.stdout + first.stderr
    assert re.search(
        r"progress: step 1 of 2, the first of this launch \(compiling the model with torch.compile\): \d+m\d\ds so far \(none",
        said,
    ), said
    kept = json.loads((tmp_path / "cache" / "first_step.json").read_text())
    assert len(kept) == 1
    record = next(iter(kept.values()))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_1 = next(r for r in rows if r.get("step") == 1 and "perf/step_time_s" in r)
    assert abs(record["seconds"] - step_1["perf/step_time_s"]) <= 0.1, (record, step_1)

    again = train(shards, tmp_path / "run", "train.max_steps=4", "train.log_every=2", *common, env=env)
    assert again.returncode == 0, explain(again)
    said = again.stdout + again.stderr
    seconds = round(record["seconds"])
    took = f"{seconds // 60}m{seconds % 60:02d}s"
    assert re.search(
        rf"progress: step 3 of 4, the first of this launch \(compiling the model with torch.compile\): \d+m\d\ds so far"
        rf"(; it took {took} here on {record['when']}: about \d+m\d\ds left|, longer than the {took} it took here)",
        said,
    ), said
