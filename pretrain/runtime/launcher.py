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
before any rank starts, and so is a config with problems (they are named, exit 2): DeepSpeed's
runner is not started for a job whose every rank would refuse it.

The last word is ours. When a rank exits non-zero, DeepSpeed's per-node launcher logs a line with
that rank's whole command line (``[ERROR] [launch.py:...:sigkill_handler] [...] exits with return
code = 2``, 300+ characters) after the trainer's own message. The ranks' output passes through here
line by line; DeepSpeed's launcher lines go to ``<train.out_dir>/third_party-launcher.log``, and a
non-zero exit ends with one line that says what the code means (``pretrain.runtime.exit_codes``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import psutil

from pretrain.config import loader as configlib
from pretrain.config.schema import TrainConfig, load_config
from pretrain.runtime import allocator, exit_codes, lifeline, ports

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The GPUs the scheduler gave the job, kept for the ranks (``engine.prepare_env``): DeepSpeed's
# launcher replaces CUDA_VISIBLE_DEVICES with 0..N-1, on shared nodes without device cgroups other
# jobs' GPUs.
GIVEN_DEVICES = "MLM_PRETRAIN_VISIBLE_DEVICES"
# What DeepSpeed's runner and per-node launcher log themselves (their logger's format), not a rank.
LAUNCHER_LINE = re.compile(rb"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[[A-Z]+\] \[(launch|runner|constants)\.py:\d+:")


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
    """Without a GPU, say so: DeepSpeed otherwise probes for one and warns in every process. With a
    device list from the scheduler, the ranks keep it (``engine.GIVEN_DEVICES``)."""
    if "DS_ACCELERATOR" not in env and not any(os.path.exists(n) for n in allocator.GPU_DEVICE_NODES):
        env["DS_ACCELERATOR"] = "cpu"
    if env.get("CUDA_VISIBLE_DEVICES"):
        env.setdefault(GIVEN_DEVICES, env["CUDA_VISIBLE_DEVICES"])
    return env


TRAINER = "pretrain.train"


def config_problems(argv: list[str]) -> Optional[str]:
    """The trainer's config and overrides (``--module pretrain.train --config C k=v ...``) parsed and
    checked here, before DeepSpeed's runner starts anything: the named problems, or None. Another
    module is its own judge."""
    if TRAINER not in argv or argv.index(TRAINER) == 0 or argv[argv.index(TRAINER) - 1] != "--module":
        return None
    trainer_args = argparse.ArgumentParser(add_help=False)
    trainer_args.add_argument("--config")
    trainer_args.add_argument("overrides", nargs="*")
    args, _ = trainer_args.parse_known_args(argv[argv.index(TRAINER) + 1 :])
    if not args.config:
        return "the trainer needs --config FILE"
    runner_args = argparse.ArgumentParser(add_help=False)
    runner_args.add_argument("--num_gpus", "--num-gpus", type=int, default=0)
    runner_args.add_argument("--num_nodes", "--num-nodes", type=int, default=1)
    runner, _ = runner_args.parse_known_args(argv[: argv.index(TRAINER)])
    # The ranks' world size where the command line says it (the batch-size check needs it); "0" (no
    # batch-size check) where DeepSpeed will count the GPUs itself.
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(max(runner.num_gpus, 0) * max(runner.num_nodes, 1))
    try:
        with warnings.catch_warnings():  # a deprecation is the ranks' to say, once
            warnings.simplefilter("ignore")
            load_config(args.config, args.overrides)
    except configlib.ConfigError as exc:
        return str(exc)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved
    return None


def launcher_log(argv: list[str]) -> Path:
    """``<train.out_dir>/third_party-launcher.log`` of the run the command line starts (its
    ``--config`` and ``train.out_dir=`` override), read without checking the config; a temporary
    file when the command names no readable config."""
    try:
        config = argv[argv.index("--config") + 1]
        raw = configlib.load_yaml(config).get("train", {})
        out_dir = raw.get("out_dir") or TrainConfig.out_dir
        for arg in argv:
            if arg.startswith("train.out_dir="):
                out_dir = arg.split("=", 1)[1]
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
    except (ValueError, IndexError, OSError, AttributeError, configlib.ConfigError):
        folder = Path(tempfile.gettempdir())
    return folder / "third_party-launcher.log"


def pass_output(pipe, log_path: Path) -> None:
    """The ranks' and DeepSpeed's stdout, line by line, to ours; DeepSpeed's own lines to the log. A
    log that cannot be written (a full disk) sends its lines to stdout too: the ranks' output, and
    the error that says why they stop, keep coming."""
    try:
        log = open(log_path, "ab")
    except OSError as exc:
        log = None
        print(f"pretrain.launch: cannot open {log_path} ({exc.strerror}): DeepSpeed's lines go here", flush=True)
    try:
        for line in iter(pipe.readline, b""):
            if log is not None and LAUNCHER_LINE.match(line):
                try:
                    log.write(line)
                    log.flush()
                    continue
                except OSError as exc:
                    log = _closed(log)
                    message = f"pretrain.launch: cannot write {log_path} ({exc.strerror}): DeepSpeed's lines go here\n"
                    sys.stdout.buffer.write(message.encode())
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
    finally:
        _closed(log)


def _closed(log) -> None:
    """``log`` closed, if open; what it still buffers for a full disk is dropped."""
    if log is not None:
        try:
            log.close()
        except OSError:
            pass


def last_word(code: int, log_path: Path) -> str:
    meaning = exit_codes.MEANINGS.get(code, "a rank failed; its error is above")
    return f"pretrain.launch: exit {code}: {meaning} (DeepSpeed's launcher log: {log_path})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if importlib.util.find_spec("deepspeed") is None:
        print(f"pretrain.launch: no DeepSpeed in this environment ({sys.executable})", file=sys.stderr)
        return 2
    problems = [p for p in (config_problems(argv), ports.launch_port_problem(argv)) if p]
    if problems:
        print("\n".join(f"pretrain.launch: {p}" for p in problems), file=sys.stderr)
        return 2
    env, problem = allocator.preload(accelerator_env(dict(os.environ)))
    if problem:
        print(f"pretrain.launch: {problem}", file=sys.stderr, flush=True)
    # Its ranks die with this process, killed however (pretrain.runtime.lifeline).
    # DeepSpeed's runner (what `deepspeed` runs), in a process that dies with this one, its group too.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pretrain.runtime.lifeline", *quiet_by_default(argv)],
        start_new_session=True,
        env=lifeline.launcher_env(env),
        stdout=subprocess.PIPE,
    )
    log_path = launcher_log(argv)
    output = threading.Thread(target=pass_output, args=(launcher.stdout, log_path), daemon=True)
    output.start()

    interrupts = 0

    def forward(signum, frame):
        nonlocal interrupts
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:  # a second Ctrl-C: stop now, the last checkpoint stays
                print("pretrain.launch: second SIGINT: killing the ranks", file=sys.stderr, flush=True)
                os.killpg(launcher.pid, signal.SIGKILL)
                return
        ranks = ranks_of(launcher.pid)
        print(
            f"pretrain.launch: {name}: passed on to {len(ranks)} ranks; waiting for them to checkpoint",
            file=sys.stderr,
            flush=True,
        )
        for proc in ranks:
            try:
                proc.send_signal(signal.SIGUSR1 if signum == signal.SIGINT else signum)
            except psutil.NoSuchProcess:
                pass

    for s in FORWARDED:
        signal.signal(s, forward)
    while True:
        try:
            code = launcher.wait()
            break
        except InterruptedError:  # a signal arrived: keep waiting for the ranks' verdict
            continue
    output.join(timeout=10)  # what the ranks printed last comes before our line
    if code:
        print(last_word(code, log_path), file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
