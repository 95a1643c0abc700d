"""Fail safe, round 6 (issue 81): nothing outside the run folder leaves with it, and a ``latest`` pointer
never leads to another run's checkpoint.

Each test plants the fault first (a secret a symbolic link points to, a pointer out of the folder), then
shows it refused or left out, and named."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from conftest import explain, train
from data_prep.common.manifest import load_manifest
from data_prep.common.paths import plain_files
from pretrain.checkpoint.checkpointing import complete_tags, copy_plain, latest_complete_tag
from test_checkpoints_as_data_and_names_in_their_folder import RUN  # the same tiny run

SECRET = b"aws_secret_access_key = PLANTED-SECRET-81"


def secrets(tmp_path: Path) -> tuple[Path, Path]:
    """A credentials file and a folder holding one, outside any run."""
    outside = tmp_path / "home"
    (outside / "keys").mkdir(parents=True)
    (outside / "credentials").write_bytes(SECRET)
    (outside / "keys" / "id").write_bytes(SECRET)
    return outside / "credentials", outside / "keys"


def plant_links(folder: Path, tmp_path: Path) -> list[str]:
    """The class: a link to a file, a link to a folder, a link to a file of the same run; their names."""
    credentials, keys = secrets(tmp_path)
    (folder / "notes.txt").symlink_to(credentials)
    (folder / "more").symlink_to(keys, target_is_directory=True)
    (folder / "sibling.json").symlink_to(folder / "config.json")
    return ["notes.txt", "more", "sibling.json"]


# ------------------------------------------------------------- item 1: what a link points to stays home


def test_a_folder_walk_lists_regular_files_and_names_links_and_special_files(tmp_path):
    src = tmp_path / "tok"
    (src / "sub").mkdir(parents=True)
    (src / "vocab.txt").write_text("a\n")
    (src / "sub" / "merges.txt").write_text("b\n")
    (src / "config.json").write_text("{}")
    planted = plant_links(src, tmp_path)
    os.mkfifo(src / "pipe")  # reading it would block for ever
    files, others = plain_files(src)
    assert [p.relative_to(src).as_posix() for p in files] == ["config.json", "sub/merges.txt", "vocab.txt"]
    assert sorted(p.name for p in others) == sorted([*planted, "pipe"])
    linked = tmp_path / "linked"
    linked.symlink_to(src, target_is_directory=True)
    assert plain_files(linked) == ([], [linked])  # the folder itself a link: nothing read through it


def test_a_checkpoints_tokenizer_copy_leaves_links_out_and_names_them(tmp_path, caplog):
    src, dst = tmp_path / "tokenizer", tmp_path / "ckpt" / "step00000002" / "tokenizer"
    src.mkdir()
    (src / "vocab.txt").write_text("[PAD]\n")
    (src / "config.json").write_text("{}")
    plant_links(src, tmp_path)
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        copy_plain(src, dst)
    assert sorted(p.name for p in dst.rglob("*")) == ["config.json", "vocab.txt"]
    assert not any(p.is_symlink() for p in dst.rglob("*"))
    assert all(SECRET not in p.read_bytes() for p in dst.rglob("*") if p.is_file())
    assert "notes.txt" in caplog.text and "more" in caplog.text and "symbolic links are not followed" in caplog.text


@pytest.mark.slow
def test_a_data_folder_whose_tokenizer_holds_a_link_is_refused_before_the_run(shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    tokenizer = data / load_manifest(data).tokenizer.path
    credentials, keys = secrets(tmp_path)
    (tokenizer / "notes.txt").symlink_to(credentials)
    (tokenizer / "more").symlink_to(keys, target_is_directory=True)
    out = tmp_path / "run"
    proc = train(data, out, *RUN, "train.max_steps=2", "train.checkpoint_every=2")
    assert proc.returncode == 2, explain(proc)
    assert "notes.txt: not a regular file" in proc.stderr and "more: not a regular file" in proc.stderr, proc.stderr
    assert not (out / "checkpoints").exists()  # nothing started


def mirrored_files(kind: str, mirror: str, s3_server) -> dict[str, bytes]:
    if kind == "s3":
        bucket, prefix = mirror[len("s3://") :].split("/", 1)
        return s3_server.objects(bucket, prefix)
    root = Path(mirror)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_links_planted_in_the_export_never_reach_the_mirror(shards, tmp_path, s3_server, kind):
    """The issue's repro: a finished run, links planted in ``hf_final/``, then the same run with a
    mirror, which uploads the export it lacks. The export's own files arrive; what the links point
    to does not, and the log names each link."""
    out = tmp_path / "run"
    steps = [*RUN, "train.max_steps=2", "train.checkpoint_every=2"]
    train(shards, out, *steps, check=True)
    planted = plant_links(out / "hf_final", tmp_path)
    mirror = f"s3://{s3_server.bucket('links')}/runs/a" if kind == "s3" else str(tmp_path / "mirror")
    env = s3_server.aws() if kind == "s3" else None
    proc = train(shards, out, *steps, f"train.checkpoint_mirror={mirror}", env=env)
    assert proc.returncode == 0, explain(proc)
    mirrored = mirrored_files(kind, mirror, s3_server)
    export = {k: v for k, v in mirrored.items() if k.startswith("hf_final/")}
    own = {p.name for p in (out / "hf_final").iterdir() if not p.is_symlink()}
    assert {k.split("/", 1)[1] for k in export} == own and "EXPORTED_FROM" in own, sorted(export)
    assert not any(SECRET in v for v in mirrored.values())
    for name in planted:
        assert str(out / "hf_final" / name) in proc.stdout + proc.stderr, (name, proc.stdout[-3000:])


# ------------------------------------------------------------ item 2: latest names a tag of its folder


def complete(root: Path, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / "COMPLETE").write_text(json.dumps({"step": int(tag[4:])}))


@pytest.mark.parametrize(
    "pointer",
    [
        "../../other-run/checkpoints/step00000040",
        "{other}/step00000040",  # an absolute path
        "step00000040",  # a tag of this folder's name that is a link to the other run's
        "step00000004/../../../other-run/checkpoints/step00000040",
    ],
)
def test_a_latest_pointer_out_of_its_folder_is_damage_and_the_newest_own_tag_is_taken(tmp_path, caplog, pointer):
    root, other = tmp_path / "run" / "checkpoints", tmp_path / "other-run" / "checkpoints"
    for tag in ("step00000002", "step00000004"):
        complete(root, tag)
    complete(other, "step00000040")
    if pointer == "step00000040":
        (root / "step00000040").symlink_to(other / "step00000040", target_is_directory=True)
    (root / "latest").write_text(pointer.format(other=other))
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert latest_complete_tag(root) == "step00000004"
    assert "not a checkpoint tag of this folder" in caplog.text and "damaged" in caplog.text
    assert complete_tags(root) == ["step00000002", "step00000004"]  # a linked tag is none of this run's
    (root / "latest").write_text("step00000002")  # a pointer that is a tag of its own is taken as it is
    assert latest_complete_tag(root) == "step00000002"


# ------------------------------------------------------------------------- item 5: a disk that fills up


def test_the_launcher_keeps_relaying_the_ranks_output_when_its_log_cannot_be_written(capsysbinary):
    """/dev/full: every write fails with ENOSPC, as DeepSpeed's launcher log on a full disk. Before,
    the relay ended at the first such line, and the ranks' output (their error included) was lost."""
    from pretrain.runtime.launcher import pass_output

    ds = b"[2026-11-28 05:00:00,000] [INFO] [launch.py:256:main] process 12 spawned\n"
    lines = [b"rank 0: step 1\n", ds, b"rank 0: error: no space left on /run\n", ds]
    read, write = os.pipe()
    os.write(write, b"".join(lines))
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        pass_output(pipe, Path("/dev/full"))
    out = capsysbinary.readouterr().out
    assert b"rank 0: step 1\n" in out and b"rank 0: error: no space left on /run\n" in out
    assert b"cannot write /dev/full (No space left on device)" in out and out.count(ds) == 2


@pytest.mark.slow
def test_a_disk_full_during_a_checkpoint_is_a_named_stop_and_the_previous_checkpoint_resumes(
    shards, tmp_path, small_disk
):
    """A run folder on a tmpfs that holds its step-2 checkpoint but not its step-4 one: exit 7 (not a
    requeue), the message names the folder, the step and the intact checkpoint; the partial tag is
    never taken; the folder, moved to a disk with room, resumes to the end with the uninterrupted
    run's losses."""
    steps = [*RUN, "train.max_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=2"]
    straight = tmp_path / "straight"
    train(shards, straight, *steps, check=True)
    tag = straight / "checkpoints" / "step00000002"
    tag_kib = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file()) // 1024
    disk = small_disk(int(tag_kib * 1.6) + 256)  # the first checkpoint and the logs, not a second one
    out = disk / "run"
    proc = train(shards, out, *steps)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 7, explain(proc)
    assert f"no space left on {out / 'checkpoints'}" in said and "while writing checkpoint step 4" in said, said
    assert "the previous checkpoint step00000002 is intact" in said and "Traceback" not in said, said[-3000:]
    assert latest_complete_tag(out / "checkpoints") == "step00000002"
    roomy = tmp_path / "moved"
    shutil.copytree(out, roomy)
    resumed = train(shards, roomy, *steps)
    assert resumed.returncode == 0, explain(resumed)

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    assert losses(roomy) == losses(straight)


# ------------------------------------------------------------------------------ item 6: smaller ones


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_file_in_torchs_legacy_format_is_refused_by_name_on_resume(shards, tmp_path):
    """A bare pickle (torch's legacy format) in place of a checkpoint file: before, a rank traceback
    whose torch text advised ``weights_only=False``; now exit 2 naming the file, before any load."""
    import torch

    from pretrain.checkpoint.checkpointing import write_file_list
    from pretrain.checkpoint.files import MODEL_STATES_FILE
    from test_checkpoints_as_data_and_names_in_their_folder import RunsCommand

    out, marker = tmp_path / "run", tmp_path / "ran"
    steps = [*RUN, "train.checkpoint_every=2", "impl.zero_stage=1"]
    train(shards, out, *steps, "train.max_steps=2", check=True)
    folder = out / "checkpoints" / "step00000002"
    path = folder / MODEL_STATES_FILE
    torch.save({"note": RunsCommand(f"touch {marker}")}, path, _use_new_zipfile_serialization=False)
    write_file_list(folder)  # as whoever can write the folder can
    proc = train(shards, out, *steps, "train.max_steps=4", "train.resume=auto")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert f"{path} is not a zip archive as torch.save writes" in said, said[-3000:]
    assert "Traceback" not in said and "weights_only=False" not in said and not marker.exists()


@pytest.mark.slow
def test_sigusr1_to_every_process_of_the_job_checkpoints_and_exits_3(shards, tmp_path):
    """``scancel --signal=USR1`` without ``--batch`` signals every process of the job: pretrain.launch,
    DeepSpeed's runner, its per-node launch.py and the ranks. Before, the runner and launch.py died of
    it, and a stop that had checkpointed ended -10, "a rank failed". Now they ignore it, the ranks
    checkpoint after their step, and the job exits 3 (requeue)."""
    import signal

    import psutil

    from conftest import PY, command_of, train_cmd, train_through, trainer_env

    out = tmp_path / "run"
    steps = [*RUN, "train.max_steps=400", "train.checkpoint_every=0"]
    cmd = train_cmd(shards, out, *steps, ranks=2, launcher=[PY, "-m", "pretrain.launch"])
    signalled = []

    def scancel_usr1():
        launcher = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if str(out) in " ".join(p.info["cmdline"] or []) and "pretrain.launch" in " ".join(p.info["cmdline"] or [])
        )
        for proc in [launcher, *launcher.children(recursive=True)]:
            said = " ".join(command_of(proc)[:4])
            try:  # a helper may end between the listing and the signal
                proc.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                continue
            signalled.append(said)

    proc = train_through(cmd, trainer_env(), out / "metrics.jsonl", 3, scancel_usr1, timeout=300)
    said = proc.stdout + proc.stderr
    assert any("deepspeed.launcher.launch" in s for s in signalled) and len(signalled) >= 5, signalled
    assert proc.returncode == 3, said[-4000:]
    assert "checkpointed at step" in said and "a rank failed" not in said, said[-4000:]
    assert latest_complete_tag(out / "checkpoints") is not None
