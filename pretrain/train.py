"""Pretrain a BERT-style encoder with masked-language modelling under DeepSpeed ZeRO.

    python -m pretrain.train --config configs/tiny.yaml data.dir=shards/ train.max_steps=100
    deepspeed --num_gpus 8 --module pretrain.train --config configs/base.yaml data.dir=...

``fit`` decides when to log, evaluate and checkpoint; ``train_step`` shows the mechanics of one
optimiser step: mask on the device, forward, backward, step. Everything resumable is one
``TrainState``. Exit codes: 0 done, 2 bad input (before any process group starts, or read mid-run:
then on every rank), 3 checkpointed after SIGUSR1/SIGTERM (requeue me), 4 too many non-finite losses.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep import stale_shm
from data_prep.shard_format import ShardError
from pretrain.checkpoint import files
from pretrain.checkpoint import store as checkpointing
from pretrain.checkpoint.state import STATE_KEY, TrainState
from pretrain.config import loader as configlib
from pretrain.config.schema import Config, ConfigError, load_config
from pretrain.data import mixture
from pretrain.data.stream import TrainStream
from pretrain.eval.downstream import baseline_metrics, prepare_tasks, probe_due, probe_metrics
from pretrain.eval.mlm import evaluate      # a fixed set of held-out sequences, at any layout
from pretrain.eval.tasks import TaskError
from pretrain.model import keyed_dropout
from pretrain.model.flops import mlm_flops_per_sequence
from pretrain.model.masking import SpecialIds, mask_batch
from pretrain.model.mlm import build_model
from pretrain.preflight import check_inputs
from pretrain.report.page import report_at_end
from pretrain.runtime import bad_input, hardware, lifeline
from pretrain.runtime import engine as eng
from pretrain.tracking import make_tracker, resume_log, run_params
from pretrain.checkpoint import phases
from pretrain.model.masking import rate_at_step
from pretrain.model.schedule import continue_schedule

log = logging.getLogger("pretrain")
EXIT_BAD_INPUT, EXIT_REQUEUE, EXIT_NONFINITE = 2, 3, 4


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit or preemption) and SIGTERM ask the loop to
    finish the current step, checkpoint and exit. Further signals during the save change nothing."""

    def __init__(self, signums=(signal.SIGUSR1, signal.SIGTERM)):
        self.requested, self.name = False, ""
        for s in signums:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if not self.requested:
            self.name = signal.Signals(signum).name
            print(f"[rank {os.environ.get('RANK', '?')}] received {self.name}: will checkpoint after this step",
                  file=sys.stderr, flush=True)
        self.requested = True


@dataclass
class StepResult:
    sums: torch.Tensor        # float64 [loss_sum, correct, predicted, tokens] on the device
    nonfinite: bool           # some rank's loss was not finite: the update was skipped everywhere
    stop: bool                # some rank was asked to stop
    grad_norm: float | None   # ZeRO 0 only, when asked (DeepSpeed keeps none there)
    bad_input: bool = False   # some rank could not read its batch (runtime.bad_input): stop, exit 2


def train_step(engine, optimizer, micro_batches: list[dict], step: int, cfg: Config, special: SpecialIds,
               info: eng.DistInfo, stop: StopSignal, want_grad_norm: bool) -> StepResult:
    device, world = info.device, info.world
    masked = []
    for i, batch in enumerate(micro_batches):
        ids = batch["input_ids"].to(device, non_blocking=True)
        sample_ids = batch["sample_ids"].to(device, non_blocking=True)
        # Keyed by each sequence's identity (and the step, unless static): the same masks at any
        # world size or micro-batch.
        m = mask_batch(ids, batch["word_starts"].to(device, non_blocking=True), special, cfg.masking,
                       sample_ids=sample_ids, step=step, rate=rate_at_step(cfg.masking, step, cfg.train.max_steps))
        # Rows packed full have no padding: no mask lets SDPA take its fast path.
        attention_mask = (ids != special.pad) if batch.get("has_padding", True) else None
        masked.append((m, attention_mask, ids.numel() if attention_mask is None else attention_mask.sum(), sample_ids))
    # The loss is normalised by the masked-token count of the whole step, all ranks together:
    # DeepSpeed then divides by grad_accum and averages over ranks, which this undoes.
    predicted = torch.stack([m.num_masked for m, *_ in masked]).sum().double().reshape(1)
    dist.all_reduce(predicted)
    scale = world * len(masked) / predicted.clamp(min=1.0)
    flags = torch.zeros(3, device=device)                     # [non-finite loss, stop requested, bad input]
    flags[2] = float(bad_input.read_failed(micro_batches))
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    grad_norm = None
    for i, (m, attention_mask, tokens, sample_ids) in enumerate(masked):
        # Dropout keyed like the masks, by each row's sample id and the step (pretrain/model/keyed_dropout.py).
        engine.module.dropout_key.set(sample_ids, step)
        with eng.eager_forward(engine, eager=attention_mask is not None):
            loss_sum, correct, count = engine(m.input_ids, attention_mask, m.positions, m.labels)
        flags[0] = torch.maximum(flags[0], (~torch.isfinite(loss_sum.detach())).float())
        sums[:3] += torch.stack([loss_sum.detach().double(), correct.double(), count.double()])
        sums[3] += tokens
        engine.backward(loss_sum * scale)
        if i == len(masked) - 1:
            flags[1] = float(stop.requested)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)      # every rank skips or stops together
            optimizer.skip_next_step = bool(flags[0]) or bool(flags[2])
            if want_grad_norm and cfg.impl.zero_stage == 0:
                grad_norm = eng.local_grad_norm(engine)
        engine.step()
    optimizer.skip_next_step = False
    return StepResult(sums, bool(flags[0]), bool(flags[1]), grad_norm, bool(flags[2]))


class ThroughputWindow:
    """Sums over the steps since the last log line: what the loss and speed metrics average."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.seconds = self.data_wait = 0.0
        self.steps = 0

    def add(self, result: StepResult, seconds: float, data_wait: float) -> None:
        self.seconds, self.data_wait, self.steps = self.seconds + seconds, self.data_wait + data_wait, self.steps + 1
        if not result.nonfinite:                              # skipped steps are not averaged in
            self.sums += result.sums

    def metrics(self, global_batch: int, world: int, flops_per_seq: float, peak: float) -> dict:
        dist.all_reduce(self.sums)
        loss_sum, correct, count, tokens = self.sums.tolist()
        seqs_per_s = global_batch * self.steps / self.seconds
        out = {"train/loss": loss_sum / count if count else float("nan"),
               "train/accuracy": correct / count if count else float("nan"),
               "perf/tokens_per_s": tokens / self.seconds, "perf/samples_per_s": seqs_per_s,
               "perf/mfu": flops_per_seq * seqs_per_s / world / (peak * 1e12),
               "perf/step_time_s": self.seconds / self.steps, "perf/data_wait_s": self.data_wait / self.steps}
        self.__init__(self.sums.device)
        return out


def fit(cfg: Config, manifest: dict, tasks: list, resume_from: str | None, info: eng.DistInfo,
        stop: StopSignal) -> int:
    rank, world, device = info.rank, info.world, info.device
    precision, why = hardware.resolve_precision(cfg.impl.precision, device)
    if device.type == "cpu" and cfg.impl.keep_freed_cpu_memory:
        hardware.keep_freed_cpu_memory()        # no page faults on every step's large tensors
    special, seq_len = SpecialIds.from_manifest(manifest), manifest["seq_len"]
    torch.manual_seed(cfg.train.seed)                       # identical initial weights on every rank
    model = build_model(cfg.model, manifest["tokenizer"]["vocab_size"], special, cfg.impl, seq_len=seq_len,
                        shape_from=phases.model_shape_file(cfg, resume_from))
    model.dropout_key = keyed_dropout.install(model.hf_model, cfg.train.seed)   # the same at any layout
    engine, scheduler, ds_config, optimizer = eng.initialize(model, cfg, info, precision)
    state = TrainState(config=configlib.to_dict(cfg))
    resume_from = eng.rank0_value(resume_from)     # the first rank chose it, holding the run lock
    if resume_from:
        state.load_state_dict(checkpointing.load(engine, cfg, resume_from)[STATE_KEY])
    origin = phases.start_from(engine, cfg) if cfg.train.init_from_checkpoint and not resume_from else {}
    log.info(continue_schedule(scheduler, cfg))       # the config's schedule, whatever a checkpoint held
    if cfg.compile_now(cfg.train.max_steps - state.step, device.type, precision):
        engine.compile()
    grad_accum = cfg.grad_accum_steps(world)
    stream = mixture.make_train_stream(cfg, manifest, rank, world, cfg.impl.num_workers, cfg.impl.prefetch_factor)
    if resume_from:
        stream.load_state_dict(state.data)       # another world size or micro-batch continues the same order
    if rank == 0 and cfg.train.resume == "none":      # a fresh start is a new tracking run too
        (Path(cfg.train.out_dir) / "mlflow_run_id").unlink(missing_ok=True)
    tracker = make_tracker(phases.tracked_under(cfg, origin), rank, resume_step=state.step)
    resolved_yaml = configlib.dump_yaml(cfg)
    state.run_id = eng.rank0_value(tracker.start(state.run_id, {**run_params(cfg, world, precision, manifest), **origin},
                                              {"config.yaml": resolved_yaml, "deepspeed.json": json.dumps(ds_config, indent=2)}))
    resume_log.relog(tracker, state)      # a kill may have cut the checkpoint step's line short
    flops_per_seq = mlm_flops_per_sequence(model.hf_model.config, seq_len, cfg.masking.rate * seq_len,
                                           cfg.impl.sparse_head)
    peak, peak_source = hardware.peak_tflops(device, precision, cfg.impl.peak_tflops)
    mfu_check = hardware.MfuCheck(peak, peak_source)
    log.info("start: step %d%s, world %d, grad_accum %d, precision %s (%s), ZeRO %d, %d params, "
             "peak %.3f TFLOP/s per process (%s)", state.step, f" (resumed from {resume_from})" if resume_from else "",
             world, grad_accum, precision, why, cfg.impl.zero_stage, eng.num_parameters(model), peak, peak_source)
    if mixture.is_mixture(cfg):
        log.info("data mixture:\n  %s", "\n  ".join(mixture.plan_lines(stream, cfg.train.max_steps)))

    def emit(metrics: dict, step: int) -> None:
        if metrics:
            log.info("step %d %s", step, " ".join(f"{k.split('/', 1)[-1]}={_fmt(v)}" for k, v in metrics.items()))
            tracker.log_metrics(metrics, step)
            resume_log.remember(state, metrics, step)

    def probe(step: int) -> None:
        """The downstream probe on the trainer's own weights (whole at ZeRO-3: every rank calls)."""
        engine.eval()
        with eng.full_weights(engine) as module:
            emit(probe_metrics(module.hf_model.base_model, tasks, device, cfg.eval.downstream_batch_size), step)
        engine.train()

    status = "FAILED"
    try:
        if tasks and state.step == 0:          # what the probe scores mean: random weights, majority class
            emit(baseline_metrics(model.hf_model.config, tasks, device, cfg.eval.downstream_batch_size), 0)
        batches, window, nonfinite_in_a_row = iter(stream), ThroughputWindow(device), 0
        resume_log.restore_window(window, state.log_window, rank)   # the first log averages the whole window
        while state.step < cfg.train.max_steps:
            engine.train()
            t_start = time.perf_counter()
            micro = bad_input.next_micro_batches(batches, grad_accum, special, cfg.impl.micro_batch_size, seq_len)
            t_data = time.perf_counter()
            will_log = (state.step + 1) % cfg.train.log_every == 0 or state.step + 1 == cfg.train.max_steps
            result = train_step(engine, optimizer, micro, state.step, cfg, special, info, stop, will_log)
            if result.bad_input:
                bad_input.report(micro, rank)
                return EXIT_BAD_INPUT
            state.step += 1
            state.samples_consumed = stream.samples_consumed
            state.tokens_seen += cfg.train.global_batch_size * seq_len
            window.add(result, time.perf_counter() - t_start, t_data - t_start)
            step, last = state.step, state.step == cfg.train.max_steps

            if result.nonfinite:
                nonfinite_in_a_row, state.nonfinite_total = nonfinite_in_a_row + 1, state.nonfinite_total + 1
                log.warning("step %d: non-finite loss on some rank; update skipped (%d in a row)", step,
                            nonfinite_in_a_row)
                if nonfinite_in_a_row >= cfg.train.max_nonfinite_in_a_row:
                    emit({"train/nonfinite_skipped": state.nonfinite_total}, step)
                    log.error("stopping: %d non-finite losses in a row (last at step %d); the last complete "
                              "checkpoint is untouched. Lower optim.lr, raise warmup or check the data.",
                              nonfinite_in_a_row, step)
                    return EXIT_NONFINITE
            else:
                nonfinite_in_a_row = 0

            if will_log:
                metrics = window.metrics(cfg.train.global_batch_size, world, flops_per_seq, peak)
                mfu_check(metrics["perf/mfu"])
                grad_norm = engine.get_global_grad_norm() if cfg.impl.zero_stage else result.grad_norm
                emit({**metrics, "train/lr": scheduler.get_last_lr()[0],
                      "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                      "perf/memory_gb": _memory_gb(device), "train/tokens_seen": state.tokens_seen,
                      "train/nonfinite_skipped": state.nonfinite_total,
                      **mixture.data_metrics(stream, step, cfg.train.max_steps),
                      **({"train/mask_rate": rate_at_step(cfg.masking, step - 1, cfg.train.max_steps)}
                         if cfg.masking.rate_end is not None else {})}, step)
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last:
                emit(evaluate(engine, cfg, special, info), step)
            if tasks and probe_due(step, cfg.eval.downstream_every, cfg.train.eval_every, last):
                probe(step)
            halting = step == cfg.train.halt_at_step
            periodic = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and not result.nonfinite
            if result.stop or halting or last or periodic:
                state.log_window = resume_log.window_state(window)
                export = last or bool(cfg.train.export_every and step % cfg.train.export_every == 0)
                checkpoint(engine, cfg, model, manifest, tracker, state, stream, resolved_yaml, export, final=last)
            if result.stop:
                log.warning("%s: checkpointed at step %d; exiting for requeue",
                            f"signal {stop.name}" if stop.name else "a signal on another rank", step)
                status = "KILLED"
                return EXIT_REQUEUE
            if halting and not last:
                log.info("train.halt_at_step=%d reached: checkpointed; resume with the same command", step)
                status = "FINISHED"
                return 0
        if not final_export_done(cfg):
            # Killed after the final checkpoint and before its export: finish what that run would have.
            log.info("the final checkpoint at step %d has no export yet: evaluating and exporting it", state.step)
            emit(evaluate(engine, cfg, special, info), state.step)
            if tasks:
                probe(state.step)
            export_final(cfg, tracker, state.step)
        if rank == 0:
            report_at_end(cfg, manifest, tracker)      # never raises; logged as the run's report/ artifact
        status = "FINISHED"
        return 0
    finally:
        tracker.finish(status)        # flushes what it buffered and marks the run


def checkpoint(engine, cfg: Config, model, manifest: dict, tracker, state: TrainState, stream: TrainStream,
               resolved_yaml: str, export: bool, final: bool) -> None:
    """A complete checkpoint (with the config, model config, manifest and tokenizer beside it, so
    that it exports on its own), recorded by the tracker; optionally exported to Hugging Face."""
    state.data = stream.state_dict()
    snapshot = state.state_dict()
    readable = {k: v for k, v in snapshot.items() if k != "rng"}      # for checks before any process group
    tag = checkpointing.save(engine, cfg, state.step, {STATE_KEY: snapshot},
                             {files.CONFIG_FILE: resolved_yaml, files.HF_CONFIG_FILE: model.hf_model.config.to_json_string(),
                              files.MANIFEST_FILE: json.dumps(manifest), files.STATE_FILE: json.dumps(readable)},
                             {files.TOKENIZER_DIR: Path(cfg.data.dir) / manifest["tokenizer"]["path"]})
    tracker.log_checkpoint(tag, state.step, str(checkpointing.checkpoint_root(cfg) / tag))
    if export:
        if final:
            export_final(cfg, tracker, state.step)
        elif dist.get_rank() == 0:
            export_to(cfg, tag, Path(cfg.train.out_dir) / f"hf_step{state.step:08d}")
            tracker.log_model(str(Path(cfg.train.out_dir) / f"hf_step{state.step:08d}"), state.step, final=False)
    dist.barrier()


EXPORT_SOURCE = "EXPORTED_FROM"     # inside an export: the checkpoint tag it was made from


def export_to(cfg: Config, tag: str, out: Path) -> None:
    """Export checkpoint ``tag`` to ``out`` atomically: a kill leaves the old folder or none."""
    import shutil

    from pretrain.checkpoint.export import export_checkpoint

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(checkpointing.checkpoint_root(cfg), tag, tmp)
    (tmp / EXPORT_SOURCE).write_text(tag + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def final_export_done(cfg: Config) -> bool:
    source = Path(cfg.train.out_dir) / "hf_final" / EXPORT_SOURCE
    return source.is_file() and source.read_text().strip() == checkpointing.tag_for_step(cfg.train.max_steps)


def export_final(cfg: Config, tracker, step: int) -> None:
    if dist.get_rank() == 0:
        out = Path(cfg.train.out_dir) / "hf_final"
        export_to(cfg, checkpointing.tag_for_step(step), out)
        tracker.log_model(str(out), step, final=True)
    dist.barrier()


def _memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def _fmt(v) -> str:
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m pretrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML file (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.max_steps=100")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


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
        # The first rank holds the run folder from here on; a previous job still writing its
        # checkpoint is waited for, before the checkpoint to resume from is chosen.
        run_lock = checkpointing.RunLock(cfg.train.out_dir) if first_rank else None   # noqa: F841 (held)
        manifest, resume_from = check_inputs(cfg)
        # Probe examples no longer than the sequences the model is trained on (its positions may end there).
        specs = [dataclasses.replace(t, max_length=min(t.max_length, manifest["seq_len"]))
                 for t in cfg.eval.downstream]
        tasks = prepare_tasks(specs, Path(cfg.data.dir) / manifest["tokenizer"]["path"], data_dir=cfg.data.dir,
                              manifest=manifest)
    except (ConfigError, ShardError, TaskError) as exc:
        if first_rank:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stop = StopSignal()          # from here on, SIGUSR1/SIGTERM mean "checkpoint after the current step"
    if os.environ.get("LOCAL_RANK", "0") == "0":
        stale_shm.remove_stale()     # /dev/shm segments of killed runs (no live process maps them)
    info = eng.init_distributed(cfg)
    try:
        return fit(cfg, manifest, tasks, resume_from, info, stop)
    except ShardError as exc:    # found while reading: name the shard, no traceback on every rank
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        eng.release_shared_memory()


if __name__ == "__main__":
    sys.exit(main())
