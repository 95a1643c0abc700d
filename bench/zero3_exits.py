"""Many finished ZeRO-3 runs, each exit code counted: the reliability figure of issue 37.

    python bench/zero3_exits.py [--runs 100] [--parallel 2] [--steps 2] [--work-dir /tmp/zero3-exits]

Each run is the real trainer, ``configs/tiny.yaml`` at ``impl.zero_stage=3``, 2 ranks under DeepSpeed's
per-node launcher (gloo), ``--steps`` steps with the final checkpoint and export, started through
``tests/exit_probe.py``, which records the native threads alive if a rank reaches the interpreter's final
teardown. ``--parallel`` runs go at once, so each has busy processes beside it (the abort was seen
under load). Shards: the embedded Wikipedia sample (bert-base-uncased vocabulary), sequences of 128.
Prints one line per run and a table of the outcomes; the folder of a failed run is kept.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, cpu_record, ensure_sample_shards, format_table, thread_env  # noqa: E402

PROBE = REPO / "tests" / "exit_probe.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(index: int, shards: Path, work: Path, steps: int) -> tuple[int, str]:
    """(launcher exit code, outcome): ``ok``, ``teardown`` (a rank reached it), ``abort`` or ``exit N``."""
    folder = work / f"run{index:04d}"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "probe").mkdir(parents=True)
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(PROBE),
        "pretrain.train",
        "--config",
        "configs/tiny.yaml",
        f"data.dir={shards}",
        f"train.out_dir={folder / 'out'}",
        "impl.zero_stage=3",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "tracking.report=false",
    ]
    env = thread_env(1, {**os.environ, "EXIT_PROBE_DIR": str(folder / "probe")})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (folder / "log").write_text(log)
    if proc.returncode != 0:
        outcome = "abort" if "terminate called" in log or proc.returncode == 250 else f"exit {proc.returncode}"
    elif any((folder / "probe").iterdir()):
        outcome = "teardown"
    else:
        outcome = "ok"
    if outcome == "ok":
        shutil.rmtree(folder)
    return proc.returncode, outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--work-dir", default="/tmp/zero3-exits")
    args = p.parse_args()
    work = Path(args.work_dir)
    shards = ensure_sample_shards(work, seq_len=128)
    cpu = cpu_record()
    print(f"machine: {cpu.get('model', '?')}, {args.parallel} runs at once; {args.runs} runs", flush=True)
    outcomes: collections.Counter = collections.Counter()
    start = time.time()

    def run(i: int) -> None:
        code, outcome = one_run(i, shards, work, args.steps)
        outcomes[outcome] += 1
        print(f"run {i + 1:4d}: exit {code} {outcome}  ({time.time() - start:.0f} s)", flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(run, range(args.runs)))
    print(format_table(["outcome", "runs"], sorted(outcomes.items())))
    print(f"{args.runs} runs in {(time.time() - start) / 60:.1f} min")
    return 0 if set(outcomes) == {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
