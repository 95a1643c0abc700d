"""The rendezvous port, checked before any rank starts: one in use is an input error (exit 2 naming
it), not a C++ traceback from every rank's TCPStore.

A job script (``launchers/slurm/pretrain.sbatch``) gets its port here, held until the TCPStore
listens on it, in one process that prints the port once it holds it:

    python -m pretrain.runtime.ports hold PORT       # the port given: exit 2, saying why, when it
                                                     # cannot be the master's
    python -m pretrain.runtime.ports hold-free SEED  # a free port picked outside the kernel's
                                                     # ephemeral range

Checking or picking and holding are one step: when they were two commands, two jobs started on one
node within a second (seen: CI, two 2-node jobs) picked the same port, one between the other's pick
and its hold, and the second job's rank 0 failed with EADDRINUSE. ``hold-free`` also picks under a
lock that every picker on the machine takes, and binds before letting it go.

Picked outside the ephemeral range (``ip_local_port_range``), the port is not one the kernel hands
out to any process's outgoing connection, and a seed (the job id) starts each job's search at another
place. Held, it is bound with SO_REUSEADDR and never listened on: a bind without SO_REUSEADDR (another
job's, a service's) and the kernel's ephemeral choices skip it, while the rank-0 TCPStore, which sets
SO_REUSEADDR, binds and listens on it as usual.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import sys
import tempfile
import time

DEEPSPEED_DEFAULT_PORT = 29500  # what DeepSpeed's launcher uses without --master_port
_LOCAL = {"", "localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def port_problem(port: int) -> str | None:
    """Why the master could not listen on ``port`` here, or None. SO_REUSEADDR as the TCPStore sets
    it: a port a finished job left in TIME_WAIT is free, one that something listens on is not."""
    try:
        _holder(port).close()
    except OSError as exc:
        return _bind_problem(port, exc)
    return None


def _bind_problem(port: int, exc: OSError, name: str = "--master_port") -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{name} {port} is already in use on this machine (another job's rendezvous?): "
            "pick another port, or leave MASTER_PORT unset for the launcher (launchers/local.sh, the sbatch) "
            "to pick a free one"
        )
    return f"{name} {port}: cannot listen on it ({exc.strerror})"


def launch_port_problem(argv: list[str]) -> str | None:
    """The port problem of a ``deepspeed`` command line, when this machine hosts the master (node 0)."""
    if "-h" in argv or "--help" in argv:
        return None
    addr, node_rank = _option(argv, "--master_addr"), _option(argv, "--node_rank")
    if node_rank not in (None, "0") or (addr is not None and addr not in _LOCAL | {socket.gethostname()}):
        return None
    raw = _option(argv, "--master_port")
    try:
        port = int(raw) if raw is not None else DEEPSPEED_DEFAULT_PORT
    except ValueError:
        return f"--master_port {raw!r} is not a port number"
    if not 0 < port < 65536:
        return f"--master_port {port} is not a port number (1-65535)"
    return port_problem(port)


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def pick(seed: int) -> int:
    """The first free port from a place that ``seed`` chooses, outside the ephemeral range."""
    low, high = ephemeral_range()
    # From 20000: the ports below are where tools that pick their own (and the tests' launchers,
    # tests/conftest.py free_port: 10000-19999) look, and a port they took between this pick and
    # rank 0's listen would end the job with EADDRINUSE (seen: a test worker's 15012).
    candidates = range(20000, low) if low - 20000 >= 1000 else range(high + 1, 65536)
    start = seed % len(candidates)
    for i in range(len(candidates)):
        port = candidates[(start + i) % len(candidates)]
        if _plain_bind_ok(port):
            return port
    raise OSError(f"no free port in {candidates.start}-{candidates.stop - 1}")


def _plain_bind_ok(port: int) -> bool:
    """Nothing listens on it, holds it (a bound socket, as ``hold`` makes, that port_problem lets
    through) or has it in TIME_WAIT."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _holder(port: int) -> socket.socket:
    """A socket bound to ``port`` with SO_REUSEADDR, never listening: the store may bind it too."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("", port))
    return holder


def pickers_lock() -> int | None:
    """An open, flock'ed file that every picker on this machine locks; None where it cannot be had
    (then picks race as before). In /run/lock where there is one: Slurm's job_container/tmpfs gives
    each job its own /tmp. Opened without O_CREAT first: a sticky directory's protected_regular
    refuses an O_CREAT open of a file another user made."""
    folder = "/run/lock" if os.access("/run/lock", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(folder, "pretrain-master-port.lock")
    try:
        fd = os.open(path, os.O_RDONLY) if os.path.exists(path) else os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def claim(seed: int) -> tuple[int, socket.socket]:
    """``pick(seed)``'s port, already held: no other picker on this machine can choose it meanwhile."""
    lock = pickers_lock()
    try:
        port = pick(seed)
        return port, _holder(port)
    finally:
        if lock is not None:
            os.close(lock)  # releases the flock


def hold(holder: socket.socket) -> None:
    """Keep ``holder`` (``_holder``'s bound socket) until signalled or the parent process is gone."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("hold", "hold-free"):
        print("usage: python -m pretrain.runtime.ports hold PORT | hold-free SEED", file=sys.stderr)
        return 2
    command, raw = argv
    number = int(raw) if raw.isdigit() else -1
    if command == "hold" and not 0 < number < 65536:
        print(f"MASTER_PORT {raw!r} is not a port number (1-65535)", file=sys.stderr)
        return 2
    if number < 0:
        print(f"hold-free: the seed {raw!r} is not a whole number", file=sys.stderr)
        return 2
    try:
        port, holder = claim(number) if command == "hold-free" else (number, _holder(number))
    except OSError as exc:
        why = _bind_problem(number, exc, "MASTER_PORT") if command == "hold" else exc
        print(f"no rendezvous port for this job: {why}", file=sys.stderr)
        return 2
    print(port, flush=True)
    sys.stdout.close()  # the reader's line is complete: it need not wait for the holder to end
    hold(holder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
