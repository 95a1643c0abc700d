"""Faults a user meets, through the real entry points: bad input is refused before any process group
(exit 2, one message), a resume may not change what the run computes, a kill between the final
checkpoint and its export is finished on the next launch, signals to the launcher's process group
reach the ranks and its exit code is theirs, and two jobs cannot write one run.

Time: under a minute on the AMX Xeon, 1.4 minutes on the AVX2-only EPYC under the README's command
(2026-11-29): three trainers and two DeepSpeed launchers started for real (the signals and the kill
need real process groups), 13 runs forked from the rank pool."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, train_cmd
from conftest import train as launch

pytestmark = pytest.mark.slow
PY = sys.executable
BASE = [
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "model.max_position_embeddings=64",
    "optim.warmup_steps=2",
]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def train(data_dir, out_dir, *overrides, ranks=1, launcher=None):
    return launch(data_dir, out_dir, *BASE, *overrides, ranks=ranks, launcher=launcher)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc


def strict_records(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished_run(shards, tmp_path_factory):
    """A 1-rank ZeRO-0 run of 3 steps, logged every 2 (the last step is not on the log grid)."""
    out = tmp_path_factory.mktemp("finished")
    proc = ok(train(shards, out, "train.max_steps=3", "impl.zero_stage=0"))
    return out, proc.stdout + proc.stderr


def test_final_step_grad_norm_at_stage0_is_fresh(finished_run):
    out, _ = finished_run
    rows = {r["step"]: r for r in strict_records(out / "metrics.jsonl") if "train/grad_norm" in r}
    assert sorted(rows) == [2, 3]
    assert all(r["train/grad_norm"] is not None and r["train/grad_norm"] > 0 for r in rows.values())
    assert all(0 < r["perf/mfu"] <= 1 for r in rows.values())  # an honest peak, measured in fp32


def test_a_results_setting_change_is_refused_by_name(finished_run, shards, tmp_path):
    out, _ = finished_run
    work = tmp_path / "run"
    shutil.copytree(out, work)
    proc = train(shards, work, "train.max_steps=5", "impl.zero_stage=0", "optim.lr=2e-3", "masking.rate=0.2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "optim.lr" in proc.stderr and "masking.rate" in proc.stderr
    assert "process group" not in proc.stdout.lower() and "Traceback" not in proc.stderr
    # A shorter schedule is refused too; what only changes speed is accepted, and max_steps may grow.
    assert train(shards, work, "train.max_steps=2", "impl.zero_stage=0").returncode == 2
    grown = ok(train(shards, work, "train.max_steps=5", "impl.zero_stage=2", "impl.micro_batch_size=4"))
    assert "resumed from step00000003" in grown.stdout
    steps = [r["step"] for r in strict_records(work / "metrics.jsonl") if "train/loss" in r]
    assert steps == [2, 3, 4, 5]


def test_cut_metrics_line_and_non_finite_values_do_not_break_resume(finished_run, shards, tmp_path):
    out, _ = finished_run
    work = tmp_path / "run"
    shutil.copytree(out, work)
    with open(work / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/loss": 7.1, "perf/mf')  # a kill mid-write, or a full disk
    ok(train(shards, work, "train.max_steps=4", "impl.zero_stage=0"))
    records = strict_records(work / "metrics.jsonl")  # raises on NaN/Infinity or a cut line
    assert [r["step"] for r in records if "train/loss" in r] == [2, 3, 4]


def test_kill_between_final_checkpoint_and_export_is_finished(finished_run, shards, tmp_path):
    out, _ = finished_run
    work = tmp_path / "run"
    shutil.copytree(out, work)
    assert (work / "hf_final" / "EXPORTED_FROM").read_text().strip() == "step00000003"
    shutil.rmtree(work / "hf_final")  # as if killed before the export
    proc = ok(train(shards, work, "train.max_steps=3", "impl.zero_stage=0"))
    assert "has no export yet" in proc.stdout
    assert (work / "hf_final" / "EXPORTED_FROM").read_text().strip() == "step00000003"
    from transformers import AutoModelForMaskedLM

    assert AutoModelForMaskedLM.from_pretrained(work / "hf_final").config.vocab_size > 0
    again = ok(train(shards, work, "train.max_steps=3", "impl.zero_stage=0"))
    assert "has no export yet" not in again.stdout


def test_incomplete_resume_tag_is_input_error(finished_run, shards, tmp_path):
    out, _ = finished_run
    work = tmp_path / "run"
    shutil.copytree(out, work)
    (work / "checkpoints" / "step00000009").mkdir()
    proc = train(shards, work, "train.max_steps=9", "train.resume=step00000009")
    assert proc.returncode == 2 and "not a complete checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # The header names what was checked, the run and its config, not the data's manifest.
    (header,) = [line for line in proc.stderr.splitlines() if "problem(s) in" in line]
    assert header.endswith("1 problem(s) in the run of configs/tiny.yaml with overrides:"), header


# Once: the first rank reports (2 ranks); the settings' checks do not depend on the world size (1 rank).
@pytest.mark.parametrize(
    "overrides,needle,ranks",
    [
        (["impl.precision=fp16"], "fp16 needs a GPU", 2),
        (["optim.name=lamb", "impl.offload_optimizer=true", "impl.zero_stage=2"], "DeepSpeed's optimiser offload", 1),
        (["optim.name=lamb", "impl.zero_stage=1"], "LAMB's per-tensor trust ratio", 1),
    ],
)
def test_bad_settings_are_reported_once_before_any_process_group(shards, tmp_path, overrides, needle, ranks):
    proc = train(shards, tmp_path, "train.max_steps=2", *overrides, ranks=ranks)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.count("problem(s) in") == 1 and needle in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "checkpoints").exists()


def test_init_from_a_model_of_another_tokenizer_with_the_same_vocab_size_is_refused(shards, tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    manifest = json.loads((shards / "manifest.json").read_text())
    tok_dir = shards / manifest["tokenizer"]["path"]
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[200], sorted(vocab)[300]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, other ids
    model_dir = tmp_path / "other-model"
    BertForMaskedLM(
        BertConfig(
            vocab_size=manifest["tokenizer"]["vocab_size"],
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    ).save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text(json.dumps(tok))
    proc = train(shards, tmp_path / "run", "train.max_steps=2", f"model.init_from={model_dir}")
    assert proc.returncode == 2 and "vocabulary differs" in proc.stderr, proc.stderr[-2000:]


def test_out_of_range_token_id_is_named_and_exits_2(shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 300  # edited: ids above it are in the shards
    (data / "manifest.json").write_text(json.dumps(manifest))
    # 1 rank: test_fail_safe stops 2 ranks on an id that one of them reads
    proc = train(data, tmp_path / "run", "train.max_steps=2", "model.max_position_embeddings=64")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"shard|\.tar", proc.stderr) and "300" in proc.stderr


def test_sigterm_to_the_launchers_process_group_checkpoints_and_exits_3(shards, tmp_path):
    """`kill -TERM -PGID` (a shell or scheduler stopping the job): pretrain.launch passes it to the
    ranks, waits, and exits with their 3; the checkpoint is complete. ZeRO-3 also logs the whole
    parameter count, and a second job on the same run folder is refused while the first holds it."""
    cmd = train_cmd(
        shards,
        tmp_path,
        *BASE,
        "train.max_steps=100000",
        "train.log_every=1",
        "impl.zero_stage=3",
        "impl.compile=false",
        ranks=2,
        launcher=[PY, "-m", "pretrain.launch"],
    )
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline, metrics = time.monotonic() + 300, tmp_path / "metrics.jsonl"
        while time.monotonic() < deadline and not (
            metrics.exists() and any(r.get("step", 0) >= 2 for r in strict_records(metrics))
        ):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        from pretrain.checkpoint.checkpointing import RunLock
        from pretrain.config.loader import ConfigError

        with pytest.raises(ConfigError, match="another job"):
            RunLock(str(tmp_path), wait_s=0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3, output[-4000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "checkpoints" / latest / "COMPLETE").is_file()
    params = int(re.search(r"ZeRO 3, (\d+) params", output).group(1))
    from transformers import BertConfig

    config = BertConfig.from_json_file(tmp_path / "checkpoints" / latest / "hf_config.json")
    from transformers import BertForMaskedLM

    assert params == sum(p.numel() for p in BertForMaskedLM(config).parameters())
    RunLock(str(tmp_path), wait_s=0.5)  # released with the job


def test_other_ranks_report_bad_input_only_when_the_first_rank_has_not(monkeypatch, capsys):
    """DeepSpeed's launcher kills every rank once one exits non-zero: a rank other than the first that
    exited at once could cut the first off before it printed (seen: exit 2 with an empty stderr). The
    others wait; one that outlives the wait reports what it found, under its rank."""
    from pretrain.config.loader import ConfigError
    from pretrain.guards import bad_input

    monkeypatch.setattr(bad_input, "OTHER_RANKS_REPORT_AFTER_S", 0.3)
    monkeypatch.setenv("RANK", "1")
    start = time.monotonic()
    bad_input.report_before_start(ConfigError(["data.dir: no manifest.json"], "x.yaml"), first_rank=False)
    assert time.monotonic() - start >= 0.3
    assert "error (rank 1): " in capsys.readouterr().err
    start = time.monotonic()
    bad_input.report_before_start(ConfigError(["data.dir: no manifest.json"], "x.yaml"), first_rank=True)
    assert time.monotonic() - start < 0.2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_filesystem_without_posix_locks_is_named_not_taken_for_another_job(tmp_path, monkeypatch):
    """Some NFS and Lustre mounts answer lockf with ENOSYS or ENOLCK: that is not "held by another
    job" (a 5-minute wait, then the wrong message), it is named at once (issue 33)."""
    import errno
    import fcntl

    from pretrain.checkpoint.checkpointing import RunLock
    from pretrain.config.loader import ConfigError

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="may not support POSIX locks") as err:
        RunLock(str(tmp_path), wait_s=60)
    assert time.monotonic() - start < 5 and "another job" not in str(err.value)
