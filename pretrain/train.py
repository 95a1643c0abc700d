"""Pretrain a BERT-style encoder with masked-language modelling under DeepSpeed ZeRO.

    python -m pretrain.train --config configs/tiny.yaml data.dir=shards/ train.max_steps=100
    deepspeed --num_gpus 8 --module pretrain.train --config configs/base.yaml data.dir=...

``fit`` decides when to log, evaluate and checkpoint; ``train_step`` shows the mechanics of one
optimiser step: mask on the device, forward, backward, step; ``pretrain.run.build_run`` assembles
what they share. Everything resumable is one ``TrainState``. Exit codes: 0 done, 2 bad input (before
any process group starts, or read mid-run: then on every rank), 3 checkpointed after SIGUSR1/SIGTERM
(requeue me) or after a hang (``train.hang_timeout_s``: no checkpoint, the last one resumes), 4 too
many non-finite losses, 5 a loss spike past ``train.spike_guard.max_recoveries`` (or with no
checkpoint before it), 6 the run ended as asked but its newest checkpoint did not reach
``train.checkpoint_mirror``.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    gc.disable()  # while torch, transformers and DeepSpeed load: see start_up_done
    # A rank dies with the launcher that started it, also while the imports below take seconds.
    from pretrain.runtime.lifeline import watch_launcher

    watch_launcher()

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

import torch.distributed as dist

from data_prep.common import stale_shm, storage
from data_prep.common.errors import ShardError
from data_prep.common.tokenizer_cache import tokenizer_dir
from pretrain import metric_names as names
from pretrain.checkpoint import checkpointing, files
from pretrain.checkpoint.hf_export import export_and_log, exported_from, final_export_dir
from pretrain.checkpoint.mirror import wait_for_mirror
from pretrain.checkpoint.safe_load import UnsafeCheckpoint
from pretrain.checkpoint.state import STATE_KEY
from pretrain.config import loader as configlib
from pretrain.config.schema import ConfigError, load_config
from pretrain.data import shard_cache
from pretrain.eval.downstream import baseline_metrics, prepare_tasks, probe_due
from pretrain.eval.heldout import evaluate  # a fixed set of held-out sequences, at any layout
from pretrain.eval.tasks import TaskError
from pretrain.guards import bad_input
from pretrain.guards.health import LayerHealth
from pretrain.guards.preflight import check_inputs
from pretrain.guards.spike_guard import SpikeGuard, SpikesExhausted
from pretrain.guards.watchdog import HangWatchdog
from pretrain.model.masking import rate_at_step
from pretrain.report.page import report_at_end
from pretrain.run import Run, build_run
from pretrain.runtime import engine as eng
from pretrain.runtime import faults, hardware, lifeline
from pretrain.runtime.exit_codes import BAD_INPUT as EXIT_BAD_INPUT
from pretrain.runtime.exit_codes import DISK_FULL as EXIT_DISK_FULL
from pretrain.runtime.exit_codes import NONFINITE as EXIT_NONFINITE
from pretrain.runtime.exit_codes import REQUEUE as EXIT_REQUEUE
from pretrain.runtime.exit_codes import SPIKES as EXIT_SPIKES
from pretrain.runtime.profiling import StepProfiler
from pretrain.runtime.step_speed import step_probe
from pretrain.step import LogWindow, StepResult, StopSignal, train_step
from pretrain.tracking import console
from pretrain.tracking.heartbeat import Heartbeat

log = logging.getLogger("pretrain")


def fit(run: Run) -> int:
    """The loop: one optimiser step, then what is due after it (log, evaluate, probe, checkpoint)."""
    cfg, state, info = run.cfg, run.state, run.info
    grad_accum, seq_len = cfg.grad_accum_steps(info.world), run.manifest.seq_len
    watch = step_watchers(run)
    try:
        emit_probe_baselines(run)
        batches, window, nonfinite_in_a_row = iter(run.stream), LogWindow(info.device), 0
        deferred: StepResult | None = None  # a step that logged nothing: the next one reads its decision
        window.load_state_dict(state.log_window, info.rank)  # the first log averages the whole window
        while state.step < cfg.train.max_steps:
            # one step: read, mask, forward, backward, update (per-layer health when due)
            run.engine.train()
            watch.step_started(state.step)
            t_start = time.perf_counter()
            micro = bad_input.next_micro_batches(batches, grad_accum, run.special, cfg.impl.micro_batch_size, seq_len)
            faults.at_step(micro, run.special, info.rank, state.step + 1)  # test-only (runtime/faults.py)
            t_data = time.perf_counter()
            will_log = (state.step + 1) % cfg.train.log_every == 0 or state.step + 1 == cfg.train.max_steps
            check_health = watch.health.due(state.step + 1)
            defer = not (will_log or check_health or does_more_than_train(run, state.step + 1))
            before_step = watch.health.before_step if check_health else None
            result = train_step(run.step_parts, state.step, micro, will_log, before_step, deferred, defer)
            if check_health:
                run.tracker.log_metrics(watch.health.after_step(state.step + 1), state.step + 1)
            state.step += 1
            state.samples_consumed = result.samples_after = run.stream.samples_consumed
            state.tokens_seen += cfg.train.global_batch_size * seq_len
            window.add(result, time.perf_counter() - t_start, t_data - t_start)
            watch.step_done(state.step, time.perf_counter() - t_start)

            # what the steps decided, in order: this one's, and the one before if it read nothing
            decided = [r for r in (deferred, result) if r is not None and r.numbers is not None]
            deferred, stop, spike = (result if result.numbers is None else None), any(r.stop for r in decided), None
            for done in decided:
                nonfinite_in_a_row = nonfinite_in_a_row + 1 if done.nonfinite else 0
                if (code := exit_code_for(run, done, nonfinite_in_a_row)) is not None:
                    return code
                if spike := (watch.guard.check(done.loss, run.state, done.step) if watch.guard else None):
                    break
            if spike:  # a loss spike (its first and last step): back to the checkpoint before it, past its samples
                batches = recover_from_spike(run, watch.guard, spike, batches, done.samples_after)
                if batches is None:
                    return EXIT_SPIKES
                window, deferred = LogWindow(info.device), None
                continue
            log_evaluate_probe(run, window, result, will_log)
            # checkpoint, and stop when asked to
            if checkpoint_and_decide_exit(run, result, window, stop):
                return run.exit_code
        finish(run)
        return 0
    except Exception as exc:
        watch.watchdog.exit_if_hung(exc)  # a peer that exited 3 for a hang breaks this rank's collective
        raise
    finally:
        watch.stop(state.step)
        run.tracker.finish(run.status)  # flushes what it buffered and marks the run


@dataclasses.dataclass
class Watchers:
    """What watches the steps: the hang watchdog, per-layer health, the spike guard, the profiler, and
    the line said when the run has been quiet for a while."""

    watchdog: HangWatchdog
    health: LayerHealth
    guard: SpikeGuard | None
    profiler: StepProfiler
    heartbeat: Heartbeat

    def step_started(self, done: int) -> None:
        """A step begins after ``done`` steps."""
        self.watchdog.step_started()
        self.profiler.before_step(done)
        self.heartbeat.step_started(done + 1)

    def step_done(self, step: int, seconds: float) -> None:
        self.watchdog.step_done(step, seconds)
        self.heartbeat.step_done(step, seconds)

    def stop(self, step: int) -> None:
        self.profiler.stop(step)
        self.watchdog.stop()
        self.heartbeat.stop()


def step_watchers(run: Run) -> Watchers:
    cfg, info = run.cfg, run.info
    run.heartbeat = heartbeat_of(run)
    return Watchers(
        HangWatchdog(cfg.train.hang_timeout_s, cfg.train.out_dir, info.rank, run.tracker),
        LayerHealth(run.engine, cfg.train.health_every, cfg.impl.zero_stage),
        spike_guard_of(run),
        StepProfiler.of(cfg, info.rank, info.device),
        run.heartbeat,
    )


def heartbeat_of(run: Run) -> Heartbeat:
    """On the first rank, a line when nothing was said for ``train.progress_every_s``; the first step's
    time kept by device, model shape and what the first step does (compiling, in which mode)."""
    cfg, info = run.cfg, run.info
    compiled = bool(getattr(run.engine, "is_compiled", False))
    first_step = "compiling the model with torch.compile" if compiled else "warming up"
    if compiled and cfg.impl.autotune_kernels:
        first_step += ", inductor's kernels chosen by timing (impl.autotune_kernels)"
    if compiled and run.cuda_graphs:
        first_step += ", recorded as CUDA graphs"
    shape = step_probe(run.model, 1, run.manifest.seq_len, cfg.masking.rate).shape
    key = (
        f"{hardware.device_key(info.device)}|{shape}|{run.precision}|{first_step}|micro={cfg.impl.micro_batch_size}"
        f"x{cfg.grad_accum_steps(info.world)}|seq={run.manifest.seq_len}|world={info.world}|zero={cfg.impl.zero_stage}"
    )
    every_s = cfg.train.progress_every_s if info.rank == 0 else 0.0
    return Heartbeat(every_s, run.state.step, cfg.train.max_steps, cfg.train.log_every, first_step, key)


def spike_guard_of(run: Run) -> SpikeGuard | None:
    cfg = run.cfg
    if not cfg.train.spike_guard.enabled:
        return None
    return SpikeGuard(
        cfg.train.spike_guard, cfg.train.global_batch_size, checkpointing.checkpoint_root(cfg), run.tracker
    )


def emit_probe_baselines(run: Run) -> None:
    """What the probe scores mean (random weights, majority class), once, at step 0; a run started
    from ``model.init_from`` adds that encoder's own score (``init_from_accuracy``: the weights at
    step 0), so that the run shows whether continued pretraining helped."""
    if run.tasks and run.state.step == 0:
        cfg = run.cfg
        metrics = baseline_metrics(
            run.model.hf_model.config,
            run.tasks,
            run.info.device,
            cfg.eval.downstream_batch_size,
            vocab_size=run.model.vocab_size,  # the export's rows: the evaluate CLI's baseline to the bit
        )
        if cfg.model.init_from:
            metrics.update(run.probe_scores(label="init_from_"))
        run.emit(metrics, 0)


def recover_from_spike(run: Run, guard: SpikeGuard, spike, batches, spike_end: int):
    """The data iterator that continues after the recovery, or None past the cap (the run stops).
    ``spike_end``: the stream's position after the spike's last step."""
    try:
        return guard.recover(run.engine, run.cfg, run.nodes, run.state, run.stream, batches, spike, spike_end)
    except SpikesExhausted as exc:
        log.error("stopping: %s", exc)
        return None


def eval_note(cfg) -> str:
    """Held-out rows are scored with the run's attention scope; a document-scope run says so."""
    return " (attention within each document)" if cfg.model.attention_scope == "document" else ""


def log_evaluate_probe(run: Run, window: LogWindow, result: StepResult, will_log: bool) -> None:
    cfg, step = run.cfg, run.state.step
    last = step == cfg.train.max_steps
    if will_log:
        metrics = train_metrics(run, window, result)
        run.emit(
            metrics, step, f" left={console.time_left(cfg.train.max_steps - step, metrics[names.PERF_STEP_TIME_S])}"
        )
    if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last:
        run.doing("evaluating on the held-out set")
        run.emit(evaluate(run.engine, cfg, run.special, run.info), step, eval_note(cfg))
    if run.tasks and probe_due(step, cfg.eval.downstream_every, cfg.train.eval_every, last):
        run.doing("the downstream probe")
        run.probe(step)


def exit_code_for(run: Run, done: StepResult, in_a_row: int) -> int | None:
    """The exit code step ``done``'s decision asks for: an unreadable batch (every rank stops), or a
    non-finite loss (which skipped the update everywhere) that is the ``in_a_row``-th in a row, too
    many; None to go on."""
    if done.bad_input:
        bad_input.report(done.micro_batches, run.info.rank, done.outage)
        return EXIT_REQUEUE if done.outage else EXIT_BAD_INPUT
    if done.nonfinite and too_many_nonfinite(run, in_a_row, done.step):
        return EXIT_NONFINITE
    return None


def too_many_nonfinite(run: Run, in_a_row: int, step: int) -> bool:
    state = run.state
    state.nonfinite_total += 1
    log.warning("step %d: non-finite loss on some rank; update skipped (%d in a row)", step, in_a_row)
    if in_a_row < run.cfg.train.max_nonfinite_in_a_row:
        return False
    run.emit({names.TRAIN_NONFINITE_SKIPPED: state.nonfinite_total}, step)
    log.error(
        "stopping: %d non-finite losses in a row (last at step %d); the last complete checkpoint is "
        "untouched. Lower optim.lr, raise warmup or check the data.",
        in_a_row,
        step,
    )
    return True


def train_metrics(run: Run, window: LogWindow, result: StepResult) -> dict:
    cfg, state, step = run.cfg, run.state, run.state.step
    # The head's FLOPs follow the masking rate: the window's mean (masking.rate_end schedules it).
    rates = [rate_at_step(cfg.masking, s, cfg.train.max_steps) for s in range(step - window.steps, step)]
    flops_per_seq = run.flops_per_seq(sum(rates) / max(1, len(rates)))
    metrics = window.metrics(result, cfg.train.global_batch_size, run.info.world, flops_per_seq, run.peak)
    run.mfu_check(metrics[names.PERF_MFU])
    grad_norm = run.engine.get_global_grad_norm() if cfg.impl.zero_stage else result.grad_norm
    return {
        **metrics,
        names.TRAIN_LR: run.scheduler.get_last_lr()[0],
        names.TRAIN_GRAD_NORM: float(grad_norm) if grad_norm is not None else float("nan"),
        names.PERF_MEMORY_GB: hardware.peak_memory_gb(run.info.device),
        names.PERF_MEMORY_CURRENT_GB: hardware.current_memory_gb(run.info.device),
        names.TRAIN_TOKENS_SEEN: state.tokens_seen,
        names.TRAIN_NONFINITE_SKIPPED: state.nonfinite_total,
        **run.stream.metrics(step, cfg.train.max_steps),
        **(
            {names.TRAIN_MASK_RATE: rate_at_step(cfg.masking, step - 1, cfg.train.max_steps)}
            if cfg.masking.rate_end is not None
            else {}
        ),
    }


def does_more_than_train(run: Run, step: int) -> bool:
    """Whether step ``step`` evaluates, probes or checkpoints after it: then it reads its decision
    before its update (pretrain/step.py, "Deferred reads"), as a logged step does. The same answer on
    every rank."""
    t, last = run.cfg.train, step == run.cfg.train.max_steps
    every = [t.eval_every, t.checkpoint_every, t.export_every]
    due = last or step == t.halt_at_step or any(n and step % n == 0 for n in every)
    return due or bool(run.tasks and probe_due(step, run.cfg.eval.downstream_every, t.eval_every, last))


def checkpoint_and_decide_exit(run: Run, result: StepResult, window: LogWindow, stop: bool) -> bool:
    """Checkpoint when due (periodic, the last step, train.halt_at_step, a stop signal: ``stop``, which
    the step or the one before it decided); True when the loop must end here (``run.exit_code`` and
    ``run.status`` say how)."""
    cfg, step = run.cfg, run.state.step
    last, halting = step == cfg.train.max_steps, step == cfg.train.halt_at_step
    periodic = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and not result.nonfinite
    if stop or halting or last or periodic:
        run.state.log_window = window.state_dict()
        export = last or bool(cfg.train.export_every and step % cfg.train.export_every == 0)
        run.doing("checkpointing" + (" and exporting" if export else ""))
        checkpoint(run, export, final=last)
    if stop:
        log.warning(
            "%s: checkpointed at step %d; exiting for requeue",
            f"signal {run.stop.name}" if run.stop.name else "a signal on another rank",
            step,
        )
        run.exit_code, run.status = EXIT_REQUEUE, "KILLED"
        return True
    if halting and not last:
        log.info("train.halt_at_step=%d reached: checkpointed; resume with the same command", step)
        run.exit_code, run.status = 0, "FINISHED"
        return True
    return False


def finish(run: Run) -> None:
    """After the last step: complete an export a kill interrupted, then the report."""
    step, cfg = run.state.step, run.cfg
    exported = eng.rank0_value(exported_from(final_export_dir(cfg.train.out_dir)))  # rank 0's folder holds it
    if exported != checkpointing.tag_for_step(cfg.train.max_steps):
        # Killed after the final checkpoint and before its export: finish what that run would have.
        log.info("the final checkpoint at step %d has no export yet: evaluating and exporting it", step)
        run.emit(evaluate(run.engine, cfg, run.special, run.info), step, eval_note(cfg))
        if run.tasks:
            run.probe(step)
        export_and_log(cfg, step, run.tracker, final=True, engine=run.export_engine)
        if run.mirror is not None:
            run.mirror.upload_folder(final_export_dir(cfg.train.out_dir), last=files.EXPORT_SOURCE)
    if run.info.rank == 0 and cfg.tracking.report:
        run.doing("writing the run's report")
        report = report_at_end(cfg, run.manifest, run.tracker)  # never raises; logged as the run's report/ artifact
        if report is not None and run.mirror is not None:
            run.mirror.upload_folder(report)
    job_s = time.perf_counter() - run.started
    log.info("%s", console.summary(run.state, cfg, run.seconds_before + job_s, job_s, run.latest, run.tracker))
    run.status = "FINISHED"


def checkpoint(run: Run, export: bool, final: bool) -> None:
    """A complete checkpoint (with the config, model config, manifest and tokenizer beside it, so
    that it exports on its own), recorded by the tracker; optionally exported to Hugging Face."""
    cfg, state, manifest = run.cfg, run.state, run.manifest
    state.data = run.stream.state_dict()
    state.seconds = run.seconds_before + time.perf_counter() - run.started
    snapshot = state.state_dict()
    readable = {k: v for k, v in snapshot.items() if k != "rng"}  # for checks before any process group
    side_files = {
        files.CONFIG_FILE: run.resolved_yaml,
        files.HF_CONFIG_FILE: run.model.hf_model.config.to_json_string(),
        files.MANIFEST_FILE: json.dumps(manifest.to_dict()),
        files.STATE_FILE: json.dumps(readable),
    }
    try:
        tag = checkpointing.save(
            run.engine,
            cfg,
            state.step,
            {STATE_KEY: snapshot},
            side_files,
            {files.TOKENIZER_DIR: tokenizer_dir(manifest, cfg.data.dir)},
            run.nodes,
        )
    except (OSError, RuntimeError) as exc:
        if not checkpointing.out_of_space(exc, checkpointing.checkpoint_root(cfg)):
            raise
        raise checkpointing.disk_full(cfg, state.step) from None
    run.tracker.log_checkpoint(tag, state.step, str(checkpointing.checkpoint_root(cfg) / tag))
    if run.mirror is not None:
        run.mirror.upload(checkpointing.checkpoint_root(cfg) / tag)  # in the background
    if export:
        export_and_log(cfg, state.step, run.tracker, final, engine=run.export_engine)
        if final and run.mirror is not None:
            run.mirror.upload_folder(final_export_dir(cfg.train.out_dir), last=files.EXPORT_SOURCE)
    dist.barrier()


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m pretrain.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="YAML file (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.max_steps=100")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def start_up_done() -> None:
    """The ~400k objects of the imports, model and engine live until exit: frozen, the cyclic collector
    stops scanning them at every full collection (and at exit); it was off while they loaded. About
    1 s less CPU per rank (benchmarks/2026-11-24-rank-start-up-and-exit.md)."""
    gc.freeze()
    gc.enable()


def main(argv=None) -> int:
    args = parse_args(argv)
    eng.prepare_env()
    lifeline.watch_launcher()  # die with pretrain.launch / pretrain.study, however they die
    lifeline.ranks_take_signals()
    first_rank = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(
        level=logging.INFO if first_rank else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stdout,
    )
    for handler in logging.getLogger().handlers:  # a tracking URI's credentials never reach a log
        handler.addFilter(configlib.RedactingFilter())
    # Everything that can be wrong with the input is found before any process group starts; every
    # rank finds the same problems, the first one reports them.
    try:
        cfg = load_config(args.config, args.overrides)
        storage.set_retry_window(cfg.data.remote_timeout_s)  # before any read; workers inherit it
        shard_cache.configure(cfg.data.cache_dir, cfg.data.cache_limit_gb)
        if cfg.impl.device == "cpu":
            eng.train_on_cpu()
        console.quiet_third_party(cfg.train.out_dir, int(os.environ.get("RANK", "0")))
        # The first rank holds the run folder from here on; a previous job still writing its
        # checkpoint is waited for, before the checkpoint to resume from is chosen.
        run_lock = checkpointing.RunLock(cfg.train.out_dir) if first_rank else None  # noqa: F841 (held)
        manifest, resume_from = check_inputs(
            cfg, f"the run of {args.config}{' with overrides' if args.overrides else ''}"
        )
        # Probe examples no longer than the sequences the model is trained on (its positions may end there).
        specs = [dataclasses.replace(t, max_length=min(t.max_length, manifest.seq_len)) for t in cfg.eval.downstream]
        tasks = prepare_tasks(specs, tokenizer_dir(manifest, cfg.data.dir), data_dir=cfg.data.dir, manifest=manifest)
    except (ConfigError, ShardError, TaskError) as exc:
        bad_input.report_before_start(exc, first_rank)
        return EXIT_BAD_INPUT
    stop = StopSignal()  # from here on, SIGUSR1/SIGTERM mean "checkpoint after the current step"
    if os.environ.get("LOCAL_RANK", "0") == "0":
        stale_shm.remove_stale()  # /dev/shm segments of killed runs (no live process maps them)
    with console.chatter_to_file():  # DeepSpeed's op builds and checks print on every rank
        info = eng.init_distributed(cfg)
    try:
        run = build_run(cfg, manifest, tasks, resume_from, info, stop)
        start_up_done()
        return wait_for_mirror(run.mirror, fit(run))
    except (ShardError, UnsafeCheckpoint) as exc:  # found while reading: named, no traceback on every rank
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except storage.StoreUnavailable as exc:  # the data's store is down: requeue, resume from the checkpoint
        print(f"error: {exc}; exit {EXIT_REQUEUE} (requeue): the last complete checkpoint resumes", file=sys.stderr)
        return EXIT_REQUEUE
    except bad_input.BadInputStop as stop:  # read mid-run (the evaluation split); every rank printed it
        return EXIT_REQUEUE if stop.outage else EXIT_BAD_INPUT
    except checkpointing.DiskFull as exc:  # not a requeue: the same disk would fill again
        print(f"error: {exc}; exit {EXIT_DISK_FULL}", file=sys.stderr, flush=True)
        return EXIT_DISK_FULL
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        eng.release_shared_memory()


if __name__ == "__main__":
    eng.end_process(main())
