"""Trainer ranks without their start-up: a process that has imported what a rank imports (torch,
transformers' models, DeepSpeed, MLflow, the trainer) once, and forks the ranks of each job.

Why: a rank spends ~8 s of CPU importing before its first step (2-core AVX2 EPYC), and the suite
launched ~200 of them for runs of a few seconds each; DeepSpeed's per-node launcher adds ~4.5 s per
job. DeepSpeed's own tests keep their rank processes between tests for the same reason
(``reuse_dist_env``). Here every job still gets fresh processes that hold nothing of an earlier job
(nothing runs in the pool process but imports), and everything after the imports is the real thing:
``python -m pretrain.train`` as ``__main__`` with the job's arguments, environment and working
folder, a real gloo process group between real rank processes, the real exit path.

What it is not: a launcher under test. It sets what DeepSpeed's per-node ``launch.py`` sets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``CUDA_VISIBLE_DEVICES``, ``--local_rank=N``) and keeps its rules:
a rank that exits non-zero has the others terminated and its code is the job's. The launchers
themselves (``deepspeed``, ``pretrain.launch``, Slurm's ``sbatch``) are tested through their real
commands, and so are the tests that signal ranks or kill a launcher's process group.

Runs on the CPU only (``MLM_TESTS_ON_GPU=1`` launches for real). One pool per pytest worker, started
by the first test that trains; jobs run one at a time. The protocol is JSON lines on the pool's
stdin and stdout."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TERMINATE_WAIT_S = 30  # DeepSpeed's launch.py: SIGTERM, then SIGKILL after this
# CPU seconds of the ranks of finished jobs (each job's ranks and their children, from wait4), and
# the part of it that the worker's own RUSAGE_CHILDREN already holds (once the pool has been reaped):
# tests/suite_profile.py counts the difference as the worker's children's.
RANKS_CPU_S = {"reported": 0.0, "reaped": 0.0}
IMPORT_OUTPUT: dict[int, bytes] = {}  # in the pool: what its imports printed, by file descriptor


# ------------------------------------------------------------------------------------------ the pool
def _preload(modules: list[str]) -> None:
    """What a trainer rank imports, eagerly or on its way to the first step; or, for another
    program's ranks, ``modules`` (its own imports, and nothing a fresh process of it would not load)."""
    if modules:
        import importlib

        for module in modules:
            importlib.import_module(module)
        return
    import deepspeed  # noqa: F401
    import deepspeed.comm  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.utils.zero_to_fp32  # noqa: F401
    import mlflow  # noqa: F401
    import mlflow.tracking  # noqa: F401
    import torch.distributed  # noqa: F401

    import pretrain.export  # noqa: F401
    import pretrain.train  # noqa: F401


def _child(job: dict, local_rank: int, pgid: int) -> None:
    """A rank: the job's group, files, folder, environment and arguments, then the module as
    ``python -u -m MODULE`` would run it. Never returns."""
    import runpy
    import traceback

    code = 1
    try:
        os.setpgid(0, pgid)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        os.closerange(3, 256)
        for fd in (1, 2):
            os.write(fd, IMPORT_OUTPUT.get(fd, b""))
        os.chdir(job["cwd"])
        env = dict(job["env"])
        if job["launcher"]:  # what DeepSpeed's per-node launch.py sets for each rank
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(job["master_port"]),
                WORLD_SIZE=str(job["ranks"]),
                CROSS_RANK="0",
                CROSS_SIZE="1",
                LOCAL_SIZE=str(job["ranks"]),
                RANK=str(local_rank),
                LOCAL_RANK=str(local_rank),
                CUDA_VISIBLE_DEVICES=",".join(map(str, range(job["ranks"]))),
            )
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # the pool's was read from its own environment: the job's $TMPDIR
        for stream in (sys.stdout, sys.stderr):  # as with ``python -u``: nothing held back
            stream.reconfigure(line_buffering=True, write_through=True)
        sys.argv = [job["module"], *([f"--local_rank={local_rank}"] if job["launcher"] else []), *job["args"]]
        try:
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 -- as the interpreter would: the traceback, exit 1
            traceback.print_exc()
            code = 1
        # Python's exit steps, as at the end of a process (threads joined, atexit, streams flushed):
        # how a trainer rank ends, whatever the module was.
        from pretrain.runtime.engine import end_process

        end_process(code & 0xFF)
    finally:
        os._exit(code & 0xFF)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _run_job(job: dict, reply) -> int:
    """Fork the ranks into one new process group, report it, and wait as DeepSpeed's launch.py
    does: the first rank to exit non-zero has the others terminated, and its code is the job's."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    pgid = 0
    for local_rank in range(job["ranks"]):
        pid = os.fork()
        if pid == 0:
            _child(job, local_rank, pgid)
        if not pgid:
            pgid = pid
        try:
            os.setpgid(pid, pgid)  # also here: the group exists before anyone signals it
        except (PermissionError, ProcessLookupError):
            pass  # the child did it first (or has exec'd/exited)
        pids.append(pid)
    reply({"started": pgid, "pids": pids})
    alive, code, cpu = set(pids), 0, 0.0
    deadline = None
    while alive:
        flags = os.WNOHANG if deadline is not None else 0
        pid, status, usage = os.wait4(-1, flags)
        if pid == 0:  # terminating the others: give them time
            if time.time() > deadline:
                _kill_group(pgid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.1)
            continue
        if pid not in alive:
            continue
        alive.discard(pid)
        cpu += usage.ru_utime + usage.ru_stime
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code = rc & 0xFF  # sys.exit(-9) in launch.py exits 247
            if alive:
                _kill_group(pgid, signal.SIGTERM)
                deadline = time.time() + TERMINATE_WAIT_S
    # A rank's own children (data-loader workers) are gone with it; any left over go now.
    _kill_group(pgid, signal.SIGKILL)
    return code, cpu


def _preload_capturing_output(modules: list[str]) -> None:
    """``_preload``, with what the imports print (warnings, DeepSpeed's accelerator line) kept in
    ``IMPORT_OUTPUT``: each rank prints it first, as a fresh process would before its own lines."""
    saved_err = os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            _preload(modules)
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(saved_err, 2)
        for fd, captured in ((1, out), (2, err)):
            captured.seek(0)
            IMPORT_OUTPUT[fd] = captured.read()
    os.write(2, IMPORT_OUTPUT[2])  # and in the pool's log


def serve(modules: list[str]) -> None:
    reply_fd = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # only replies on the protocol's pipe
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    _preload_capturing_output(modules)
    import threading

    # fork copies only the calling thread: a thread holding a lock at that moment would leave it
    # held in every rank.
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]
    reply({"ready": os.getpid()})
    for line in sys.stdin:
        job = json.loads(line)
        code, cpu = _run_job(job, reply)
        reply({"done": code, "cpu_s": cpu})


# ---------------------------------------------------------------------------------------- the client
class RankPool:
    """The pytest worker's side: ``run`` is ``subprocess.run`` of ``python -m MODULE ARGS`` with
    ``ranks`` ranks (under DeepSpeed's per-node launcher's rules when ``launcher``)."""

    def __init__(self, folder: Path, env: dict, cwd: Path, preload: tuple[str, ...] = ()):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        self.jobs = 0
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", *preload],
            cwd=cwd,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.folder / "pool.log", "w"),
            start_new_session=True,
        )
        ready = self._read(timeout=300)
        assert "ready" in ready, ready

    def _read(self, timeout: float | None) -> dict:
        if timeout is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            log = (self.folder / "pool.log").read_text()[-4000:]
            raise RuntimeError(f"the rank pool exited ({self.proc.poll()}):\n{log}")
        return json.loads(line)

    def run(
        self, module: str, args: list[str], env: dict, ranks: int, master_port: int | None, timeout: float
    ) -> subprocess.CompletedProcess:
        self.jobs += 1
        out, err = self.folder / f"job{self.jobs}.out", self.folder / f"job{self.jobs}.err"
        for path in (out, err):
            path.write_text("")
        job = {
            "module": module,
            "args": [str(a) for a in args],
            "env": env,
            "cwd": str(self.cwd),
            "ranks": ranks,
            "launcher": master_port is not None,
            "master_port": master_port,
            "stdout": str(out),
            "stderr": str(err),
        }
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pgid = self._read(timeout=60)["started"]
        try:
            done = self._read(timeout=timeout)
        except TimeoutError:
            _kill_group(pgid, signal.SIGKILL)
            RANKS_CPU_S["reported"] += self._read(timeout=60)["cpu_s"]
            raise subprocess.TimeoutExpired(
                ["rank_pool", module, *job["args"]], timeout, out.read_text(), err.read_text()
            ) from None
        RANKS_CPU_S["reported"] += done["cpu_s"]
        cmd = [sys.executable, "-m", module, *job["args"]]
        if master_port is not None:  # the launch the pool stands in for: DeepSpeed's per-node launcher there
            cmd = [
                sys.executable,
                "-m",
                "deepspeed.launcher.launch",
                f"--master_port={master_port}",
                "--module",
                *cmd[2:],
            ]
        completed = subprocess.CompletedProcess(cmd, done["done"], out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return completed

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            RANKS_CPU_S["reaped"] = RANKS_CPU_S["reported"]
        shutil.rmtree(self.folder, ignore_errors=True)  # its log and the jobs' files: read by now


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2:])
