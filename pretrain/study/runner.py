"""Compare training variants in one command: a grid over dotted config keys, one real training run per
variant, one MLflow parent run with a child run per variant, and a summary table and plots.

    python -m pretrain.study --config configs/study.yaml
    python -m pretrain.study --config configs/tiny.yaml data.dir=shards/ \\
        masking.rate=0.15,0.3,0.4 masking.strategy=token,whole_word,span study.ranks=2

Variants run one after another on this node, each with ``study.ranks`` ranks (more than one under
DeepSpeed's launcher), in ``<study folder>/<variant name>/`` (``study.out_dir``, default ``runs/study-<name>``).
A re-run skips finished variants (the trainer's final checkpoint and ``hf_final`` export exist) and
resumes an interrupted one from its last checkpoint (``train.resume=auto``). SIGUSR1/SIGTERM/SIGINT:
the running variant checkpoints and the study exits 3; run the same command again to continue.

On Slurm (``launchers/slurm/submit_study.sh``): ``--prepare`` checks everything, opens the parent
run and prints the number of variants; each array task runs ``--variant-index I``; a dependent job
runs ``--summarize``.

Exit codes: 0 every variant finished; 1 some variant failed (the summary shows which); 2 bad input
(nothing started); 3 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from data_prep.common.atomic import write_atomic
from pretrain.checkpoint.files import COMPLETE
from pretrain.config import loader as configlib
from pretrain.config.loader import ConfigError
from pretrain.runtime import lifeline
from pretrain.study import summary
from pretrain.study.plan import Study, Variant, describe, load_study, with_tracking
from pretrain.study.summary import variant_state
from pretrain.tracking.mlflow_parent import SET_FOR_THIS_PROCESS_ONLY, ParentRun

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 3
STATUS_FILE = "study_status.json"  # per variant: launches, wall time, last exit code
REPO = Path(__file__).resolve().parents[2]


def is_finished(variant: Variant) -> bool:
    # lazy: pulls in torch (~1.5 s), kept off this command's start-up (as in plan._data_problems)
    from pretrain.checkpoint.checkpointing import checkpoint_root, tag_for_step
    from pretrain.checkpoint.hf_export import final_export_dir

    final = checkpoint_root(variant.cfg) / tag_for_step(variant.cfg.train.max_steps) / COMPLETE
    return final.is_file() and (final_export_dir(variant.out_dir) / "config.json").is_file()


def read_status(variant: Variant) -> dict:
    path = variant.out_dir / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else {"launches": 0, "wall_s": 0.0}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)


# ---------------------------------------------------------------- running variants
class Interrupt:
    """SIGUSR1/SIGTERM/SIGINT: ask the running variant to checkpoint (it ignores nothing else)."""

    def __init__(self):
        self.requested, self.child = False, None
        for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        print(f"study: {signal.Signals(signum).name}: the running variant checkpoints and stops", flush=True)
        if self.child is not None and self.child.poll() is None:
            # The launcher processes, if any, ignore USR1 (set before exec); the ranks checkpoint and exit 3.
            os.killpg(self.child.pid, signal.SIGUSR1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def launch_command(config_file: Path, ranks: int) -> list[str]:
    """One rank starts as a plain process (the trainer sets up its own rendezvous): DeepSpeed's runner
    and per-node launcher would only add two processes, each importing DeepSpeed, per variant."""
    if ranks == 1:
        return [sys.executable, "-u", "-m", "pretrain.train", "--config", str(config_file)]
    deepspeed = Path(sys.executable).with_name("deepspeed")
    return [
        str(deepspeed) if deepspeed.is_file() else "deepspeed",
        "--num_gpus",
        str(ranks),
        "--master_port",
        os.environ.get("MASTER_PORT") or str(_free_port()),
        "--module",
        "pretrain.train",
        "--config",
        str(config_file),
    ]


def run_variant(study: Study, variant: Variant, parent: ParentRun, interrupt: Interrupt) -> str:
    """Train one variant to its end (or resume it there). Returns finished | failed | interrupted."""
    if is_finished(variant):
        print(f"study: {variant.name}: finished before, skipped", flush=True)
        return "finished"
    # A tracking URI with credentials reaches the variant through its environment, not its config file.
    secret = configlib.redact(parent.uri) != parent.uri
    cfg = with_tracking(variant.cfg, "" if secret else parent.uri, parent.run_id)
    config_file = variant.out_dir / "variant.yaml"
    _write_atomic(config_file, configlib.dump_yaml(cfg))
    ranks = study.section.ranks
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for name in SET_FOR_THIS_PROCESS_ONLY:
        env.pop(name, None)
    if secret:
        env["MLFLOW_TRACKING_URI"] = parent.uri
    # The deepspeed launcher sets no thread count; oversubscribed CPU ranks ran 9x slower.
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // ranks)))
    status = read_status(variant)
    cmd = launch_command(config_file, ranks)
    from pretrain.checkpoint.checkpointing import checkpoint_root, latest_complete_tag  # lazy: torch, as in is_finished

    tag = latest_complete_tag(checkpoint_root(cfg))
    print(
        f"study: {variant.name}: {f'resuming from {tag}' if tag else 'starting'} "
        f"({' '.join(cmd)}; log {variant.out_dir / 'train.log'})",
        flush=True,
    )
    start = time.monotonic()
    with open(variant.out_dir / "train.log", "ab") as log_file:
        child = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=lifeline.launcher_env(env),
            start_new_session=True,
            preexec_fn=_ignore_usr1,
        )
        interrupt.child = child
        if interrupt.requested:  # the signal came while the launch was being set up
            os.killpg(child.pid, signal.SIGUSR1)
        rc = child.wait()
        interrupt.child = None
    # A signal to the study (scancel, a preemption) stops the variant: whatever DeepSpeed's launcher
    # then exits with (1 after its own SIGTERM handler), the variant resumes from its last checkpoint.
    status = {
        "launches": status["launches"] + 1,
        "wall_s": status["wall_s"] + time.monotonic() - start,
        "last_exit": rc,
        "stopped_by_signal": interrupt.requested,
    }
    _write_atomic(variant.out_dir / STATUS_FILE, json.dumps(status) + "\n")
    state = "finished" if rc == 0 and is_finished(variant) else variant_state(status)
    print(
        f"study: {variant.name}: {state} (exit {rc}, {status['wall_s']:.0f}s in {status['launches']} launch(es))",
        flush=True,
    )
    return state


def summarize(study: Study, parent: ParentRun) -> list[Path]:
    files = summary.write_summary(study, read_status, is_finished)
    table = summary.summary_table(study, read_status, is_finished)[0]
    parent.log_summary(
        files, summary.comparison_metrics(table), summary.comparison_note(table, (study.dir / "summary.md").read_text())
    )
    print(f"study: summary in {study.dir / 'summary.md'}", flush=True)
    print((study.dir / "summary.md").read_text(), flush=True)
    return files


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m pretrain.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="a study YAML (configs/study.yaml) or any training YAML")
    p.add_argument("args", nargs="*", help="key=value (shared), key=v1,v2 (a grid axis), study.key=value")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="check, open the parent run, print the variant count")
    mode.add_argument("--variant-index", type=int, default=None, help="run only this variant (a Slurm array task)")
    mode.add_argument("--summarize", action="store_true", help="only write and log the summary, close the parent run")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        study = load_study(args.config, args.args)
        if args.variant_index is not None and not 0 <= args.variant_index < len(study.variants):
            raise ConfigError(
                [
                    f"--variant-index {args.variant_index}: the study has {len(study.variants)} "
                    f"variants (0..{len(study.variants) - 1})"
                ],
                args.config,
            )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    study.dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(study.dir / "study.json", json.dumps(describe(study), indent=1, default=str) + "\n")
    parent = ParentRun(study.variants[0].cfg, study.dir, study.section.name)
    try:
        parent.open(describe(study))
    except Exception as exc:  # noqa: BLE001 - server down, refused, bad URI: nothing has started yet
        print(
            f"error: MLflow at {parent.uri}: cannot open the study's run ({str(exc).splitlines()[0][:300]}); "
            "start the server, fix tracking.tracking_uri, or set tracking.backend=none",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    if args.prepare:
        for v in study.variants:
            print(f"{v.index}\t{v.name}", file=sys.stderr)
        print(len(study.variants))
        return 0
    if args.summarize:
        summarize(study, parent)
        done = all(is_finished(v) for v in study.variants)
        parent.close("FINISHED" if done else "FAILED")
        return 0 if done else EXIT_FAILED

    interrupt = Interrupt()
    chosen = study.variants if args.variant_index is None else [study.variants[args.variant_index]]
    states = {}
    for variant in chosen:
        if interrupt.requested:
            break
        states[variant.name] = run_variant(study, variant, parent, interrupt)
    if args.variant_index is not None:  # one Slurm array task: the summary job closes the parent
        state = states.get(chosen[0].name, "interrupted")
        return {"finished": 0, "failed": EXIT_FAILED}.get(state, EXIT_INTERRUPTED)
    if interrupt.requested or "interrupted" in states.values():
        return EXIT_INTERRUPTED  # the parent run stays RUNNING: the next run continues it
    summarize(study, parent)
    failed = [name for name, state in states.items() if state != "finished"]
    parent.close("FAILED" if failed else "FINISHED")
    if failed:
        print(f"study: variants that did not finish: {', '.join(failed)} (logs: <variant>/train.log)", file=sys.stderr)
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
