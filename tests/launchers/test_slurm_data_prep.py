"""The data-prep array job on a real Slurm: launchers/slurm/submit_data_prep.sh submits one
`data_prep shard` task per index plus a dependent finalize. Its shards must be byte-identical to the
same data prepared locally by a single task (the shards do not depend on the number of tasks); a
task that never ran makes finalize refuse and name it; re-submitting just that index completes the
set. Submitted without --cpus-per-task, the tasks must fit the 2-CPU test nodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from data_prep.common.shards import sha256_file
from tests.slurm.cluster import REPO, run_python, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SUBMIT = REPO / "launchers" / "slurm" / "submit_data_prep.sh"
TASKS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from data_prep.sample_corpus import write_sample_corpus

    out = tmp_path_factory.mktemp("slurm_corpus")
    write_sample_corpus(out, "txt", num_files=4, max_docs=400)
    return out


@pytest.fixture(scope="module")
def shard_args(corpus, bert_uncased_dir) -> list[str]:
    """Everything but --out; small shards so each task writes several, small groups (each file its own
    bundle of 2 groups) so that each task owns some."""
    return [
        "--input",
        f"{corpus}/*.txt",
        "--group-chars",
        "40000",
        "--tokenizer",
        str(bert_uncased_dir),
        "--seq-len",
        "64",
        "--seed",
        "7",
        "--validation-fraction",
        "0.05",
        "--shard-size",
        "64",
        "--block-size",
        "16",
    ]


@pytest.fixture(scope="module")
def local_reference(shard_args, tmp_path_factory, slurm_cluster) -> Path:
    """The same data prepared here by one task, then finalized."""
    out = tmp_path_factory.mktemp("local") / "shards"
    env = slurm_cluster.client_env()
    run_python(env, "-m", "data_prep", "shard", *shard_args, "--out", str(out), "--num-tasks", "1", "--task-index", "0")
    run_python(env, "-m", "data_prep", "finalize", str(out))
    return out


def shard_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.glob("*.tar"))}


def submit(cluster, shard_args, out: Path, *extra: str) -> tuple[int, int]:
    r = cluster.run(str(SUBMIT), "--tasks", str(TASKS), *extra, "--", *shard_args, "--out", str(out))
    array_job, finalize_job = map(int, r.stdout.split())
    return array_job, finalize_job


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<no log {path}>"


def test_array_job_matches_local_run_and_resubmits_a_missing_task(slurm_cluster, shard_args, local_reference, tmp_path):
    cluster = slurm_cluster
    out, logs = tmp_path / "shards", tmp_path / "logs"  # not made here: the helper makes it
    reference = shard_hashes(local_reference)
    assert len(reference) > 2 * TASKS, "want several shards per task"

    # Submitted held, so that task 1 can be cancelled before it runs: a task lost to preemption or a
    # dead node. afterany lets finalize run anyway, and it must refuse, naming the task. No
    # --cpus-per-task: the helper must ask for what the 2-CPU nodes have. --output names the array
    # tasks' logs only.
    array_job, finalize_job = submit(cluster, shard_args, out, "--hold", f"--output={logs}/prep-%A_%a.out")
    cluster.run("scancel", f"{array_job}_1")
    cluster.run("scontrol", "release", str(array_job))
    cluster.run("scontrol", "release", str(finalize_job))
    tasks = {r.array_task_id: r for r in cluster.wait(array_job, timeout=120)}
    # A pending element cancelled out of an array leaves no record: only 0 and 2 ran.
    assert set(tasks) == {0, 2}, tasks
    for i in (0, 2):
        task_log = read_log(logs / f"prep-{array_job}_{i}.out")
        assert tasks[i].ok, f"task {i}: {tasks[i].state} {tasks[i].exit_code}\n{task_log}"
        assert f"task={i} " in task_log and "cpus=2 " in task_log, task_log
    (fin,) = cluster.wait(finalize_job, timeout=120)
    fin_log = read_log(logs / f"mlm-data-finalize-{finalize_job}.out")
    assert fin.state == "FAILED" and fin.exit_code != "0:0", f"{fin.state} {fin.exit_code}\n{fin_log}"
    assert re.search(r"missing task indices: 1\b", fin_log), fin_log
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        [f"prep-{array_job}_0.out", f"prep-{array_job}_2.out", f"mlm-data-finalize-{finalize_job}.out"]
    )
    assert not (out / "manifest.json").exists()
    # What the two tasks that ran wrote is already byte-identical to the one-task run.
    partial = shard_hashes(out)
    written = {e["name"] for i in (0, 2) for e in json.loads((out / f"task-{i:05d}.json").read_text())["shards"]}
    assert partial and set(partial) == written
    assert partial == {n: h for n, h in reference.items() if n in written}

    # Re-submit only the missing index; the new finalize completes the set.
    array_job, finalize_job = submit(
        cluster, shard_args, out, "--only", "1", "--cpus-per-task=1", f"--output={logs}/%x-%j.out"
    )
    (task1,) = cluster.wait(array_job, timeout=120)
    assert task1.array_task_id == 1 and task1.ok, (
        f"{task1.state} {task1.exit_code}\n{read_log(logs / f'mlm-data-prep-{task1.job_id}.out')}"
    )
    assert "cpus=1 " in read_log(logs / f"mlm-data-prep-{task1.job_id}.out")
    (fin,) = cluster.wait(finalize_job, timeout=120)
    fin_log = read_log(logs / f"mlm-data-finalize-{finalize_job}.out")
    assert fin.ok, f"{fin.state} {fin.exit_code}\n{fin_log}"
    assert "all shards verified" in fin_log, fin_log  # finalize.sbatch re-hashes every shard

    assert shard_hashes(out) == reference
    ours = json.loads((out / "manifest.json").read_text())
    theirs = json.loads((local_reference / "manifest.json").read_text())
    assert ours["num_tasks"] == TASKS and theirs["num_tasks"] == 1
    assert ours["shards"] == theirs["shards"]
    assert ours["totals"] == theirs["totals"]


def test_submit_helper_rejects_bad_arguments(slurm_cluster, shard_args, tmp_path):
    """Mistakes are caught before anything is queued, with the reason."""
    out = ["--out", str(tmp_path / "shards")]
    cases = [
        (["--only", "1", "--", *shard_args, *out], "--tasks K"),
        (["--tasks", "3", "--only", "3", "--", *shard_args, *out], "task 3 is out of range"),
        (["--tasks", "3", "--only", "1-2", "--", *shard_args, *out], "comma-separated"),
        (["--tasks", "3", "--", *shard_args], "must include --out DIR"),
        (["--tasks", "3", "--", *shard_args, *out, "--num-tasks", "3"], "set by this script"),
        (["--tasks", "3"], "no data_prep shard arguments"),
    ]
    for argv, message in cases:
        r = slurm_cluster.run(str(SUBMIT), *argv, check=False)
        assert r.returncode == 2 and message in r.stderr, (argv, r.stderr)
    assert not slurm_cluster.run("squeue", "-h").stdout.strip()
    assert not (tmp_path / "shards").exists()


def test_array_job_writes_to_a_bucket_with_the_submitters_aws_variables(
    slurm_cluster, s3_server, shard_args, local_reference, tmp_path
):
    """`--out s3://...` through the submit helper (issue 34): each task and finalize get the AWS
    variables of the submitting shell (sbatch's --export=ALL) and write the objects a local run writes."""
    bucket = s3_server.bucket("slurm")
    aws = {k: v for k, v in s3_server.env().items() if k.startswith("AWS_")}
    env = slurm_cluster.client_env(**aws)
    r = slurm_cluster.run(
        str(SUBMIT),
        "--tasks",
        str(TASKS),
        f"--output={tmp_path}/%x-%j.out",
        "--",
        *shard_args,
        "--out",
        f"s3://{bucket}/wiki",
        env=env,
    )
    array_job, finalize_job = map(int, r.stdout.split())
    assert all(t.ok for t in slurm_cluster.wait(array_job, timeout=180))
    (fin,) = slurm_cluster.wait(finalize_job, timeout=180)
    fin_log = read_log(tmp_path / f"mlm-data-finalize-{finalize_job}.out")
    assert fin.ok and f"s3://{bucket}/wiki: all shards verified" in fin_log, fin_log
    objects = s3_server.objects(bucket, "wiki")
    assert {n: sha256_file_bytes(b) for n, b in objects.items() if n.endswith(".tar")} == shard_hashes(local_reference)
    assert not any(p.name.startswith("s3:") for p in REPO.iterdir())


def sha256_file_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
