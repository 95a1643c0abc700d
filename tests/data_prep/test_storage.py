"""Data prep to and from object storage (issue 34), against a real S3 server (SeaweedFS, started by
``tests/s3_server.py`` on 127.0.0.1) and its filer's own HTTP for an ``https://``-style folder.

Every command runs as ``python -m data_prep`` (its module as ``__main__``, forked from the tests'
rank pool: tests/rank_pool.py) with only the server's AWS variables, the killed upload as a process
of its own; the objects are compared byte for byte with a local run of the same settings.

Time: about 1 minute: a real S3 server, and a data-prep upload killed mid-run as a process of
its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_module
from s3_server import SECRET

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SHARD = [
    "--seq-len",
    "64",
    "--shard-size",
    "64",
    "--block-size",
    "16",
    "--validation-fraction",
    "0.05",
    "--num-tasks",
    "2",
]


def data_prep(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_module("data_prep", *args, env=env, timeout=300)
    assert SECRET not in proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, f"{args} -> {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, bert_uncased_dir):
    from data_prep.sample_corpus import write_sample_corpus

    root = tmp_path_factory.mktemp("s3corpus")
    write_sample_corpus(root / "corpus", "txt", num_files=4)
    return root / "corpus", bert_uncased_dir


@pytest.fixture(scope="module")
def local_run(corpus, tmp_path_factory):
    """The same settings into a local folder: what the bucket must hold, byte for byte."""
    from data_prep.finalize import finalize
    from data_prep.settings import ShardSettings
    from data_prep.shard import run_shard

    text, tokenizer = corpus
    out = tmp_path_factory.mktemp("s3local") / "shards"
    for task in range(2):
        run_shard(
            ShardSettings(
                inputs=[f"{text}/*.txt"],
                tokenizer=str(tokenizer),
                out=str(out),
                seq_len=64,
                shard_size=64,
                block_size=16,
                validation_fraction=0.05,
                num_tasks=2,
                task_index=task,
            )
        )
    finalize(out)
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def task_0_signalled(s3_server, bucket: str, args: list[str], env: dict, uploads: int, sig: int):
    """``data_prep shard ... --task-index 0`` as a process of its own, sent ``sig`` once ``uploads``
    of its shards are published (their progress records listed); (the process, its stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_prep", *args, "--task-index", "0"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    client, deadline = s3_server.client(), time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        listed = client.list_objects_v2(Bucket=bucket, Prefix="run/.progress-t00000/").get("Contents", [])
        if len(listed) >= uploads:
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    return proc, err.decode(errors="replace")


def kept_from_before(rerun: subprocess.CompletedProcess) -> int:
    """The shards a rerun said it kept ("N kept from an earlier run")."""
    return int(rerun.stderr.split(" kept from an earlier run")[0].rsplit(" ", 1)[-1])


@pytest.fixture(scope="module")
def bucket_run(s3_server, corpus, tmp_path_factory):
    """Task 0 killed after a few uploads and run again, task 1, finalize: all into s3://BUCKET/run."""
    text, tokenizer = corpus
    bucket = s3_server.bucket("shards")
    # $TMPDIR of its own: the killed task's staged shard stays there (SIGKILL runs no cleanup)
    url, env = f"s3://{bucket}/run", {**s3_server.env(), "TMPDIR": str(tmp_path_factory.mktemp("staged"))}
    args = ["shard", "--input", f"{text}/*.txt", "--tokenizer", str(tokenizer), "--out", url, *SHARD]
    killed, _ = task_0_signalled(s3_server, bucket, args, env, 3, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL, "task 0 finished before it could be killed: give it more input"
    left = s3_server.objects(bucket, "run")
    assert "task-00000.json" not in left and any(k.endswith(".tar") for k in left)
    rerun = data_prep(*args, "--task-index", "0", env=env)
    assert kept_from_before(rerun) >= 1, rerun.stderr[-2000:]
    data_prep(*args, "--task-index", "1", env=env)
    data_prep("finalize", url, env=env)
    return bucket, url


def test_a_killed_and_rerun_upload_leaves_the_bytes_of_a_local_run(s3_server, bucket_run, local_run):
    bucket, _ = bucket_run
    objects = s3_server.objects(bucket, "run")
    assert sorted(objects) == sorted(local_run)
    assert [k for k in objects if objects[k] != local_run[k]] == []
    assert "manifest.json" in objects and sum(k.endswith(".tar") for k in objects) > 10
    assert all(SECRET.encode() not in data for data in objects.values())


def test_a_stopped_upload_leaves_nothing_staged_and_the_same_command_finishes_it(s3_server, corpus, tmp_path):
    """SIGTERM (scancel, a time limit) mid-upload: exit 143 saying so, no unpublished shard left in
    $TMPDIR (a random folder no rerun finds again: it was left there), and a rerun keeps what was
    published."""
    text, tokenizer = corpus
    bucket = s3_server.bucket("stopped")
    staging = tmp_path / "tmp"
    staging.mkdir()
    env = {**s3_server.env(), "TMPDIR": str(staging)}
    args = ["shard", "--input", f"{text}/*.txt", "--tokenizer", str(tokenizer), "--out", f"s3://{bucket}/run", *SHARD]
    stopped, err = task_0_signalled(s3_server, bucket, args, env, 2, signal.SIGTERM)
    assert stopped.returncode == 143 and "stopped by SIGTERM" in err, (stopped.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert not list(staging.glob("data_prep-upload-*")), list(staging.rglob("*"))
    rerun = data_prep(*args, "--task-index", "0", env=env)
    assert kept_from_before(rerun) >= 1, rerun.stderr[-2000:]
    assert not list(staging.glob("data_prep-upload-*")), list(staging.rglob("*"))


def test_verify_and_inspect_read_the_bucket_and_name_a_replaced_object(s3_server, bucket_run):
    bucket, url = bucket_run
    env = s3_server.env()
    assert data_prep("verify", url, env=env).stdout.strip() == f"{url}: all shards verified"
    inspected = data_prep("inspect", url, "--samples", "1", env=env).stdout
    assert inspected.startswith(f"{url}: seq_len 64, uint16, block_size 16, 2 task(s)") and "[CLS]" in inspected

    client = s3_server.client()
    victim = "run/train-s00000-g00000-00001.tar"
    original = client.get_object(Bucket=bucket, Key=victim)["Body"].read()
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(reversed(original)))  # same size, other bytes
    try:
        proc = data_prep("verify", url, env=env, check=False)
        assert proc.returncode == 2 and "BAD train-s00000-g00000-00001.tar: sha256 differs" in proc.stderr
    finally:
        client.put_object(Bucket=bucket, Key=victim, Body=original)


def test_an_http_folder_that_honours_range_is_verified_and_inspected(s3_server, bucket_run):
    """SeaweedFS's filer serves the bucket over plain HTTP with Range: the https:// code path."""
    bucket, _ = bucket_run
    url = f"{s3_server.filer}/buckets/{bucket}/run"
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "unused-here"}
    assert data_prep("verify", url, env=env).stdout.strip() == f"{url}: all shards verified"
    assert "--- train-s00000-g00000-00000.tar sequence 0 ---" in data_prep("inspect", url, env=env).stdout
    refused = data_prep("finalize", url, env=env, check=False)
    assert refused.returncode == 2 and f"{url}" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.parametrize("case", ["wrong secret", "unknown bucket", "no credentials", "unsupported scheme"])
def test_bad_locations_exit_2_naming_the_url_before_any_work(s3_server, corpus, tmp_path, case):
    text, tokenizer = corpus
    bucket = s3_server.bucket("denied")
    url = {"unknown bucket": "s3://no-such-bucket-here/run", "unsupported scheme": "gs://bucket/run"}.get(
        case, f"s3://{bucket}/run"
    )
    env = s3_server.env()
    if case == "wrong secret":
        env["AWS_SECRET_ACCESS_KEY"] = "not-" + SECRET
    if case == "no credentials":
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep",
            "shard",
            "--input",
            f"{text}/*.txt",
            "--tokenizer",
            str(tokenizer),
            "--out",
            url,
            *SHARD,
            "--task-index",
            "0",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said[-3000:]
    assert f"data_prep: error: {url}" in said
    expected = {
        "wrong secret": "access denied (SignatureDoesNotMatch)",
        "unknown bucket": "no such bucket",
        "no credentials": "no AWS credentials found",
        "unsupported scheme": "gs:// is not supported",
    }[case]
    assert expected in said and SECRET not in said
    assert list(tmp_path.iterdir()) == []  # no local folder named "gs:" or "s3:"
    assert s3_server.objects(bucket) == {}


def test_inputs_read_from_a_bucket_glob_give_the_shards_of_local_inputs(s3_server, corpus, local_run, tmp_path):
    text, tokenizer = corpus
    bucket, client = s3_server.bucket("inputs"), s3_server.client()
    for path in sorted(text.glob("*.txt")):
        client.put_object(Bucket=bucket, Key=f"raw/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="raw/notes.md", Body=b"not an input")  # not matched
    out = tmp_path / "shards"
    data_prep(
        "shard",
        "--input",
        f"s3://{bucket}/raw/*.txt",
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        *SHARD,
        "--task-index",
        "0",
        env=s3_server.env(),
    )
    data_prep(
        "shard",
        "--input",
        f"s3://{bucket}/raw/*.txt",
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        *SHARD,
        "--task-index",
        "1",
        env=s3_server.env(),
    )
    data_prep("finalize", str(out), env=s3_server.env())
    tars = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    assert tars and tars == {k: v for k, v in local_run.items() if k.endswith(".tar")}
    inputs = json.loads((out / "manifest.json").read_text())["settings"]["inputs"]
    assert inputs == [f"s3://{bucket}/raw/*.txt"]
    missing = data_prep(
        "shard",
        "--input",
        f"s3://{bucket}/raw/*.jsonl",
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(tmp_path / "none"),
        *SHARD,
        "--task-index",
        "0",
        env=s3_server.env(),
        check=False,
    )
    assert missing.returncode == 2 and f"--input 's3://{bucket}/raw/*.jsonl' matches no" in missing.stderr


def test_transient_http_errors_are_retried_and_logged_once(tmp_path, caplog):
    """A real HTTP server that answers 503 twice and then serves the bytes: the read succeeds, one
    warning says it retried; a 404 is no retry, an error naming the URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from data_prep.common.storage import StorageError, open_store

    body, answered = b"0123456789" * 10, []

    class Flaky(BaseHTTPRequestHandler):
        def do_GET(self):
            answered.append(self.path)
            if self.path != "/data/blob.bin":
                self.send_error(404)
            elif len(answered) <= 2:
                self.send_error(503, "busy")
            else:
                start, end = map(int, self.headers["Range"].removeprefix("bytes=").split("-"))
                self.send_response(206)
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                self.wfile.write(body[start : end + 1])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = open_store(f"http://127.0.0.1:{server.server_port}/data")
        with caplog.at_level("WARNING", logger="data_prep"):
            assert store.read_range("blob.bin", 10, 25) == body[10:25]
        assert len(answered) == 3
        assert [r.getMessage() for r in caplog.records] == [
            f"{store.url()}: ranged read failed (HTTPError); retrying with backoff"
        ]
        with pytest.raises(StorageError, match=rf"{store.url('gone.bin')}: read failed \(HTTP 404"):
            store.read_bytes("gone.bin")
        assert len(answered) == 4
    finally:
        server.shutdown()


def test_an_unknown_bucket_is_said_as_such_by_the_readers(s3_server, tmp_path):
    """Before: "manifest.json: missing (run data_prep finalize ...)" for a bucket that does not exist,
    in training and in verify; a bucket that exists without a manifest still says that."""
    from conftest import train

    env = s3_server.env()
    url = "s3://no-such-bucket-here/wiki"
    proc = data_prep("verify", url, env=env, check=False)
    assert proc.returncode == 2 and "no such bucket 'no-such-bucket-here'" in proc.stderr, proc.stderr
    assert "finalize" not in proc.stderr and "Traceback" not in proc.stderr
    run = train(url, tmp_path / "run", "train.max_steps=1", ranks=1, env=s3_server.aws())
    said = run.stdout + run.stderr
    assert run.returncode == 2 and "no such bucket 'no-such-bucket-here'" in said and "finalize" not in said, said
    empty = s3_server.bucket("no-manifest")
    proc = data_prep("verify", f"s3://{empty}/wiki", env=env, check=False)
    assert proc.returncode == 2 and "manifest.json: missing" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_test_s3_server_starts_again_when_weed_dies_while_starting(tmp_path, monkeypatch):
    """SeaweedFS's master can lose its raft election to itself on a loaded machine and exit 255 while
    starting: ``serving`` (the fixtures' and the benches' server) starts it once more, on fresh ports."""
    import subprocess

    import s3_server

    real, started = s3_server._launch, []

    def launch(args, work):
        started.append(work)
        if len(started) == 1:  # the lost election
            return subprocess.Popen(["sh", "-c", "exit 255"], start_new_session=True)
        return real(args, work)

    monkeypatch.setattr(s3_server, "_launch", launch)
    with s3_server.serving(tmp_path) as server:
        bucket = server.bucket("second-start")
        server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        assert server.objects(bucket) == {"k": b"v"}
    assert started == [tmp_path, tmp_path / "second-start"]
    assert server.proc.poll() is not None  # stopped with the block


@pytest.mark.parametrize("fault", ["a byte at a time", "a body short of its length"])
def test_a_slow_or_short_http_body_is_retried_then_named_as_an_outage_within_the_window(monkeypatch, fault):
    """Issue 81, item 4: the socket's timeout bounded each read, not the body, so a server sending a
    byte every 0.3 s was never timed out; a body short of its Content-Length was a traceback. Now each
    attempt has one deadline, a short body is transient, and both end as the store's outage (the
    trainer's exit 3) once the retry window (``data.remote_timeout_s``) has passed. A body that comes
    whole on a retry is read."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from data_prep.common.storage import StoreUnavailable, open_store

    body, answered, healthy = bytes(range(100)), [], threading.Event()

    class Faulty(BaseHTTPRequestHandler):
        def do_GET(self):
            answered.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                if healthy.is_set():
                    self.wfile.write(body)
                elif fault == "a byte at a time":
                    for i in range(len(body)):
                        self.wfile.write(body[i : i + 1])
                        self.wfile.flush()
                        time.sleep(0.3)
                else:
                    self.wfile.write(body[:50])
                    self.close_connection = True
            except OSError:
                pass  # the reader gave up

        def log_message(self, *args):
            pass

    monkeypatch.setenv("MLM_STORE_RETRY_S", "2")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = open_store(f"http://127.0.0.1:{server.server_port}/data")
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=rf"{store.url('blob.bin')}: read failed for \d+ s .*unavailable"):
            store.read_bytes("blob.bin")
        assert time.monotonic() - t0 < 6.0  # the window (2 s) and at most one attempt (2 s) more
        assert len(answered) >= (1 if fault == "a byte at a time" else 2)  # a short body is retried at once
        healthy.set()
        assert store.read_bytes("blob.bin") == body
    finally:
        server.shutdown()
