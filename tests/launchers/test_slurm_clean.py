"""The cleaning stages on a real Slurm: launchers/slurm/submit_clean.sh submits the signatures,
exact and pairs arrays, the clusters job and the filter array (issues 51 and 63). With one signatures
task cancelled, the arrays after it are cancelled, the clusters job refuses naming the task and the
filter array never starts; re-submitting that index with --only (and --then-shard) completes the
cleaning, byte-identical to a one-process run, and shards it. A lost pairs task is named as such and
re-submitted with --from pairs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.slurm.cluster import REPO, run_python, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SUBMIT = REPO / "launchers" / "slurm" / "submit_clean.sh"
TASKS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Four files of real articles and a fifth of copies of some of them."""
    from data_prep.sample_corpus import wiki_articles, write_sample_corpus

    out = tmp_path_factory.mktemp("slurm_clean_corpus")
    write_sample_corpus(out, "txt", num_files=4, max_docs=400)
    copies = [text.upper() for _, text in wiki_articles()[:400:10]]
    (out / "copies.txt").write_text("\n\n".join(t.replace("\n\n", "\n") for t in copies) + "\n", encoding="utf-8")
    return out


def clean_args(corpus: Path) -> list[str]:
    # copies.txt is 20 kB of blank-line-separated articles: under --txt-mode auto's 32 KiB, one document
    return ["--input", f"{corpus}/*.txt", "--txt-mode", "blocks", "--group-chars", "40000"]


def top_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*")) if p.is_file()}


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<no log {path}>"


def test_stages_on_slurm_match_one_process_and_resubmit_a_lost_task(slurm_cluster, corpus, bert_uncased_dir, tmp_path):
    cluster = slurm_cluster
    env = cluster.client_env()
    local = tmp_path / "local"
    run_python(env, "-m", "data_prep", "clean", *clean_args(corpus), "--out", str(local))
    report = json.loads((local / "report.json").read_text())
    assert report["removed"]["exact_duplicate"]["documents"] == 40 and len(report["files"]) > 2 * TASKS

    out, logs = tmp_path / "clean", tmp_path / "logs"
    logs.mkdir()
    r = cluster.run(
        str(SUBMIT),
        "--tasks",
        str(TASKS),
        "--hold",
        f"--output={logs}/%x-%A_%a.out",
        "--",
        *clean_args(corpus),
        "--out",
        str(out),
    )
    sig, exact, pairs, clusters_job, filt = map(int, r.stdout.split())
    cluster.run("scancel", f"{sig}_1")  # a task lost before it ran
    for job in (sig, exact, pairs, clusters_job, filt):
        cluster.run("scontrol", "release", str(job))
    tasks = {t.array_task_id: t for t in cluster.wait(sig, timeout=180)}
    assert set(tasks) == {0, 2} and all(t.ok for t in tasks.values()), tasks
    refused_log = _refused(cluster, clusters_job, logs)
    assert re.search(r"the signatures of task\(s\) 1 of 3 are missing", refused_log), refused_log
    assert "submit_clean.sh --only 1" in refused_log, refused_log
    for job in (exact, pairs, filt):  # never started
        assert all(t.state == "CANCELLED" for t in cluster.wait(job, timeout=60)), job
    assert not (out / "report.json").exists()

    r = cluster.run(
        str(SUBMIT),
        "--tasks",
        str(TASKS),
        "--only",
        "1",
        "--cpus-per-task=1",
        f"--output={logs}/%x-%A_%a.out",
        "--",
        *clean_args(corpus),
        "--out",
        str(out),
        "--then-shard",
        "--",
        "--tokenizer",
        str(bert_uncased_dir),
        "--out",
        str(tmp_path / "shards"),
        "--seq-len",
        "64",
    )
    (sig, exact, pairs, clusters_job, filt), (array, finalize) = [
        list(map(int, line.split())) for line in r.stdout.splitlines()
    ]
    for job in (sig, exact, pairs, clusters_job, filt, array, finalize):
        records = cluster.wait(job, timeout=240)
        logs_text = "\n".join(read_log(p) for p in logs.glob("*.out"))
        assert all(t.ok for t in records), f"{job}: {[(t.state, t.exit_code) for t in records]}\n{logs_text[-4000:]}"
    assert top_files(out) == top_files(local)  # part files and report.json, byte for byte
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["settings"]["cleaning"][0]["documents_out"] == report["totals"]["out"]["documents"]
    assert manifest["totals"]["train"]["documents"] == report["totals"]["out"]["documents"]


def _refused(cluster, clusters_job: int, logs: Path) -> str:
    """The clusters job's log, once it has failed."""
    (refused,) = cluster.wait(clusters_job, timeout=120)
    text = "\n".join(read_log(p) for p in logs.glob(f"mlm-clean-clusters-{clusters_job}_*.out"))
    assert refused.state == "FAILED", f"{refused.state}\n{text}"
    return text


def test_a_lost_pairs_task_is_named_and_resubmitted_from_pairs(slurm_cluster, corpus, tmp_path):
    cluster = slurm_cluster
    local = tmp_path / "local"
    run_python(cluster.client_env(), "-m", "data_prep", "clean", *clean_args(corpus), "--out", str(local))
    out, logs = tmp_path / "clean", tmp_path / "logs"
    logs.mkdir()
    common = [*clean_args(corpus), "--out", str(out)]
    r = cluster.run(str(SUBMIT), "--tasks", str(TASKS), "--hold", f"--output={logs}/%x-%A_%a.out", "--", *common)
    jobs = dict(zip(("signatures", "exact", "pairs", "clusters", "filter"), map(int, r.stdout.split())))
    cluster.run("scancel", f"{jobs['pairs']}_2")
    for job in jobs.values():
        cluster.run("scontrol", "release", str(job))
    assert {t.array_task_id for t in cluster.wait(jobs["pairs"], timeout=240) if t.ok} == {0, 1}
    refused_log = _refused(cluster, jobs["clusters"], logs)
    assert "the near-duplicate pairs of task(s) 2 of 3 are missing" in refused_log, refused_log
    assert "submit_clean.sh --from pairs --only 2" in refused_log, refused_log
    r = cluster.run(
        str(SUBMIT),
        "--tasks",
        str(TASKS),
        "--from",
        "pairs",
        "--only",
        "2",
        f"--output={logs}/%x-%A_%a.out",
        "--",
        *common,
    )
    ids = r.stdout.split()
    assert ids[:2] == ["-", "-"], r.stdout
    for job in map(int, ids[2:]):
        assert all(t.ok for t in cluster.wait(job, timeout=240)), job
    assert top_files(out) == top_files(local)


def test_submit_clean_rejects_bad_arguments(slurm_cluster, corpus, tmp_path):
    out = ["--out", str(tmp_path / "clean")]
    cases = [
        (["--", *clean_args(corpus), *out], "--tasks K"),
        (["--tasks", "3", "--only", "3", "--", *clean_args(corpus), *out], "task 3 is out of range"),
        (["--tasks", "3", "--", *clean_args(corpus)], "must include --out"),
        (["--tasks", "3", "--", *clean_args(corpus), *out, "--stage", "filter"], "set by this script"),
        (["--tasks", "3", "--from", "clusters", "--only", "1", "--", *clean_args(corpus), *out], "--only names"),
        (
            ["--tasks", "3", "--", *clean_args(corpus), *out, "--then-shard", "--tokenizer", "x"],
            "--then-shard wants --",
        ),
    ]
    for argv, message in cases:
        r = slurm_cluster.run(str(SUBMIT), *argv, check=False)
        assert r.returncode == 2 and message in r.stderr, (argv, r.stderr)
    assert not slurm_cluster.run("squeue", "-h").stdout.strip()
    assert not (tmp_path / "clean").exists()
