"""Ranks die with the process that launched them.

``pretrain.launch`` and ``pretrain.study`` start DeepSpeed's launcher in a session of its own (so a
signal to their process group reaches them alone, see ``pretrain.launch``). The price: a
``kill -9`` of that group left DeepSpeed's launcher and every rank training on, unattended,
re-parented to PID 1. DeepSpeed's two launcher processes cannot be changed to watch their parent;
the ranks can: the launcher names itself in ``LAUNCHER_ENV`` and each rank watches that process,
killing itself once it is gone. DeepSpeed's ``launch.py`` then sees its ranks dead and exits, and
its runner after it. The last complete checkpoint stays usable, as after any kill.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import psutil

LAUNCHER_ENV = "MLM_PRETRAIN_LAUNCHER"  # "host:pid:create_time" of the process that launched the ranks
POLL_S = 1.0


def launcher_env(env: dict) -> dict:
    """``env`` for a launched job, naming this process as the one its ranks live and die with."""
    me = psutil.Process()
    return {**env, LAUNCHER_ENV: f"{socket.gethostname()}:{me.pid}:{me.create_time()!r}"}


def watch_launcher() -> bool:
    """In a rank: kill this process when the launcher named in the environment is gone. Nothing
    without one (plain ``deepspeed``, ``srun``: Slurm ends the whole job) or on another node (the
    name means nothing there). True when watching."""
    host, _, rest = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if not rest or host != socket.gethostname():
        return False
    pid, _, created = rest.partition(":")
    threading.Thread(target=_watch, args=(int(pid), float(created)), name="launcher-lifeline", daemon=True).start()
    return True


def _alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # The same process, not a later one given its pid; a zombie has died already.
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _watch(pid: int, created: float) -> None:
    stop = threading.Event()
    while _alive(pid, created):
        stop.wait(POLL_S)
    try:
        print(
            f"[rank {os.environ.get('RANK', '?')}] the launcher (pid {pid}) is gone: stopping",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):  # its stderr may have gone with it
        pass
    os.kill(os.getpid(), signal.SIGKILL)
