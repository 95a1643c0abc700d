"""A real ``mlflow server`` for tests: SQLite backend store, served artifacts, a loopback port.

``MlflowServer(root, port)`` can be stopped and started again on the same port and store, which is
how tests simulate a tracking server that goes down mid-run. Use it as a context manager or call
``start()``/``stop()``; the ``mlflow_server`` fixture factory below stops everything at the end.
``MlflowServer(root, command=[...], cwd=...)`` serves with a command the project printed for a user
(``mlflow ui --backend-store-uri ...``), on a loopback port of the test's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port


class MlflowServer:
    def __init__(
        self,
        root: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        command: list[str] | None = None,
        cwd: Path | None = None,
    ):
        self.root = Path(root)
        self.command, self.cwd = command, cwd
        self.root.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port()
        self.uri = f"http://{host}:{self.port}"
        self.backend_uri = f"sqlite:///{self.root / 'mlflow.db'}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> "MlflowServer":
        if self.proc is not None:
            return self
        env = dict(os.environ)
        # The job runner (GenAI features) adds a dozen worker processes that these tests never use.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        mlflow_cli = Path(sys.executable).with_name("mlflow")
        cmd = self.command or [
            str(mlflow_cli),
            "server",
            "--backend-store-uri",
            self.backend_uri,
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--serve-artifacts",
        ]
        cmd = [*cmd, "--host", self.host, "--port", str(self.port), "--workers", "1"]
        self.log_path = self.root / "server.log"
        with open(self.log_path, "ab") as log_file:
            # Own session: stop() signals the server and its uvicorn worker together, by group id.
            self.proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=self.cwd, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server on port {self.port} not healthy after {timeout}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # == the group id: the server leads its own session
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        # The uvicorn worker may outlive its parent by a moment; wait until the port is free so a
        # restart on the same port can bind it.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """One real server per test module (startup takes several seconds)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    server.start()
    yield server
    server.stop()
