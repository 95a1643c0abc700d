"""Ranks die with the process that launched them.

``pretrain.launch`` and ``pretrain.study`` start DeepSpeed's launcher in a session of its own (so a
signal to their process group reaches them alone, see ``pretrain.launch``). The price: a
``kill -9`` of that group left DeepSpeed's launcher and every rank training on, unattended,
re-parented to PID 1. DeepSpeed's two launcher processes cannot be changed to watch their parent;
the ranks can: the launcher names itself in ``LAUNCHER_ENV`` and each rank watches that process,
killing itself once it is gone: told by the kernel (a pidfd), and from the rank's first import on
(``pretrain/train.py`` starts the watch before torch is imported), so a rank killed during its
start-up goes too. DeepSpeed's ``launch.py`` then sees its ranks dead and exits, and its runner
after it. The last complete checkpoint stays usable, as after any kill.

Killed in its first seconds, before any rank exists, the launcher would leave DeepSpeed's runner
importing for seconds and then spawning ranks that live until their own watch starts. So the runner
runs here (``python -m pretrain.runtime.lifeline ARGS``, as the ``deepspeed`` command would), watching
the launcher from its first line: once the launcher is gone, it kills its own process group, which
is the runner's session (``pretrain.launch`` starts it in one): the runner, its per-node launcher and
every rank, whether they exist yet or not.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading

import psutil

LAUNCHER_ENV = "MLM_PRETRAIN_LAUNCHER"  # "host:pid:create_time" of the process that launched the ranks
POLL_S = 0.2  # only where the kernel has no pidfd
_watching = False


def launcher_env(env: dict) -> dict:
    """``env`` for a launched job, naming this process as the one its ranks live and die with."""
    me = psutil.Process()
    return {**env, LAUNCHER_ENV: f"{socket.gethostname()}:{me.pid}:{me.create_time()!r}"}


def watch_launcher() -> bool:
    """In a rank: kill this process when the launcher named in the environment is gone. Nothing
    without one (plain ``deepspeed``, ``srun``: Slurm ends the whole job) or on another node (the
    name means nothing there). True when watching."""
    global _watching
    if _watching:
        return True
    host, _, rest = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if not rest or host != socket.gethostname():
        return False
    _watching = True
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


def _wait_for_exit(pid: int, created: float) -> None:
    """Return once the launcher has exited: at once through a pidfd (Linux 5.3+: readable when the
    process ends, no polling), else by polling every POLL_S."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here: poll
        while _alive(pid, created):
            threading.Event().wait(POLL_S)
        return
    try:
        if _alive(pid, created):  # the pid still names our launcher, not a later process given it
            select.select([fd], [], [])
    finally:
        os.close(fd)


def run_deepspeed(argv: list[str]) -> None:
    """DeepSpeed's runner, with this process's group killed once the launcher named in the
    environment is gone (before the runner's imports: they take seconds)."""
    host, _, rest = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if rest and host == socket.gethostname():
        pid, _, created = rest.partition(":")
        threading.Thread(
            target=_kill_group_after, args=(int(pid), float(created)), name="launcher-lifeline", daemon=True
        ).start()
    # ``scancel --signal=USR1`` without ``--batch`` signals every process of the job: DeepSpeed's runner
    # and its per-node launch.py died of it (exit -10, "a rank failed") while the ranks checkpointed.
    # Ignored here, and so in launch.py, which inherits it; the ranks take it back (``ranks_take_signals``).
    for signum in RUNNER_IGNORES:
        signal.signal(signum, signal.SIG_IGN)
    sys.argv = ["deepspeed", *argv]
    from deepspeed.launcher.runner import main as runner  # lazy: after the watch starts (seconds of imports)

    runner()


RUNNER_IGNORES = (signal.SIGUSR1,)  # the ranks act on it (checkpoint, exit 3); the launchers must not die of it


def ranks_take_signals() -> None:
    """A rank starts with the default action for what its launchers ignore (an ignored signal is
    inherited across exec), until the trainer installs its own handlers."""
    for signum in RUNNER_IGNORES:
        signal.signal(signum, signal.SIG_DFL)


def _kill_group_after(pid: int, created: float) -> None:
    _wait_for_exit(pid, created)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watch(pid: int, created: float) -> None:
    _wait_for_exit(pid, created)
    try:
        print(
            f"[rank {os.environ.get('RANK', '?')}] the launcher (pid {pid}) is gone: stopping",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):  # its stderr may have gone with it
        pass
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    run_deepspeed(sys.argv[1:])
