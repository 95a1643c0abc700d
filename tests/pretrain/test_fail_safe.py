"""Fail safe, round 3 (issue 18): a damaged checkpoint is named and the previous complete one taken,
bad input read mid-run by one rank stops every rank with exit 2 and its name, a port in use is an
input error, ranks die with the launcher that started them, and stale shared memory is removed.

Time: about 2 minutes: what is tested is mostly the launcher's side of failure (``pretrain.launch``:
exit codes, the last word, ranks that die with it), so those runs go through it for real; the
damaged-checkpoint runs, the trainer's side alone, fork from the rank pool."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, command_of, free_port, ids_payload, train_cmd
from conftest import train as launch

PY = sys.executable
BASE = [
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "model.max_position_embeddings=64",
    "optim.warmup_steps=2",
    "impl.compile=false",
]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def train(data_dir, out_dir, *overrides, ranks=1):
    return launch(data_dir, out_dir, *BASE, *overrides, ranks=ranks, launcher=[PY, "-m", "pretrain.launch"])


def explain(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"


# ------------------------------------------------------------------- item 7: damaged checkpoints


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumed(shards, tmp_path):
    run = tmp_path / "run"

    def train(data_dir, out_dir, *overrides):  # the trainer's side: its ranks from the rank pool
        return launch(data_dir, out_dir, *BASE, *overrides, ranks=1)

    # A killed run's all-reduce buffer (item 5): removed at start-up, as nothing maps it.
    stale = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_h2stale{os.getpid()}_0")
    stale.write_bytes(b"\0" * 4096)
    os.utime(stale, (stale.stat().st_atime, stale.stat().st_mtime - 3600))
    first = train(shards, run, "train.max_steps=4", "train.checkpoint_every=2")
    assert first.returncode == 0, explain(first)
    assert not stale.exists()
    # Any trainer's start-up on this machine removes it: under pytest-xdist the other worker's may come
    # first, and then this run has nothing to say (the message itself is checked in-process below).
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1":
        assert "stale shared-memory file(s) left by killed processes" in first.stdout
    root = run / "checkpoints"
    listed = json.loads((root / "step00000004" / "file_list.json").read_text())["files"]
    optim = "step00000004/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert listed[optim.split("/", 1)[1]]["size"] == (root / optim).stat().st_size > 10000
    assert "config.yaml" in listed and "tokenizer/tokenizer.json" in listed and "COMPLETE" not in listed
    data = (root / optim).read_bytes()
    (root / optim).write_bytes(data[:10000])  # head -c 10000, as the issue does

    resumed = train(shards, run, "train.max_steps=6", "train.checkpoint_every=2")
    assert resumed.returncode == 0, explain(resumed)
    assert (
        f"checkpoint {root / 'step00000004'} is damaged: zero_pp_rank_0_mp_rank_00_optim_states.pt has "
        f"10000 bytes, {len(data)} were written" in resumed.stderr
    )
    assert f"falling back to the previous complete checkpoint {root / 'step00000002'}" in resumed.stderr
    assert "start: step 2 (resumed from step00000002)" in resumed.stdout, explain(resumed)

    for tag in ("step00000004", "step00000006"):  # rewritten at step 4, then 6: damage all
        (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (root / "step00000002" / "config.yaml").write_text("flipped")
    refused = train(shards, run, "train.max_steps=8")
    assert refused.returncode == 2, explain(refused)
    assert "no usable checkpoint in" in refused.stderr and "step00000002: config.yaml" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_checksums_find_a_rewritten_file_and_old_checkpoints_are_taken_as_they_are(tmp_path, capsys):
    from pretrain.checkpoint import checkpointing

    folder = tmp_path / "step00000002"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "weights.pt").write_bytes(bytes(range(256)) * 40)
    (folder / "tokenizer" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    assert checkpointing.damage(folder) is None  # no list: an older version's
    assert "has no file_list.json (written by an older version)" in capsys.readouterr().err
    checkpointing.write_file_list(folder)
    assert checkpointing.damage(folder) is None
    raw = bytearray((folder / "weights.pt").read_bytes())
    raw[5000] ^= 1  # same size, one bit flipped
    (folder / "weights.pt").write_bytes(bytes(raw))
    assert checkpointing.damage(folder, checksums=False) is None  # other ranks check sizes only
    assert checkpointing.damage(folder) == "weights.pt has another sha256 than was written"
    (folder / "tokenizer" / "vocab.txt").unlink()
    assert checkpointing.damage(folder) == (
        "tokenizer/vocab.txt is missing; weights.pt has another sha256 than was written"
    )


def test_resume_takes_the_newest_undamaged_checkpoint_and_refuses_a_damaged_named_one(tmp_path, monkeypatch):
    from pretrain.checkpoint import checkpointing
    from pretrain.config.loader import ConfigError
    from pretrain.config.schema import Config

    cfg = Config()
    cfg.train.out_dir = str(tmp_path)
    root = checkpointing.checkpoint_root(cfg)
    for step in (2, 4, 6):
        folder = root / checkpointing.tag_for_step(step)
        folder.mkdir(parents=True)
        torch.save({"w": torch.full((250,), float(step))}, folder / "weights.pt")  # a zip, as torch.save writes
        checkpointing.write_file_list(folder)
        (folder / checkpointing.COMPLETE).write_text("{}")
    (root / checkpointing.LATEST).write_text("step00000006")
    damaged = bytearray((root / "step00000006" / "weights.pt").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # same size, other bytes
    (root / "step00000006" / "weights.pt").write_bytes(bytes(damaged))
    (root / "step00000004" / "weights.pt").write_bytes(b"\0" * 10)
    assert checkpointing.resume_tag(cfg) == "step00000002"
    monkeypatch.setenv("RANK", "1")  # another rank: sizes only, the first rank decides
    assert checkpointing.resume_tag(cfg) == "step00000006"
    monkeypatch.setenv("RANK", "0")
    cfg.train.resume = "step00000006"
    with pytest.raises(
        ConfigError, match="train.resume='step00000006': the checkpoint .* is damaged: weights.pt has another sha256"
    ):
        checkpointing.resume_tag(cfg)


# ------------------------------------------------- item 6: a bad token id read by one rank mid-run


def _block_only_rank1_reads(data_dir: Path) -> tuple[str, int, int]:
    """(shard path, block index, step) of a block that rank 1 of 2 reads first at that (0-based) step,
    the first after step 0 where one exists, and rank 0 not up to it (tiny: 16 = 2 x 8 per step)."""
    from data_prep.common.manifest import load_manifest
    from pretrain.data.stream import TrainStream, _PlanCursor, _RankSlice

    stream = TrainStream(data_dir, load_manifest(data_dir), "train", 0, 2, 8, 16, 1234)
    cursor, layout = _PlanCursor(stream._plan), stream._plan.layout
    seen = {0: set(), 1: set()}
    for step in range(40):
        now = {r: set(_RankSlice(r, 2, 8).take(cursor.step(step), 0)[0].tolist()) for r in (0, 1)}
        only_rank1 = now[1] - now[0] - seen[0] - seen[1]
        if step > 0 and only_rank1:
            block = min(only_rank1)
            return layout.paths[int(layout.block_shard[block])], int(layout.block_index[block]), step
        seen[0] |= now[0]
        seen[1] |= now[1]
    raise AssertionError("no block read by rank 1 alone in 40 steps")


@pytest.mark.slow
def test_a_token_id_out_of_range_read_by_one_rank_stops_every_rank_with_exit_2(shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    path, index, step = _block_only_rank1_reads(data)
    _corrupt_last_id(data, path, index, 30600)

    proc = train(data, tmp_path / "run", "train.max_steps=40", "train.log_every=1", ranks=2)
    assert proc.returncode == 2, explain(proc)
    named = f"{path}: block {index} holds token id 30600"
    assert proc.stderr.count(f"error: [read by rank 1] {named}") == 2, explain(proc)  # printed by both ranks
    assert "[rank 0] stopping on bad input" in proc.stderr and "[rank 1] stopping on bad input" in proc.stderr
    assert "Traceback" not in proc.stderr and f"step {step + 1} " not in proc.stdout
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, step + 1))  # the steps before it, logged
    assert np.isfinite(json.loads(rows[-1])["train/loss"])


def _corrupt_last_id(data: Path, path: str, index: int, token: int) -> None:
    """The block's last token id (uint16) becomes ``token``, and the manifest records the shard as
    written (its sha256 and block checksums): what a data prep that wrote a bad id leaves."""
    from data_prep.common.shards import block_checksums, sha256_file

    offset, size = ids_payload(path, index)
    with open(path, "r+b") as f:
        f.seek(offset + size - 2)
        f.write(struct.pack("<H", token))
    manifest = json.loads((data / "manifest.json").read_text())
    for entry in manifest["shards"]:
        if entry["name"] == Path(path).name:
            entry["sha256"] = sha256_file(path)
            entry["block_crc32"] = block_checksums(Path(path).read_bytes(), entry["block_offsets"])
    (data / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_a_bad_block_in_the_evaluation_split_read_by_one_rank_stops_every_rank_with_exit_2(shards, tmp_path):
    """Rank 1 of 2 scores sequences 64..127 of the evaluation set; a block holding only some of
    those gets an id beyond the vocabulary. Both ranks stop with its name, exit 2 (issue 32)."""
    from pretrain.data.stream import _open_split

    data = tmp_path / "data"
    shutil.copytree(shards, data)
    _, layout = _open_split(data, None, "validation")
    starts = np.concatenate([[0], np.cumsum(layout.block_len)[:-1]])
    block = next(b for b in range(len(starts)) if starts[b] >= 64 and starts[b] + layout.block_len[b] <= 128)
    path, index = layout.paths[int(layout.block_shard[block])], int(layout.block_index[block])
    _corrupt_last_id(data, path, index, 30600)

    proc = train(data, tmp_path / "run", "train.max_steps=4", "train.eval_every=2", "train.eval_sequences=128", ranks=2)
    assert proc.returncode == 2, explain(proc)
    named = f"{path}: block {index} holds token id 30600"
    assert proc.stderr.count(f"error: [read by rank 1] {named}") == 2, explain(proc)  # printed by both ranks
    assert "[rank 0] stopping on bad input" in proc.stderr and "[rank 1] stopping on bad input" in proc.stderr
    assert "Traceback" not in proc.stderr and "eval/loss" not in proc.stdout, explain(proc)
    # The last word is ours (pretrain.launch); DeepSpeed's launcher line went to its log.
    log = tmp_path / "run" / "third_party-launcher.log"
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"pretrain.launch: exit 2: bad input or settings, named above; "
        f"nothing was lost (DeepSpeed's launcher log: {log})"
    ), explain(proc)
    assert "sigkill_handler" not in proc.stdout + proc.stderr and "sigkill_handler" in log.read_text()
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [2]  # the step before it, logged


# ------------------------------------------------------------------- item 8: a port in use


def test_a_master_port_in_use_is_refused_by_name_before_any_rank_starts(shards, capsys):
    import socket

    from pretrain.runtime import launcher as launch

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = launch.main(
            [
                "--num_gpus",
                "2",
                "--master_port",
                str(port),
                "--module",
                "pretrain.train",
                "--config",
                "configs/tiny.yaml",
                f"data.dir={shards}",
            ]
        )
    assert rc == 2
    assert f"pretrain.launch: --master_port {port} is already in use on this machine" in capsys.readouterr().err
    from pretrain.runtime.ports import launch_port_problem

    assert launch_port_problem(["--node_rank", "1", "--master_port", str(port)]) is None  # not the master's node
    assert "not a port number" in launch_port_problem(["--master_port", "70000"])


# ------------------------------------------------------------------- item 5: stale shared memory


@pytest.mark.slow
def test_stale_shared_memory_is_removed_and_what_a_live_process_maps_is_kept(caplog):
    import time
    import uuid

    from data_prep.common import stale_shm

    tag = f"h2test{uuid.uuid4().hex[:8]}"
    stale, live = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{tag}_{r}" for r in (0, 1))
    sem = f"/dev/shm/sem.mp-{tag}"
    for path in (stale, live, sem):
        with open(path, "wb") as f:
            f.truncate(1 << 16)
    holds = (
        "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); "
        "print('mapped', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([PY, "-c", holds, live], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        patterns = [f"*{tag}*"]  # never another job's files, whatever their state
        assert stale_shm.remove_stale(patterns) == []  # all younger than a minute
        hour_ago = time.time() - 3600
        for path in (stale, live, sem):
            os.utime(path, (hour_ago, hour_ago))
        with caplog.at_level("WARNING", logger=stale_shm.log.name):
            assert stale_shm.remove_stale(patterns) == sorted([stale, sem])
        assert "removed 2 stale shared-memory file(s) left by killed processes (0 MiB)" in caplog.text
        assert os.path.exists(live) and not os.path.exists(stale) and not os.path.exists(sem)
    finally:
        holder.kill()
        holder.wait()
        for path in (stale, live, sem):
            if os.path.exists(path):
                os.unlink(path)


# ------------------------------------------------------- item 4: ranks die with their launcher


@pytest.mark.slow
@pytest.mark.parametrize("when", ["training", "start-up"])
def test_ranks_die_with_a_launcher_killed_with_sigkill(shards, tmp_path, when):
    """kill -9 of pretrain.launch's group: its ranks (in a session of their own) end within 2 s, while
    training and while still importing (issue 61, item 7: 2-4 s, 9 s at start-up, with a watch that
    began after the imports and polled once a second)."""
    import signal
    import time

    import psutil

    cmd = train_cmd(
        shards,
        tmp_path,
        *BASE,
        "train.max_steps=100000",
        "train.log_every=1",
        "train.checkpoint_every=0",
        ranks=2,
        launcher=[PY, "-m", "pretrain.launch"],
    )
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(),
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def is_rank(p) -> bool:  # `python -u -m pretrain.train ...`, not DeepSpeed's `... --module pretrain.train`
        cmd = command_of(p)
        return "pretrain.train" in cmd and cmd[cmd.index("pretrain.train") - 1] == "-m"

    def ranks() -> list:
        return [p for p in psutil.Process(proc.pid).children(recursive=True) if is_rank(p)]

    def alive(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    metrics, descendants = tmp_path / "metrics.jsonl", []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the launch ended early"
            if when == "start-up" and len(ranks()) >= 2:
                break  # both rank processes exist, still importing torch
            if when == "training" and metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.05 if when == "start-up" else 0.5)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        rank_procs = [p for p in descendants if is_rank(p)]
        assert len(rank_procs) >= 2
        if when == "start-up":
            assert not metrics.exists()
        os.killpg(proc.pid, signal.SIGKILL)  # `kill -9 -- -PGID`: the launcher's group, not the ranks'
        killed = time.monotonic()
        proc.wait()
        while time.monotonic() < killed + 20 and any(alive(p) for p in rank_procs):
            time.sleep(0.05)
        ranks_gone = time.monotonic() - killed
        assert ranks_gone < 2.0, (when, ranks_gone, [command_of(p) for p in rank_procs if alive(p)])
        while time.monotonic() < killed + 20 and any(alive(p) for p in descendants):
            time.sleep(0.2)
        assert not [command_of(p) for p in descendants if alive(p)]
    finally:
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.slow
def test_a_launcher_killed_before_its_ranks_exist_takes_deepspeed_s_runner_and_them_along(shards, tmp_path):
    """Issue 72, item 6: kill -9 of pretrain.launch while DeepSpeed's runner is still importing. The
    runner's process group (its launcher and the ranks it would spawn) is gone within 3 s, and no
    rank starts afterwards (before: the runner spawned them, and they lived 13-24 s)."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen(
        train_cmd(shards, tmp_path, ranks=2, launcher=[PY, "-m", "pretrain.launch"]),
        cwd=REPO,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    runner = None
    deadline = time.monotonic() + 60
    while runner is None and time.monotonic() < deadline:
        runner = next(iter(psutil.Process(proc.pid).children()), None)
        time.sleep(0.02)
    assert runner is not None and "pretrain.runtime.lifeline" in command_of(runner)
    group = runner.pid  # its own session: the runner, its per-node launcher and the ranks
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()

    def in_group() -> list:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return found

    while time.monotonic() < killed + 20 and in_group():
        time.sleep(0.05)
    gone_after = time.monotonic() - killed
    assert not in_group() and gone_after < 3.0, gone_after
    time.sleep(2)  # nothing of the group starts later
    assert not in_group() and not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------- items 9, 10: pretrain.evaluate refusals


def test_evaluate_refuses_a_model_without_tokenizer_files_and_a_header_only_csv(tmp_path, capsys, bert_uncased_dir):
    from pretrain.eval.cli import main
    from pretrain.eval.tasks import DownstreamTaskConfig, TaskError, labelled_task

    header_only = tmp_path / "header.csv"
    header_only.write_text("text,label\n")
    with pytest.raises(TaskError, match=r"header\.csv: no rows$"):
        labelled_task(DownstreamTaskConfig(path=str(header_only)))
    assert main([str(bert_uncased_dir), "--task", str(header_only)]) == 2
    assert f"error: {header_only}: no rows" in capsys.readouterr().err

    task = tmp_path / "task.csv"
    task.write_text("text,label\n" + "".join(f"sentence number {i},{'ab'[i % 2]}\n" for i in range(8)))
    model = tmp_path / "export"
    model.mkdir()
    shutil.copy(Path(bert_uncased_dir) / "config.json", model)  # weights aside: refused before loading
    assert main([str(model), "--task", str(task)]) == 2
    assert f"{model}: no tokenizer files (none of tokenizer.json, vocab.txt" in capsys.readouterr().err


# ------------------------------------------------- item 14: a cancelled variant is interrupted


@pytest.mark.parametrize(
    "status, state",
    [
        ({"launches": 1, "wall_s": 9.0, "last_exit": 1, "stopped_by_signal": True}, "interrupted"),  # scancel
        ({"launches": 1, "wall_s": 9.0, "last_exit": -15}, "interrupted"),  # its launcher killed by SIGTERM
        ({"launches": 2, "wall_s": 9.0, "last_exit": 137}, "interrupted"),  # SIGKILL, through a shell
        ({"launches": 1, "wall_s": 9.0, "last_exit": 3}, "interrupted"),  # checkpointed and exited 3
        ({"launches": 1, "wall_s": 9.0, "last_exit": 2}, "failed"),  # bad input
        ({"launches": 1, "wall_s": 9.0, "last_exit": 1}, "failed"),  # a crash
        ({"launches": 0, "wall_s": 0.0}, "not started"),
    ],
)
def test_study_summary_calls_a_variant_stopped_by_a_signal_interrupted(status, state):
    from types import SimpleNamespace

    from pretrain.study.summary import variant_row

    variant = SimpleNamespace(name="rate=0.4", values={"masking.rate": 0.4})
    assert variant_row(variant, [{"step": 5, "train/loss": 7.0}], status, finished=False)["status"] == state


def test_the_launchers_last_word_says_what_each_exit_code_means(tmp_path):
    from pretrain.runtime.launcher import last_word, launcher_log

    config = tmp_path / "c.yaml"
    config.write_text("train:\n  out_dir: " + str(tmp_path / "from-yaml") + "\n")
    argv = ["--num_gpus", "2", "--module", "pretrain.train", "--config", str(config)]
    assert launcher_log(argv) == tmp_path / "from-yaml" / "third_party-launcher.log"
    assert launcher_log([*argv, f"train.out_dir={tmp_path / 'over'}"]) == tmp_path / "over" / "third_party-launcher.log"
    assert launcher_log(["--config", str(tmp_path / "missing.yaml")]).parent == Path(tempfile.gettempdir())
    log = tmp_path / "l.log"
    assert last_word(3, log).startswith(
        "pretrain.launch: exit 3: stopped to be relaunched: on a signal (after a checkpoint), or after a hang or a "
        "store outage (nothing new checkpointed"
    )
    assert "resumes from the last complete checkpoint" in last_word(3, log)
    assert "non-finite" in last_word(4, log) and "spike" in last_word(5, log)
    assert (
        last_word(1, log)
        == f"pretrain.launch: exit 1: a rank failed; its error is above (DeepSpeed's launcher log: {log})"
    )


def test_a_killed_jobs_buffer_goes_at_once_when_nobody_listens_on_its_port():
    """A relaunch seconds after a kill -9: the dead job's buffers are young, unmapped, and name a
    master port on this machine that nobody listens on: removed at once. A young buffer whose port
    a live job listens on (it may not have mapped it yet) is kept."""
    import socket
    import uuid

    from data_prep.common import stale_shm

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    live_port, dead_port = listener.getsockname()[1], free_port()
    rank = 90000 + uuid.uuid4().int % 9000  # a rank no real job has: the name is this test's own
    paths = {
        port: f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}"
        for port in (live_port, dead_port)
    }
    try:
        for path in paths.values():
            with open(path, "wb") as f:
                f.truncate(1 << 16)
        patterns = [os.path.basename(p) for p in paths.values()]
        assert stale_shm.remove_stale(patterns) == [paths[dead_port]]
        assert os.path.exists(paths[live_port])
    finally:
        listener.close()
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_a_rank_releases_only_the_shared_memory_it_maps(monkeypatch):
    """A rank that failed before creating its segment (its master port taken by another job) removed
    the other job's live segment of the same name at exit, and that job's peer ranks waited forever."""
    import mmap

    from pretrain.runtime.engine import release_shared_memory

    port = f"9{os.getpid()}"
    path = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("RANK", "0")
    path.write_bytes(b"\0" * 4096)
    try:
        release_shared_memory()  # another job's: not mapped here
        assert path.exists()
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            release_shared_memory()  # this process's own
            assert not path.exists()
    finally:
        path.unlink(missing_ok=True)
