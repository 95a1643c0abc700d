"""A finished ZeRO-3 run exits 0 on every rank (issue 37). Rank 1 now and then aborted at interpreter
exit ("terminate called without an active exception", the launcher's exit 250): DeepSpeed keeps the
ZeRO-3 engine, and through its parameters every process group, reachable after the run, so gloo's
threads outlived ``destroy_process_group`` and were torn down in the interpreter's final teardown.
A rank now ends once Python's exit steps have run, before that teardown (``engine.end_process``).

``tests/exit_probe.py`` writes down the native threads alive if the final teardown runs at all.

Time: about 1-2 minutes: the exit of a process is what is tested (gloo's threads at the
interpreter's teardown), so each run is a fresh launch through DeepSpeed's per-node launcher."""

from __future__ import annotations

import subprocess

import pytest

from conftest import PY, REPO, explain, free_port, node_launcher, train_cmd, trainer_env

pytestmark = pytest.mark.slow
PROBE = str(REPO / "tests" / "exit_probe.py")


def test_gloo_threads_outlive_destroy_process_group_while_a_group_is_referenced(tmp_path):
    """The mechanism, and a probe that sees it: a plain exit reaches the teardown with gloo's threads."""
    # The group held by garbage the collector does not free (as the ZeRO-3 engine holds it).
    code = (
        "import gc, exit_probe, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "holder = {'group': dist.group.WORLD}; holder['self'] = holder; del holder; gc.freeze()\n"
        "dist.destroy_process_group()"
    )
    env = trainer_env(EXIT_PROBE_DIR=str(tmp_path), PYTHONPATH=f"{REPO / 'tests'}:{REPO}")
    proc = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, explain(proc)
    threads = (tmp_path / "teardown-rank0.txt").read_text().split()
    # gloo's work threads (its transport's thread is named gloo_tcp_loop in torch 2.13, unnamed in 2.11)
    assert "pt_gloo_runloop" in threads, threads


def test_a_handful_of_zero3_runs_each_exit_0_on_every_rank_before_the_teardown(shards, tmp_path):
    """Three 2-rank ZeRO-3 runs, each resuming the previous one's checkpoint: six exit codes."""
    out, probes = tmp_path / "run", tmp_path / "probes"
    for steps in (2, 3, 4):
        probes.mkdir(exist_ok=True)
        args = train_cmd(
            shards,
            out,
            "impl.zero_stage=3",
            f"train.max_steps={steps}",
            "train.eval_every=0",
            "train.checkpoint_every=1",
            "tracking.backend=none",
        )[3:]  # after "python -m pretrain.train"
        cmd = [*node_launcher(2), PROBE, "pretrain.train", *args]
        proc = subprocess.run(
            cmd, cwd=REPO, env=trainer_env(EXIT_PROBE_DIR=str(probes)), capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, explain(proc)
        launcher = proc.stdout + proc.stderr
        assert launcher.count("exits successfully") == 2, explain(proc)
        assert f"done: {steps} steps" in proc.stdout, explain(proc)
        # No rank reached the interpreter's final teardown (where gloo's threads were still running).
        assert sorted(p.name for p in probes.iterdir()) == [], {p.name: p.read_text().split() for p in probes.iterdir()}
    assert (out / "checkpoints" / "step00000004").is_dir()
