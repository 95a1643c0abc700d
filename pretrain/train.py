"""Pretrain a BERT-style encoder with masked-language modelling under DeepSpeed ZeRO.

    python -m pretrain.train --config configs/tiny.yaml data.dir=shards/ train.max_steps=100
    deepspeed --num_gpus 8 --module pretrain.train --config configs/base.yaml data.dir=...

``fit`` decides when to log, evaluate and checkpoint; ``train_step`` shows the mechanics of one
optimiser step: mask on the device, forward, backward, step. Everything resumable is one
``TrainState``. Exit codes: 0 done, 2 bad input (before any process group starts, or read mid-run:
then on every rank), 3 checkpointed after SIGUSR1/SIGTERM (requeue me) or after a hang
(``train.hang_timeout_s``: no checkpoint, the last one resumes), 4 too many non-finite losses, 5 a loss
spike past ``train.spike_guard.max_recoveries`` (or with no checkpoint before it).
"""
from __future__ import annotations

import gc

if __name__ == "__main__":
    gc.disable()        # while torch, transformers and DeepSpeed load: see start_up_done

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from data_prep import stale_shm
from data_prep import storage
from pretrain.data import shard_cache
from data_prep.shard_format import Manifest, ShardError
from pretrain import console
from pretrain.checkpoint import files, phases
from pretrain.checkpoint import nodes as checkpoint_nodes
from pretrain.checkpoint import store as checkpointing
from pretrain.checkpoint.export import export_and_log, exported_from, final_export_dir
from pretrain.checkpoint.mirror import CheckpointMirror, wait_for_mirror
from pretrain.checkpoint.state import STATE_KEY, TrainState
from pretrain.config import loader as configlib
from pretrain.config.schema import Config, ConfigError, load_config
from pretrain.data import mixture
from pretrain.eval.downstream import baseline_metrics, prepare_tasks, probe_due, probe_metrics
from pretrain.eval.mlm import evaluate      # a fixed set of held-out sequences, at any layout
from pretrain.eval.tasks import TaskError
from pretrain.exit_codes import BAD_INPUT as EXIT_BAD_INPUT, NONFINITE as EXIT_NONFINITE
from pretrain.exit_codes import REQUEUE as EXIT_REQUEUE, SPIKES as EXIT_SPIKES
from pretrain.model import keyed_dropout
from pretrain.model.flops import mlm_flops_per_sequence
from pretrain.model.masking import SpecialIds, rate_at_step
from pretrain.model.mlm import MLMModel, build_model
from pretrain.model.schedule import continue_schedule
from pretrain.preflight import check_inputs
from pretrain.report.page import report_at_end
from pretrain.runtime import allocator, attention, bad_input, hardware, lifeline
from pretrain.runtime import engine as eng
from pretrain.runtime.health import LayerHealth
from pretrain.runtime.step_speed import step_probe
from pretrain.runtime.watchdog import HangWatchdog, hang_for_test
from pretrain.spike_guard import SpikeGuard, SpikesExhausted, inject_test_noise
from pretrain.step import StepResult, StopSignal, ThroughputWindow, train_step
from pretrain.tracking import make_tracker, resume_log, run_params

log = logging.getLogger("pretrain")


@dataclass
class Run:
    """What ``fit``, ``train_step`` and ``checkpoint`` share: the run's parts, built once by ``build_run``."""
    cfg: Config
    info: eng.DistInfo
    nodes: checkpoint_nodes.NodeLayout
    manifest: Manifest
    tasks: list
    stop: StopSignal
    special: SpecialIds
    model: MLMModel
    engine: Any
    optimizer: Any
    scheduler: Any
    state: TrainState
    stream: Any = None
    tracker: Any = None
    mirror: Optional[CheckpointMirror] = None      # a folder writer's uploader to train.checkpoint_mirror
    resolved_yaml: str = ""
    peak: float = 0.0
    mfu_check: Any = None
    exit_code: int = 0
    status: str = "FAILED"         # what the tracker marks the run with when fit returns
    latest: dict = field(default_factory=dict)          # the last value of every metric, for the summary
    started: float = field(default_factory=time.perf_counter)

    @property
    def export_engine(self):
        """Where an export takes the weights from: the engine when rank 0's folder lacks other ranks'
        shards (node-local disks, ZeRO 1-3), else (None) the checkpoint's files."""
        return self.engine if not self.nodes.shared and self.cfg.impl.zero_stage > 0 else None

    def flops_per_seq(self, masking_rate: float) -> float:
        seq_len = self.manifest.seq_len
        return mlm_flops_per_sequence(self.model.hf_model.config, seq_len, masking_rate * seq_len,
                                      self.cfg.impl.sparse_head)

    def emit(self, metrics: dict, step: int, suffix: str = "") -> None:
        if metrics:
            log.info("step %d %s%s", step, console.metrics_line(metrics), suffix)
            self.tracker.log_metrics(metrics, step)
            resume_log.remember(self.state, metrics, step)
            self.latest.update(metrics)

    def probe(self, step: int) -> None:
        """The downstream probe on the trainer's own weights (whole at ZeRO-3: every rank calls)."""
        self.engine.eval()
        with eng.full_weights(self.engine) as module:
            self.emit(probe_metrics(module.hf_model.base_model, self.tasks, self.info.device,
                                    self.cfg.eval.downstream_batch_size), step)
        self.engine.train()


def build_engine(cfg: Config, manifest: Manifest, resume_from: str | None, info: eng.DistInfo,
                 node_local: bool):
    """The model (in a new phase's shape when it starts from another run), its precision (``auto``
    times this model's step on a CPU), and DeepSpeed's engine."""
    special = SpecialIds.from_manifest(manifest)
    torch.manual_seed(cfg.train.seed)                       # identical initial weights on every rank
    model = build_model(cfg.model, manifest.tokenizer.vocab_size, special, cfg.impl,
                        seq_len=manifest.seq_len, shape_from=phases.model_shape_file(cfg, resume_from))
    probe = step_probe(model, cfg.impl.micro_batch_size, manifest.seq_len, cfg.masking.rate)
    with torch.random.fork_rng():                          # the timing leaves the run's RNG as it was
        precision, why = hardware.resolve_precision(cfg.impl.precision, info.device, probe)
    precision, why = eng.rank0_value((precision, why))     # every node takes the first rank's choice
    model.dropout_key = keyed_dropout.install(model.hf_model, cfg.train.seed)   # the same at any layout
    choose_attention(model, cfg, info, precision, manifest.seq_len)
    engine, scheduler, ds_config, optimizer = eng.initialize(model, cfg, info, precision, node_local)
    return special, model, engine, scheduler, ds_config, optimizer, precision, why


def choose_attention(model: MLMModel, cfg: Config, info: eng.DistInfo, precision: str, seq_len: int) -> None:
    """The attention kernel: ``impl.attention``, or with ``auto`` the fastest at this run's shape,
    timed once on the first rank (pretrain.runtime.attention); every rank runs the same."""
    choice = None
    if info.rank == 0:
        choice = attention.resolve(model, cfg.impl.attention, info.device, hardware.DTYPES[precision],
                                   cfg.impl.micro_batch_size, seq_len)
    name, why = eng.rank0_value(choice)
    model.use_attention(name)
    log.info("attention: %s (%s)", name, why)


def restore(run: Run, resume_from: str | None) -> dict:
    """Load the checkpoint to resume from, or a new phase's start; the schedule follows the config.
    Returns where a new phase came from (empty otherwise)."""
    if resume_from:
        run.state.load_state_dict(checkpointing.load(run.engine, run.cfg, resume_from, run.nodes)[STATE_KEY])
    origin = (phases.start_from(run.engine, run.cfg, run.nodes.writes_folder)
              if run.cfg.train.init_from_checkpoint and not resume_from else {})
    log.info(continue_schedule(run.scheduler, run.cfg))     # the config's schedule, whatever a checkpoint held
    return origin


def keep_attention(run: Run) -> None:
    """A resumed run computes with the attention its first launch chose (at any layout), unless
    impl.attention now names one; the choice goes into every checkpoint."""
    recorded, model = run.state.attention, run.model
    if recorded and run.cfg.impl.attention == "auto" and recorded != model.attention:
        log.info("attention: %s, as this run started (timed here: %s)", recorded, model.attention)
        model.use_attention(recorded)
    run.state.attention = model.attention


def build_stream(run: Run, resume_from: str | None):
    cfg, info = run.cfg, run.info
    stream = mixture.make_train_stream(cfg, run.manifest, info.rank, info.world, cfg.impl.num_workers,
                                       cfg.impl.prefetch_factor)
    if resume_from:
        stream.load_state_dict(run.state.data)   # another world size or micro-batch continues the same order
    return stream


def build_tracker(run: Run, origin: dict, precision: str, ds_config: dict):
    cfg, state = run.cfg, run.state
    if run.info.rank == 0 and cfg.train.resume == "none":      # a fresh start is a new tracking run too
        (Path(cfg.train.out_dir) / "mlflow_run_id").unlink(missing_ok=True)
    tracker = make_tracker(phases.tracked_under(cfg, origin), run.info.rank, resume_step=state.step)
    params = {**run_params(cfg, run.info.world, precision, run.manifest), **origin}
    state.run_id = eng.rank0_value(tracker.start(state.run_id, params, {
        "config.yaml": run.resolved_yaml, "deepspeed.json": json.dumps(ds_config, indent=2)}))
    return tracker


def build_run(cfg: Config, manifest: Manifest, tasks: list, resume_from: str | None, info: eng.DistInfo,
              stop: StopSignal) -> Run:
    """Assemble the run: precision, model and engine, resume, data stream, tracker, FLOPs and peak."""
    if info.device.type == "cpu" and cfg.impl.keep_freed_cpu_memory and allocator.in_use() == "glibc":
        hardware.keep_freed_cpu_memory()        # no page faults on every step's large tensors (tcmalloc keeps them anyway)
    nodes = checkpoint_nodes.probe(cfg.train.out_dir)     # one shared train.out_dir, or one per node
    special, model, engine, scheduler, ds_config, optimizer, precision, why = build_engine(cfg, manifest, resume_from,
                                                                                          info, not nodes.shared)
    run = Run(cfg, info, nodes, manifest, tasks, stop, special, model, engine, optimizer, scheduler,
              TrainState(config=configlib.to_dict(cfg)), resolved_yaml=configlib.dump_yaml(cfg))
    resume_from = eng.rank0_value(resume_from)     # the first rank chose it, holding the run lock
    if resume_from:
        checkpointing.ensure_on_every_node(cfg, resume_from, nodes)
    origin = restore(run, resume_from)
    keep_attention(run)
    if cfg.compile_now(cfg.train.max_steps - run.state.step, info.device.type, precision):
        engine.compile()
    run.stream = build_stream(run, resume_from)
    run.tracker = build_tracker(run, origin, precision, ds_config)
    if cfg.train.checkpoint_mirror and nodes.writes_folder:
        run.mirror = CheckpointMirror(cfg.train.checkpoint_mirror, cfg.train.keep_checkpoints, nodes)
    resume_log.relog(run.tracker, run.state)      # a kill may have cut the checkpoint step's line short
    run.peak, peak_source = hardware.peak_tflops(info.device, precision, cfg.impl.peak_tflops)
    run.mfu_check = hardware.MfuCheck(run.peak, peak_source)
    log.info("start: step %d%s, world %d, grad_accum %d, precision %s (%s), attention %s, ZeRO %d, %d params, "
             "peak %.3f TFLOP/s per process (%s), allocator %s", run.state.step,
             f" (resumed from {resume_from})" if resume_from else "", info.world, cfg.grad_accum_steps(info.world),
             precision, why, model.attention, cfg.impl.zero_stage, eng.num_parameters(model), run.peak, peak_source,
             allocator.in_use())
    if mixture.is_mixture(cfg):
        log.info("data mixture:\n  %s", "\n  ".join(mixture.plan_lines(run.stream, cfg.train.max_steps)))
    return run


def fit(run: Run) -> int:
    """The loop: one optimiser step, then what is due after it (log, evaluate, probe, checkpoint)."""
    cfg, state, info = run.cfg, run.state, run.info
    grad_accum, seq_len = cfg.grad_accum_steps(info.world), run.manifest.seq_len
    watchdog = HangWatchdog(cfg.train.hang_timeout_s, cfg.train.out_dir, info.rank, run.tracker)
    health = LayerHealth(run.engine, cfg.train.health_every, cfg.impl.zero_stage)
    guard = SpikeGuard(cfg.train.spike_guard, cfg.train.global_batch_size, checkpointing.checkpoint_root(cfg),
                       run.tracker) if cfg.train.spike_guard.enabled else None
    try:
        if run.tasks and state.step == 0:      # what the probe scores mean: random weights, majority class
            run.emit(baseline_metrics(run.model.hf_model.config, run.tasks, info.device, cfg.eval.downstream_batch_size), 0)
        batches, window, nonfinite_in_a_row = iter(run.stream), ThroughputWindow(info.device), 0
        resume_log.restore_window(window, state.log_window, info.rank)   # the first log averages the whole window
        while state.step < cfg.train.max_steps:
            # one step: read, mask, forward, backward, update (per-layer health when due)
            run.engine.train()
            watchdog.step_started()
            t_start = time.perf_counter()
            micro = bad_input.next_micro_batches(batches, grad_accum, run.special, cfg.impl.micro_batch_size, seq_len)
            inject_test_noise(micro, run.special)             # test-only (PRETRAIN_TEST_NOISE_STEPS)
            t_data = time.perf_counter()
            hang_for_test(info.rank, state.step + 1)          # test-only (PRETRAIN_TEST_HANG)
            will_log = (state.step + 1) % cfg.train.log_every == 0 or state.step + 1 == cfg.train.max_steps
            check_health = health.due(state.step + 1)
            result = train_step(run, micro, will_log, health.before_step if check_health else None)
            if result.bad_input:
                bad_input.report(micro, info.rank, result.outage)
                return EXIT_REQUEUE if result.outage else EXIT_BAD_INPUT
            if check_health:
                run.tracker.log_metrics(health.after_step(state.step + 1), state.step + 1)
            state.step += 1
            state.samples_consumed = run.stream.samples_consumed
            state.tokens_seen += cfg.train.global_batch_size * seq_len
            window.add(result, time.perf_counter() - t_start, t_data - t_start)
            watchdog.step_done(state.step, time.perf_counter() - t_start)

            # a non-finite loss skipped the update everywhere; too many in a row stop the run
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if result.nonfinite else 0
            if result.nonfinite and too_many_nonfinite(run, nonfinite_in_a_row):
                return EXIT_NONFINITE

            # a loss spike: back to the checkpoint before it, past its samples
            if guard and (spike := guard.check(result.sums, state)):
                batches = recover_from_spike(run, guard, spike, batches)
                if batches is None:
                    return EXIT_SPIKES
                window = ThroughputWindow(info.device)
                continue

            # log, evaluate, probe
            log_evaluate_probe(run, window, result, will_log)

            # checkpoint, and stop when asked to
            if checkpoint_and_decide_exit(run, result, window):
                return run.exit_code
        finish(run)
        return 0
    finally:
        watchdog.stop()
        run.tracker.finish(run.status)        # flushes what it buffered and marks the run


def recover_from_spike(run: Run, guard: SpikeGuard, spike, batches):
    """The data iterator that continues after the recovery, or None past the cap (the run stops)."""
    try:
        return guard.recover(run.engine, run.cfg, run.nodes, run.state, run.stream, batches, spike)
    except SpikesExhausted as exc:
        log.error("stopping: %s", exc)
        return None


def log_evaluate_probe(run: Run, window: ThroughputWindow, result: StepResult, will_log: bool) -> None:
    cfg, step = run.cfg, run.state.step
    last = step == cfg.train.max_steps
    if will_log:
        metrics = train_metrics(run, window, result)
        run.emit(metrics, step, f" left={console.time_left(cfg.train.max_steps - step, metrics['perf/step_time_s'])}")
    if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last:
        run.emit(evaluate(run.engine, cfg, run.special, run.info), step)
    if run.tasks and probe_due(step, cfg.eval.downstream_every, cfg.train.eval_every, last):
        run.probe(step)


def too_many_nonfinite(run: Run, in_a_row: int) -> bool:
    state, step = run.state, run.state.step
    state.nonfinite_total += 1
    log.warning("step %d: non-finite loss on some rank; update skipped (%d in a row)", step, in_a_row)
    if in_a_row < run.cfg.train.max_nonfinite_in_a_row:
        return False
    run.emit({"train/nonfinite_skipped": state.nonfinite_total}, step)
    log.error("stopping: %d non-finite losses in a row (last at step %d); the last complete checkpoint is "
              "untouched. Lower optim.lr, raise warmup or check the data.", in_a_row, step)
    return True


def train_metrics(run: Run, window: ThroughputWindow, result: StepResult) -> dict:
    cfg, state, step = run.cfg, run.state, run.state.step
    # The head's FLOPs follow the masking rate: the window's mean (masking.rate_end schedules it).
    rates = [rate_at_step(cfg.masking, s, cfg.train.max_steps) for s in range(step - window.steps, step)]
    flops_per_seq = run.flops_per_seq(sum(rates) / max(1, len(rates)))
    metrics = window.metrics(result, cfg.train.global_batch_size, run.info.world, flops_per_seq, run.peak)
    run.mfu_check(metrics["perf/mfu"])
    grad_norm = run.engine.get_global_grad_norm() if cfg.impl.zero_stage else result.grad_norm
    return {**metrics, "train/lr": run.scheduler.get_last_lr()[0],
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "perf/memory_gb": hardware.peak_memory_gb(run.info.device),
            "perf/memory_current_gb": hardware.current_memory_gb(run.info.device), "train/tokens_seen": state.tokens_seen,
            "train/nonfinite_skipped": state.nonfinite_total,
            **mixture.data_metrics(run.stream, step, cfg.train.max_steps),
            **({"train/mask_rate": rate_at_step(cfg.masking, step - 1, cfg.train.max_steps)}
               if cfg.masking.rate_end is not None else {})}


def checkpoint_and_decide_exit(run: Run, result: StepResult, window: ThroughputWindow) -> bool:
    """Checkpoint when due (periodic, the last step, train.halt_at_step, a stop signal); True when the
    loop must end here (``run.exit_code`` and ``run.status`` say how)."""
    cfg, step = run.cfg, run.state.step
    last, halting = step == cfg.train.max_steps, step == cfg.train.halt_at_step
    periodic = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and not result.nonfinite
    if result.stop or halting or last or periodic:
        run.state.log_window = resume_log.window_state(window)
        export = last or bool(cfg.train.export_every and step % cfg.train.export_every == 0)
        checkpoint(run, export, final=last)
    if result.stop:
        log.warning("%s: checkpointed at step %d; exiting for requeue",
                    f"signal {run.stop.name}" if run.stop.name else "a signal on another rank", step)
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
    exported = eng.rank0_value(exported_from(final_export_dir(cfg.train.out_dir)))   # rank 0's folder holds it
    if exported != checkpointing.tag_for_step(cfg.train.max_steps):
        # Killed after the final checkpoint and before its export: finish what that run would have.
        log.info("the final checkpoint at step %d has no export yet: evaluating and exporting it", step)
        run.emit(evaluate(run.engine, cfg, run.special, run.info), step)
        if run.tasks:
            run.probe(step)
        export_and_log(cfg, step, run.tracker, final=True, engine=run.export_engine)
        if run.mirror is not None:
            run.mirror.upload_folder(final_export_dir(cfg.train.out_dir), last=files.EXPORT_SOURCE)
    if run.info.rank == 0 and cfg.tracking.report:
        report = report_at_end(cfg, run.manifest, run.tracker)    # never raises; logged as the run's report/ artifact
        if report is not None and run.mirror is not None:
            run.mirror.upload_folder(report)
    log.info("%s", console.summary(run.state, cfg, time.perf_counter() - run.started, run.latest, run.tracker))
    run.status = "FINISHED"


def checkpoint(run: Run, export: bool, final: bool) -> None:
    """A complete checkpoint (with the config, model config, manifest and tokenizer beside it, so
    that it exports on its own), recorded by the tracker; optionally exported to Hugging Face."""
    cfg, state, manifest = run.cfg, run.state, run.manifest
    state.data = run.stream.state_dict()
    snapshot = state.state_dict()
    readable = {k: v for k, v in snapshot.items() if k != "rng"}      # for checks before any process group
    side_files = {files.CONFIG_FILE: run.resolved_yaml, files.HF_CONFIG_FILE: run.model.hf_model.config.to_json_string(),
                  files.MANIFEST_FILE: json.dumps(manifest.to_dict()), files.STATE_FILE: json.dumps(readable)}
    tag = checkpointing.save(run.engine, cfg, state.step, {STATE_KEY: snapshot}, side_files,
                             {files.TOKENIZER_DIR: manifest.tokenizer_dir(cfg.data.dir)}, run.nodes)
    run.tracker.log_checkpoint(tag, state.step, str(checkpointing.checkpoint_root(cfg) / tag))
    if run.mirror is not None:
        run.mirror.upload(checkpointing.checkpoint_root(cfg) / tag)       # in the background
    if export:
        export_and_log(cfg, state.step, run.tracker, final, engine=run.export_engine)
        if final and run.mirror is not None:
            run.mirror.upload_folder(final_export_dir(cfg.train.out_dir), last=files.EXPORT_SOURCE)
    dist.barrier()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m pretrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML file (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.max_steps=100")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def start_up_done() -> None:
    """The ~400k objects of the imports, model and engine live until exit: frozen, the cyclic collector
    stops scanning them at every full collection (and at exit); it was off while they loaded. About
    1 s less CPU per rank (BENCHMARKS.md, "A rank's start-up and exit")."""
    gc.freeze()
    gc.enable()


def main(argv=None) -> int:
    args = parse_args(argv)
    eng.prepare_env()
    lifeline.watch_launcher()    # die with pretrain.launch / pretrain.study, however they die
    first_rank = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO if first_rank else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    # Everything that can be wrong with the input is found before any process group starts; every
    # rank finds the same problems, the first one reports them.
    try:
        cfg = load_config(args.config, args.overrides)
        storage.set_retry_window(cfg.data.remote_timeout_s)      # before any read; workers inherit it
        shard_cache.configure(cfg.data.cache_dir, cfg.data.cache_limit_gb)
        if cfg.impl.device == "cpu":
            eng.train_on_cpu()
        console.quiet_third_party(cfg.train.out_dir, int(os.environ.get("RANK", "0")))
        # The first rank holds the run folder from here on; a previous job still writing its
        # checkpoint is waited for, before the checkpoint to resume from is chosen.
        run_lock = checkpointing.RunLock(cfg.train.out_dir) if first_rank else None   # noqa: F841 (held)
        manifest, resume_from = check_inputs(cfg, f"the run of {args.config}"
                                                  f"{' with overrides' if args.overrides else ''}")
        # Probe examples no longer than the sequences the model is trained on (its positions may end there).
        specs = [dataclasses.replace(t, max_length=min(t.max_length, manifest.seq_len))
                 for t in cfg.eval.downstream]
        tasks = prepare_tasks(specs, manifest.tokenizer_dir(cfg.data.dir), data_dir=cfg.data.dir, manifest=manifest)
    except (ConfigError, ShardError, TaskError) as exc:
        bad_input.report_before_start(exc, first_rank)
        return EXIT_BAD_INPUT
    stop = StopSignal()          # from here on, SIGUSR1/SIGTERM mean "checkpoint after the current step"
    if os.environ.get("LOCAL_RANK", "0") == "0":
        stale_shm.remove_stale()     # /dev/shm segments of killed runs (no live process maps them)
    with console.chatter_to_file():         # DeepSpeed's op builds and checks print on every rank
        info = eng.init_distributed(cfg)
    try:
        run = build_run(cfg, manifest, tasks, resume_from, info, stop)
        start_up_done()
        return wait_for_mirror(run.mirror, fit(run))
    except ShardError as exc:    # found while reading: name the shard, no traceback on every rank
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except storage.StoreUnavailable as exc:     # the data's store is down: requeue, resume from the checkpoint
        print(f"error: {exc}; exit {EXIT_REQUEUE} (requeue): the last complete checkpoint resumes",
              file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except bad_input.BadInputStop as stop:   # read mid-run (the evaluation split); every rank printed it
        return EXIT_REQUEUE if stop.outage else EXIT_BAD_INPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        eng.release_shared_memory()


if __name__ == "__main__":
    eng.end_process(main())
