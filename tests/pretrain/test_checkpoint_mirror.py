"""Checkpoints mirrored to a bucket (issue 36, ``train.checkpoint_mirror``), against the tests' real
S3 server (SeaweedFS): what reaches the mirror and in what state, keep_checkpoints there, a mirror
that cannot be written (exit 2 before start) and one that goes away mid-run (exit 6, said last).

Time: about 1-1.5 minutes: a real S3 server, and a run killed with kill -9 mid-upload
through DeepSpeed's per-node launcher (its process group is killed, so it is a launch of its own)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, explain, train, train_cmd, train_through, trainer_env
from s3_server import SECRET

pytestmark = pytest.mark.slow
RUN = ["train.log_every=1", "train.eval_every=0", "train.eval_sequences=32", "model.max_position_embeddings=64"]


def local_files(tag_folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(tag_folder).as_posix(): p.read_bytes()
        for p in sorted(tag_folder.rglob("*"))
        if p.is_file() and p.relative_to(tag_folder).parts[0] != "universal"
    }


def test_every_complete_checkpoint_reaches_the_mirror_whole_and_keep_applies_there(s3_server, shards, tmp_path):
    bucket = s3_server.bucket("mirror")
    out = tmp_path / "run"
    proc = train(
        shards,
        out,
        *RUN,
        "train.max_steps=6",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=2",
        f"train.checkpoint_mirror=s3://{bucket}/runs/a",
        ranks=2,
        env=s3_server.aws(),
    )
    assert proc.returncode == 0, explain(proc)
    mirrored = s3_server.objects(bucket, "runs/a")
    tags = sorted({name.split("/")[0] for name in mirrored if name.startswith("step")})
    assert tags == ["step00000004", "step00000006"], sorted(mirrored)  # step 2 pruned, as locally
    assert mirrored["latest"] == b"step00000006"
    for tag in tags:
        want = local_files(out / "checkpoints" / tag)
        assert {k: v for k, v in mirrored.items() if k.startswith(tag + "/")} == {
            f"{tag}/{k}": v for k, v in want.items()
        }
        assert any(name.startswith("zero_pp_rank_1_") for name in want), sorted(want)  # every rank's files
    export = {p.relative_to(out).as_posix(): p.read_bytes() for p in (out / "hf_final").rglob("*") if p.is_file()}
    assert {k: v for k, v in mirrored.items() if k.startswith("hf_final/")} == export  # the final export
    assert export["hf_final/EXPORTED_FROM"] == b"step00000006\n"
    said = proc.stdout + proc.stderr
    assert "checkpoint mirror: step00000006 is complete in s3://" in said
    assert SECRET not in said
    assert not [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


@pytest.mark.parametrize(
    "mirror,why",
    [("https://example.com/run", "is read-only"), ("gs://bucket/run", "gs://"), ("s3://{bucket}/run", "access denied")],
)
def test_a_mirror_that_cannot_be_written_is_exit_2_before_any_rank_starts(s3_server, shards, tmp_path, mirror, why):
    url = mirror.format(bucket=s3_server.bucket("denied"))
    proc = train(
        shards,
        tmp_path / "run",
        *RUN,
        "train.max_steps=2",
        f"train.checkpoint_mirror={url}",
        env={**s3_server.aws(), "AWS_SECRET_ACCESS_KEY": "wrong"},
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "train.checkpoint_mirror" in said and why in said, explain(proc)
    assert "Traceback" not in said and not (tmp_path / "run" / "checkpoints").exists()


def test_a_mirror_gone_mid_run_leaves_the_run_going_and_ends_it_with_exit_6_said_last(own_s3_server, shards, tmp_path):
    """The server stopped after the first step: the final checkpoint's upload fails after
    data.remote_timeout_s of retries; the run still finishes and exports locally, and its last line
    and exit code (6) say that the mirror is behind."""
    bucket = own_s3_server.bucket("gone")
    out = tmp_path / "run"
    cmd = train_cmd(
        shards,
        out,
        *RUN,
        "train.max_steps=4",
        "train.checkpoint_every=0",
        "data.remote_timeout_s=3",
        f"train.checkpoint_mirror=s3://{bucket}/run",
    )
    proc = train_through(
        cmd, trainer_env(**own_s3_server.aws()), out / "metrics.jsonl", 1, own_s3_server.stop, timeout=300
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 6, said[-3000:]
    assert (out / "checkpoints" / "step00000004" / "COMPLETE").is_file() and (out / "hf_final").is_dir()
    last = proc.stdout.strip().splitlines()[-1]  # the log's last line
    assert f"the checkpoint mirror s3://{bucket}/run is behind: the newest checkpoint, step00000004" in last, said[
        -3000:
    ]
    assert "Traceback" not in said


def losses(out_dir: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}  # the last value of each step


STEPS = [*RUN, "train.max_steps=6", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def straight(shards, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run the resumed ones are compared with."""
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = train(shards, out, *STEPS, ranks=2)
    assert proc.returncode == 0, explain(proc)
    return out


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_run_whose_checkpoints_are_gone_resumes_from_the_mirror(s3_server, shards, straight, tmp_path, ranks):
    """Halted at step 4 with a mirror, its local checkpoints deleted (a requeue onto another node's
    disk), relaunched: it resumes from the mirror and ends with the uninterrupted run's losses, bit
    for bit at 2 ranks; at 1 rank (ZeRO 0, converted) on the same samples."""
    steps = STEPS
    bucket = s3_server.bucket("resume")
    mirror = f"train.checkpoint_mirror=s3://{bucket}/run"
    out = tmp_path / "run"
    first = train(shards, out, *steps, "train.halt_at_step=4", mirror, ranks=2, env=s3_server.aws())
    assert first.returncode == 0, explain(first)
    shutil.rmtree(out / "checkpoints")
    more = ["impl.zero_stage=0"] if ranks == 1 else []
    second = train(shards, out, *steps, *more, mirror, ranks=ranks, env=s3_server.aws())
    assert second.returncode == 0, explain(second)
    said = second.stdout + second.stderr
    assert f"resuming from the checkpoint mirror: s3://{bucket}/run/step00000004 downloaded" in said, said[-3000:]
    got, want = losses(out), losses(straight)
    assert sorted(got) == list(range(1, 7))
    if ranks == 2:
        assert got == want
    else:
        assert [got[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]
        assert [got[s] for s in (5, 6)] == pytest.approx([want[s] for s in (5, 6)], rel=1e-3)
    assert sorted(s3_server.objects(bucket, "run/step00000006")) != []


def test_a_damaged_mirrored_checkpoint_is_passed_over_for_the_previous_one(s3_server, shards, tmp_path):
    bucket = s3_server.bucket("harm")
    steps = [*RUN, "train.max_steps=4", "train.checkpoint_every=2", f"train.checkpoint_mirror=s3://{bucket}/run"]
    out = tmp_path / "run"
    assert train(shards, out, *steps, env=s3_server.aws()).returncode == 0
    want = losses(out)
    shutil.rmtree(out / "checkpoints")
    client = s3_server.client()
    key = "run/step00000004/mp_rank_00_model_states.pt"
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=data[:-100] + bytes(100))
    again = train(shards, out, *steps, env=s3_server.aws())
    assert again.returncode == 0, explain(again)
    said = again.stdout + again.stderr
    assert (
        f"mirrored checkpoint s3://{bucket}/run/step00000004 is damaged: s3://{bucket}/run/step00000004/"
        f"mp_rank_00_model_states.pt is not the file that was written"
    ) in said, said[-3000:]
    assert f"s3://{bucket}/run/step00000002 downloaded" in said, said[-3000:]
    assert losses(out) == want  # steps 3 and 4 trained again from step 2, as before


def kill_while_step4_uploads(s3_server, shards, out: Path, steps: list[str], bucket: str, also) -> None:
    """A job whose upload of step 4 the test hook holds at 3 files, killed with its process group
    (kill -9) once those are in the bucket and ``also()`` holds."""
    env = trainer_env(**s3_server.aws(), MLM_TEST_MIRROR_STALL="step00000004:3")
    proc = subprocess.Popen(
        train_cmd(shards, out, *steps),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while (
            (len(s3_server.objects(bucket, "run/step00000004")) < 3 or not also())
            and time.monotonic() < deadline
            and proc.poll() is None
        ):
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_a_job_killed_mid_upload_resumes_from_the_previous_mirrored_checkpoint(s3_server, shards, tmp_path):
    """kill -9 while step 4's upload has 3 files in the bucket (held there by the test hook): its
    local checkpoints gone, the relaunched job never takes the half-uploaded tag (no COMPLETE), takes
    step 2, trains steps 3 and 4 again to the same losses, and completes step 4 in the mirror."""
    bucket = s3_server.bucket("killed")
    steps = [*RUN, "train.max_steps=4", "train.checkpoint_every=2", f"train.checkpoint_mirror=s3://{bucket}/run"]
    out = tmp_path / "run"
    kill_while_step4_uploads(s3_server, shards, out, steps, bucket, lambda: True)
    half = s3_server.objects(bucket, "run/step00000004")
    assert len(half) == 3 and "COMPLETE" not in half, sorted(half)
    assert "step00000002/COMPLETE" in s3_server.objects(bucket, "run")
    want = losses(out)
    assert sorted(want) == [1, 2, 3, 4]
    shutil.rmtree(out / "checkpoints")
    again = train(shards, out, *steps, env=s3_server.aws())
    assert again.returncode == 0, explain(again)
    said = again.stdout + again.stderr
    assert f"s3://{bucket}/run/step00000002 downloaded" in said and "step00000004 downloaded" not in said, said[-3000:]
    assert losses(out) == want
    mirrored = s3_server.objects(bucket, "run")
    assert "step00000004/COMPLETE" in mirrored and mirrored["latest"] == b"step00000004"


def test_continuing_a_finished_run_keeps_its_mirrored_export(s3_server, shards, tmp_path):
    """A finished run is continued (a longer train.max_steps) and halted before its new end: the first
    run's mirrored export stays. Before, the continued run's first checkpoint pruned ``hf_final/`` (and
    ``report/``) from the mirror as if they were unfinished checkpoints older than it."""
    bucket = s3_server.bucket("continued")
    out, mirror = tmp_path / "run", f"train.checkpoint_mirror=s3://{bucket}/runs/c"
    first = train(
        shards,
        out,
        *RUN,
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        mirror,
        ranks=2,
        env=s3_server.aws(),
    )
    assert first.returncode == 0, explain(first)
    export = {k: v for k, v in s3_server.objects(bucket, "runs/c").items() if k.startswith("hf_final/")}
    assert export["hf_final/EXPORTED_FROM"] == b"step00000004\n"
    more = train(
        shards,
        out,
        *RUN,
        "train.max_steps=8",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        "train.halt_at_step=6",
        mirror,
        ranks=2,
        env=s3_server.aws(),
    )
    assert more.returncode == 0, explain(more)
    mirrored = s3_server.objects(bucket, "runs/c")
    assert sorted({k.split("/")[0] for k in mirrored if k.startswith("step")}) == ["step00000006"]  # keep=1
    assert {k: v for k, v in mirrored.items() if k.startswith("hf_final/")} == export


def test_a_relaunch_after_a_kill_during_the_final_upload_completes_the_mirror(s3_server, shards, tmp_path):
    """kill -9 while the final checkpoint's upload is held at 3 files, after the export was written
    locally. Before, the relaunch found nothing to train, said "done" and exited 0 with the mirror's
    newest tag incomplete, no hf_final/ and ``latest`` a checkpoint back. Now it uploads what the
    earlier job left unmirrored and ends with the mirror whole."""
    bucket = s3_server.bucket("finalkill")
    steps = [*RUN, "train.max_steps=4", "train.checkpoint_every=2", f"train.checkpoint_mirror=s3://{bucket}/run"]
    out = tmp_path / "run"
    marker = out / "hf_final" / "EXPORTED_FROM"
    kill_while_step4_uploads(s3_server, shards, out, steps, bucket, marker.is_file)
    mirrored = s3_server.objects(bucket, "run")
    assert "step00000004/COMPLETE" not in mirrored and mirrored["latest"] == b"step00000002", sorted(mirrored)
    assert marker.read_text() == "step00000004\n" and not any(k.startswith("hf_final/") for k in mirrored)
    again = train(shards, out, *steps, env=s3_server.aws())
    said = again.stdout + again.stderr
    assert again.returncode == 0, explain(again)
    assert "step00000004 is complete here but not in" in said and "hf_final is not in" in said, said[-3000:]
    mirrored = s3_server.objects(bucket, "run")
    assert "step00000004/COMPLETE" in mirrored and mirrored["latest"] == b"step00000004"
    assert mirrored["hf_final/EXPORTED_FROM"] == b"step00000004\n"
    assert {k[len("hf_final/") :]: v for k, v in mirrored.items() if k.startswith("hf_final/")} == {
        p.relative_to(out / "hf_final").as_posix(): p.read_bytes() for p in (out / "hf_final").rglob("*") if p.is_file()
    }
