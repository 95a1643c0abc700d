"""The rendezvous port, checked before any rank starts: one in use is an input error (exit 2 naming
it), not a C++ traceback from every rank's TCPStore."""

from __future__ import annotations

import errno
import socket

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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"--master_port {port} is already in use on this machine (another job's rendezvous?): "
                    f"pick another port, or leave MASTER_PORT unset for launchers/local.sh to pick a free one"
                )
            return f"--master_port {port}: cannot listen on it ({exc.strerror})"
    return None


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
