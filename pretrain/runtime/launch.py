"""DeepSpeed's launcher, with signals passed on to the ranks and their exit code kept.

    python -m pretrain.launch --num_gpus 2 --master_port 29500 --module pretrain.train --config ...

Every argument goes to ``deepspeed`` unchanged. Why not call ``deepspeed`` directly: a SIGTERM to
the launcher's process group (a scheduler or a shell stopping the job) makes ``deepspeed`` exit 143
at once while its ranks, orphaned, go on writing their checkpoint; its per-node ``launch.py``
SIGKILLs ranks that are not gone 30 s later, mid-write if the checkpoint is large. A wrapper that
requeues on exit 3 never sees a 3, and a relaunch can overlap ranks still writing.

Here the launcher and its ranks run in a session of their own, so a signal to this process's group
reaches only this process. SIGTERM and SIGUSR1 are forwarded to the ranks alone, SIGINT as SIGUSR1
(the trainer's handlers checkpoint after the current step and exit 3); the launcher is left to see them
exit, and this process exits with the launcher's code, which is the ranks'. A second SIGINT
kills them (the last complete checkpoint stays usable). Killed itself (``kill -9``), this process
takes the ranks with it (``pretrain.runtime.lifeline``). A ``--master_port`` in use here is refused (exit 2)
before any rank starts.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil

from pretrain.runtime import lifeline, ports

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ranks_of(launcher_pid: int) -> list[psutil.Process]:
    """The training processes: the children of DeepSpeed's per-node ``launch.py`` (not its helpers,
    and not the ranks' own data-loader workers, which would die of the signal)."""
    try:
        tree = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for proc in tree:
        try:
            if any("deepspeed.launcher.launch" in part for part in proc.cmdline()):
                ranks.extend(proc.children())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def quiet_by_default(argv: list[str]) -> list[str]:
    """DeepSpeed's runner logs every spawn at INFO (a dozen lines before the first of ours); errors
    only, unless the command line says otherwise."""
    if any(a == "--log_level" or a.startswith("--log_level=") for a in argv):
        return argv
    return ["--log_level=error", *argv]


def accelerator_env(env: dict) -> dict:
    """Without a GPU, say so: DeepSpeed otherwise probes for one and warns in every process."""
    gpu_nodes = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel", "/dev/dri")
    if "DS_ACCELERATOR" not in env and not any(os.path.exists(n) for n in gpu_nodes):
        env["DS_ACCELERATOR"] = "cpu"
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    beside = os.path.join(os.path.dirname(sys.executable), "deepspeed")     # this environment's own
    deepspeed = beside if os.access(beside, os.X_OK) else shutil.which("deepspeed")
    if deepspeed is None:
        print("pretrain.launch: no `deepspeed` launcher in this environment", file=sys.stderr)
        return 2
    problem = ports.launch_port_problem(argv)
    if problem:
        print(f"pretrain.launch: {problem}", file=sys.stderr)
        return 2
    # Its ranks die with this process, killed however (pretrain.runtime.lifeline).
    launcher = subprocess.Popen([deepspeed, *quiet_by_default(argv)], start_new_session=True,
                                env=lifeline.launcher_env(accelerator_env(dict(os.environ))))

    interrupts = 0

    def forward(signum, frame):
        nonlocal interrupts
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:            # a second Ctrl-C: stop now, the last checkpoint stays
                print("pretrain.launch: second SIGINT: killing the ranks", file=sys.stderr, flush=True)
                os.killpg(launcher.pid, signal.SIGKILL)
                return
        ranks = ranks_of(launcher.pid)
        print(f"pretrain.launch: {name}: passed on to {len(ranks)} ranks; waiting for them to checkpoint",
              file=sys.stderr, flush=True)
        for proc in ranks:
            try:
                proc.send_signal(signal.SIGUSR1 if signum == signal.SIGINT else signum)
            except psutil.NoSuchProcess:
                pass

    for s in FORWARDED:
        signal.signal(s, forward)
    while True:
        try:
            return launcher.wait()
        except InterruptedError:          # a signal arrived: keep waiting for the ranks' verdict
            continue


if __name__ == "__main__":
    sys.exit(main())
