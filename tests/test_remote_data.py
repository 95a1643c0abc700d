"""The trainer reading its shards from object storage (issue 35): `data.dir=s3://...` against the
tests' real S3 server (SeaweedFS), and `https://`-style through its filer's own HTTP (Range honoured).

A block is one ranged GET at the manifest's offsets, checked as a local block is; the same samples
in the same order, so the per-step losses equal a local run's bit for bit."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import explain, train
from s3_server import SECRET

pytestmark = pytest.mark.slow
RUN = ["train.max_steps=3", "train.log_every=1", "train.eval_every=3", "train.eval_sequences=32",
       "train.checkpoint_every=0", "model.max_position_embeddings=64"]


def logged(out_dir: Path) -> list[tuple[int, str, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in rows for k in ("train/loss", "eval/loss") if k in r]


@pytest.fixture(scope="module")
def bucket_copy(s3_server, shards):
    """The ``shards`` fixture's folder, object for object, in a bucket."""
    bucket, client = s3_server.bucket("train"), s3_server.client()
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"wiki/{path.relative_to(shards)}", Body=path.read_bytes())
    return bucket


@pytest.fixture(scope="module")
def local_losses(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("local_run")
    proc = train(shards, out, *RUN, ranks=2)
    assert proc.returncode == 0, explain(proc)
    return logged(out)


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_two_ranks_reading_a_bucket_log_the_losses_of_the_local_folder(s3_server, bucket_copy, local_losses,
                                                                       tmp_path, scheme):
    url = f"s3://{bucket_copy}/wiki" if scheme == "s3" else f"{s3_server.filer}/buckets/{bucket_copy}/wiki"
    proc = train(url, tmp_path / "run", *RUN, f"data.cache_dir={tmp_path / 'cache'}", ranks=2, env=s3_server.aws())
    assert proc.returncode == 0, explain(proc)
    assert logged(tmp_path / "run") == local_losses
    assert [k for _, k, _ in local_losses].count("eval/loss") == 1
    assert SECRET not in proc.stdout + proc.stderr
    exported = tmp_path / "run" / "hf_final"
    assert (exported / "tokenizer.json").is_file() and (exported / "model.safetensors").is_file()


def copy_to_bucket(s3_server, shards: Path, stem: str) -> str:
    bucket, client = s3_server.bucket(stem), s3_server.client()
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"wiki/{path.relative_to(shards)}", Body=path.read_bytes())
    return bucket


def test_a_denied_key_is_exit_2_before_any_rank_starts(s3_server, bucket_copy, tmp_path):
    url = f"s3://{bucket_copy}/wiki"
    proc = train(url, tmp_path / "run", *RUN, ranks=2, env={**s3_server.aws(), "AWS_SECRET_ACCESS_KEY": "wrong"})
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and f"data.dir: {url}/manifest.json: access denied (" in said, \
        explain(proc)
    assert "Traceback" not in said and SECRET not in said and not (tmp_path / "run" / "checkpoints").exists()


def test_a_shard_object_replaced_with_other_bytes_is_exit_2_naming_it(s3_server, shards, tmp_path):
    bucket = copy_to_bucket(s3_server, shards, "replaced")
    client = s3_server.client()
    victims = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="wiki/train-")["Contents"]]
    for key in victims:                               # every train shard: whichever is read first
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        client.put_object(Bucket=bucket, Key=key, Body=data[:1024] + bytes(reversed(data[1024:])))
    proc = train(f"s3://{bucket}/wiki", tmp_path / "run", *RUN, f"data.cache_dir={tmp_path / 'cache'}", ranks=2,
                 env=s3_server.aws())
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert f"s3://{bucket}/wiki/train-" in said and ": block " in said and "Traceback" not in proc.stderr, said[-3000:]


def test_a_store_gone_for_good_ends_the_run_with_exit_3_naming_it(own_s3_server, shards, tmp_path):
    """The server stopped mid-run: reads are retried for data.remote_timeout_s, then every process
    ends, exit 3 (requeue), naming the object; the last checkpoint stays the one to resume."""
    import os
    import signal
    import subprocess

    import psutil
    from conftest import train_cmd, trainer_env

    bucket = copy_to_bucket(own_s3_server, shards, "outage")
    out = tmp_path / "run"
    cmd = train_cmd(f"s3://{bucket}/wiki", out, *RUN, "train.max_steps=100000", "train.eval_every=0",
                    "data.remote_timeout_s=4", "data.cache_limit_gb=0", ranks=2)   # with a cache the whole
    # (tiny) data set would be local after the first shards' downloads, and the outage unseen
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=trainer_env(**own_s3_server.aws()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    try:
        for _ in range(1200):
            if metrics.is_file() and metrics.read_text().count("\n") >= 2 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        own_s3_server.stop()
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:                           # the launcher and every rank
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 3, f"{proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert f"s3://{bucket}/wiki/" in stderr and "the store looks unavailable" in stderr, stderr[-3000:]
    assert stderr.count("stopping: the data's store is unavailable (exit 3, requeue)") == 2, stderr[-5000:]
    assert "Traceback" not in stderr
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]


def test_killed_mid_run_and_resumed_at_one_rank_from_the_bucket_continues_the_same_samples(
        s3_server, bucket_copy, shards, tmp_path):
    """kill -9 of a 2-rank run reading the bucket, after its step-2 checkpoint; relaunched at 1 rank:
    the steps before the kill are the local run's bit for bit, those after it the local run's up to
    the summation order of another world size, on the same samples (resume is a seek, not a re-read)."""
    import os
    import signal
    import subprocess

    from conftest import train_cmd, trainer_env

    steps = ["train.max_steps=100000", "train.halt_at_step=6", "train.checkpoint_every=2", "train.eval_every=0",
             "train.log_every=1", "model.hidden_dropout=0", "model.attention_dropout=0",
             "model.max_position_embeddings=64"]
    straight = tmp_path / "straight"
    assert train(shards, straight, *steps, ranks=2).returncode == 0
    expected = {s: v for s, k, v in logged(straight) if k == "train/loss"}

    run = tmp_path / "run"
    cmd = train_cmd(f"s3://{bucket_copy}/wiki", run, *steps[:1], *steps[2:], f"data.cache_dir={tmp_path / 'c'}",
                    ranks=2)      # no halt: killed
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=trainer_env(**s3_server.aws()),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(1200):
            if (run / "checkpoints" / "step00000002" / "COMPLETE").is_file() or proc.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    complete = sorted(int(p.parent.name[4:]) for p in (run / "checkpoints").glob("step*/COMPLETE"))
    assert complete and complete[0] == 2 and complete[-1] < 6, complete         # killed mid-run
    resumed = train(f"s3://{bucket_copy}/wiki", run, *steps, "impl.zero_stage=0", f"data.cache_dir={tmp_path / 'c'}",
                    ranks=1, env=s3_server.aws())
    assert resumed.returncode == 0, explain(resumed)
    assert "converting" in (resumed.stdout + resumed.stderr).lower()      # 2 ranks -> 1 rank, ZeRO 0
    got = {s: v for s, k, v in logged(run) if k == "train/loss"}     # the last value logged for each step
    assert sorted(got) == list(range(1, 7))
    assert [got[s] for s in (1, 2)] == [expected[s] for s in (1, 2)]
    assert [got[s] for s in range(3, 7)] == pytest.approx([expected[s] for s in range(3, 7)], rel=1e-3)
    consumed = [json.loads((d / "checkpoints" / "step00000006" / "train_state.json").read_text())["samples_consumed"]
                for d in (run, straight)]
    assert consumed[0] == consumed[1] > 0


def test_a_nodes_ranks_download_each_shard_once_and_a_warm_cache_downloads_none(s3_server, bucket_copy, shards,
                                                                                 tmp_path):
    """Two ranks with a loader worker each, into a second epoch: each shard downloaded once for the
    node (checked against its sha256, named by it), later reads from the copy; a second run with the
    cache warm downloads nothing and logs the cold run's losses bit for bit (the tests above compare a
    bucket's losses with the local folder's)."""
    import hashlib

    cache = tmp_path / "cache"
    args = ["train.max_steps=125", "train.log_every=5", "train.eval_every=0", "train.checkpoint_every=0",
            "model.max_position_embeddings=64", "impl.num_workers=1", f"data.cache_dir={cache}"]
    url = f"s3://{bucket_copy}/wiki"
    first = train(url, tmp_path / "cold", *args, ranks=2, env=s3_server.aws())
    assert first.returncode == 0, explain(first)
    log = (cache / "downloads.log").read_text().splitlines()
    downloaded = [line.split()[2] for line in log]
    assert downloaded and len(downloaded) == len(set(downloaded)), log
    assert all(u.startswith(f"{url}/") and u.endswith(".tar") for u in downloaded)
    for path in cache.glob("*.tar"):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.stem
    second = train(url, tmp_path / "warm", *args, ranks=2, env=s3_server.aws())
    assert second.returncode == 0, explain(second)
    assert (cache / "downloads.log").read_text().splitlines() == log
    assert logged(tmp_path / "cold") == logged(tmp_path / "warm")
    assert len(logged(tmp_path / "cold")) >= 25


def test_the_cache_keeps_to_its_limit_by_evicting_the_least_recently_used(s3_server, bucket_copy, tmp_path,
                                                                          monkeypatch):
    import os

    from data_prep.shard_format import load_manifest
    from data_prep.storage import open_store
    from pretrain.data.shard_cache import ShardCache

    for key, value in s3_server.aws().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{bucket_copy}/wiki"
    store, manifest = open_store(url), load_manifest(url)
    a, b, c = sorted(manifest.shards_of("train"), key=lambda e: e.name)[:3]
    cache = ShardCache(tmp_path / "cache", limit_bytes=a.bytes + b.bytes)
    cache.fetch(store, a)
    cache.fetch(store, b)
    os.utime(cache.path(a), (1, 1))                      # a: used long ago
    assert cache.lookup(b) is not None
    cache.fetch(store, c)                                # over the limit: a goes, b (used) and c stay
    assert not cache.path(a).exists() and cache.path(b).is_file() and cache.path(c).is_file()
    assert cache.lookup(a) is None
    cache.fetch(store, c)                                # present: no second download
    assert [line.split()[2].rsplit("/", 1)[1] for line in (tmp_path / "cache" / "downloads.log").read_text().splitlines()] \
        == [a.name, b.name, c.name]
