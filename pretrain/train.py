"""Pretrain a BERT-style encoder with masked-language modelling under DeepSpeed ZeRO.

    python -m pretrain.train --config configs/tiny.yaml data.dir=shards/ train.max_steps=100
    deepspeed --num_gpus 8 --module pretrain.train --config configs/base.yaml data.dir=...

``fit`` decides when to log, evaluate and checkpoint; ``train_step`` shows the mechanics of one
optimiser step: mask on the device, forward, backward, step. Everything resumable is one
``TrainState``. Exit codes: 0 done, 2 bad input (before any process group starts), 3 checkpointed
after SIGUSR1/SIGTERM (requeue me) or after a hang (``train.hang_timeout_s``: no checkpoint, the last one
resumes), 4 too many non-finite losses, 5 a loss spike past ``train.spike_guard.max_recoveries`` (or
with no checkpoint before it).
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

from data_prep.shard_format import ShardError
from pretrain import checkpointing, configlib, console, engine as eng, hardware
from pretrain.config import Config, ConfigError, load_config
from pretrain.data import TrainStream, eval_batches
from pretrain.downstream import baseline_metrics, prepare_tasks, probe_due, probe_metrics
from pretrain.eval_tasks import TaskError
from pretrain.flops import mlm_flops_per_sequence
from pretrain.health import LayerHealth
from pretrain.masking import SpecialIds, eval_masking_config, mask_batch
from pretrain.model import build_model
from pretrain.preflight import check_inputs
from pretrain.seeds import derive_seed
from pretrain.spike_guard import SpikeGuard, SpikesExhausted, inject_test_noise
from pretrain.state import STATE_KEY, TrainState
from pretrain.tracking import make_tracker, run_params, share_run_id
from pretrain.watchdog import HangWatchdog, hang_for_test

log = logging.getLogger("pretrain")
EXIT_BAD_INPUT, EXIT_REQUEUE, EXIT_NONFINITE, EXIT_SPIKES = 2, 3, 4, 5


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


def train_step(engine, optimizer, micro_batches: list[dict], step: int, cfg: Config, special: SpecialIds,
               info: eng.DistInfo, stop: StopSignal, want_grad_norm: bool, before_step=None) -> StepResult:
    device, rank, world = info.device, info.rank, info.world
    masked = []
    for i, batch in enumerate(micro_batches):
        ids = batch["input_ids"].to(device, non_blocking=True)
        # Keyed by each sequence's identity (and the step, unless static): the same masks at any
        # world size or micro-batch.
        m = mask_batch(ids, batch["word_starts"].to(device, non_blocking=True), special, cfg.masking,
                       sample_ids=batch["sample_ids"].to(device, non_blocking=True), step=step)
        # Rows packed full have no padding: no mask lets SDPA take its fast path.
        attention_mask = (ids != special.pad) if batch.get("has_padding", True) else None
        masked.append((m, attention_mask, ids.numel() if attention_mask is None else attention_mask.sum()))
    # The loss is normalised by the masked-token count of the whole step, all ranks together:
    # DeepSpeed then divides by grad_accum and averages over ranks, which this undoes.
    predicted = torch.stack([m.num_masked for m, _, _ in masked]).sum().double().reshape(1)
    dist.all_reduce(predicted)
    scale = world * len(masked) / predicted.clamp(min=1.0)
    flags = torch.zeros(2, device=device)                     # [non-finite loss, stop requested]
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    grad_norm = None
    for i, (m, attention_mask, tokens) in enumerate(masked):
        torch.manual_seed(derive_seed("dropout", cfg.train.seed, step, rank, i))   # resume-exact dropout
        with eng.eager_forward(engine, eager=attention_mask is not None):
            loss_sum, correct, count = engine(m.input_ids, attention_mask, m.positions, m.labels)
        flags[0] = torch.maximum(flags[0], (~torch.isfinite(loss_sum.detach())).float())
        sums[:3] += torch.stack([loss_sum.detach().double(), correct.double(), count.double()])
        sums[3] += tokens
        engine.backward(loss_sum * scale)
        if i == len(masked) - 1:
            flags[1] = float(stop.requested)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)      # every rank skips or stops together
            optimizer.skip_next_step = bool(flags[0])
            if want_grad_norm and cfg.impl.zero_stage == 0:
                grad_norm = eng.local_grad_norm(engine)
            if before_step:
                before_step()                                 # per-layer health: gradients are whole here
        engine.step()
    optimizer.skip_next_step = False
    return StepResult(sums, bool(flags[0]), bool(flags[1]), grad_norm)


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
    model = build_model(cfg.model, manifest["tokenizer"]["vocab_size"], special, cfg.impl, seq_len=seq_len)
    engine, scheduler, ds_config, optimizer = eng.initialize(model, cfg, info, precision)
    state = TrainState(config=configlib.to_dict(cfg))
    resume_from = eng.rank0_value(resume_from)     # the first rank chose it, holding the run lock
    if resume_from:
        state.load_state_dict(checkpointing.load(engine, cfg, resume_from)[STATE_KEY])
    if cfg.compile_now(cfg.train.max_steps - state.step, device.type, precision):
        engine.compile()
    grad_accum = cfg.grad_accum_steps(world)
    stream = TrainStream(cfg.data.dir, manifest, cfg.data.train_split, rank, world, cfg.impl.micro_batch_size,
                         cfg.train.global_batch_size, cfg.data.seed, cfg.impl.num_workers, cfg.impl.prefetch_factor)
    if resume_from:
        stream.load_state_dict(state.data)       # another world size or micro-batch continues the same order
    if rank == 0 and cfg.train.resume == "none":      # a fresh start is a new tracking run too
        (Path(cfg.train.out_dir) / "mlflow_run_id").unlink(missing_ok=True)
    tracker = make_tracker(cfg, rank, resume_step=state.step)
    resolved_yaml = configlib.dump_yaml(cfg)
    state.run_id = share_run_id(tracker.start(state.run_id, run_params(cfg, world, precision, manifest),
                                              {"config.yaml": resolved_yaml, "deepspeed.json": json.dumps(ds_config, indent=2)}))
    flops_per_seq = mlm_flops_per_sequence(model.hf_model.config, seq_len, cfg.masking.rate * seq_len,
                                           cfg.impl.sparse_head)
    peak, peak_source = hardware.peak_tflops(device, precision, cfg.impl.peak_tflops)
    mfu_check = hardware.MfuCheck(peak, peak_source)
    log.info("start: step %d%s, world %d, grad_accum %d, precision %s (%s), ZeRO %d, %d params, "
             "peak %.3f TFLOP/s per process (%s)", state.step, f" (resumed from {resume_from})" if resume_from else "",
             world, grad_accum, precision, why, cfg.impl.zero_stage, eng.num_parameters(model), peak, peak_source)

    latest, t_fit = {}, time.perf_counter()      # for the end-of-run summary

    def emit(metrics: dict, step: int, suffix: str = "") -> None:
        if metrics:
            log.info("step %d %s%s", step, " ".join(f"{k.split('/', 1)[-1]}={_fmt(v)}" for k, v in metrics.items()),
                     suffix)
            tracker.log_metrics(metrics, step)
            latest.update(metrics)

    def probe(step: int) -> None:
        """The downstream probe on the trainer's own weights (whole at ZeRO-3: every rank calls)."""
        engine.eval()
        with eng.full_weights(engine) as module:
            emit(probe_metrics(module.hf_model.base_model, tasks, device, cfg.eval.downstream_batch_size), step)
        engine.train()

    status, watchdog = "FAILED", HangWatchdog(cfg.train.hang_timeout_s, cfg.train.out_dir, rank, tracker)
    try:
        if tasks and state.step == 0:          # what the probe scores mean: random weights, majority class
            emit(baseline_metrics(model.hf_model.config, tasks, device, cfg.eval.downstream_batch_size), 0)
        batches, window, nonfinite_in_a_row = iter(stream), ThroughputWindow(device), 0
        health = LayerHealth(engine, cfg.train.health_every, cfg.impl.zero_stage)
        guard = SpikeGuard(cfg.train.spike_guard, cfg.train.global_batch_size, checkpointing.checkpoint_root(cfg),
                           tracker) if cfg.train.spike_guard.enabled else None
        while state.step < cfg.train.max_steps:
            engine.train()
            watchdog.step_started()
            t_start = time.perf_counter()
            micro = [next(batches) for _ in range(grad_accum)]
            inject_test_noise(micro, special)                 # test-only (PRETRAIN_TEST_NOISE_STEPS)
            t_data = time.perf_counter()
            hang_for_test(rank, state.step + 1)               # test-only (PRETRAIN_TEST_HANG)
            will_log = (state.step + 1) % cfg.train.log_every == 0 or state.step + 1 == cfg.train.max_steps
            check_health = health.due(state.step + 1)
            result = train_step(engine, optimizer, micro, state.step, cfg, special, info, stop, will_log,
                                health.before_step if check_health else None)
            if check_health:
                tracker.log_metrics(health.after_step(state.step + 1), state.step + 1)
            state.step += 1
            state.samples_consumed = stream.samples_consumed
            state.tokens_seen += cfg.train.global_batch_size * seq_len
            window.add(result, time.perf_counter() - t_start, t_data - t_start)
            watchdog.step_done(state.step, time.perf_counter() - t_start)
            watchdog.allow()         # logging, evaluation, checkpoints, a recovery: not a step's timeout
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
            spike = guard.check(result.sums, state) if guard else None
            if spike:                  # back to the checkpoint before it, past its samples
                try:
                    batches = guard.recover(engine, cfg, state, stream, batches, spike)
                except SpikesExhausted as exc:
                    log.error("stopping: %s", exc)
                    return EXIT_SPIKES
                window = ThroughputWindow(device)
                continue

            if will_log:
                metrics = window.metrics(cfg.train.global_batch_size, world, flops_per_seq, peak)
                mfu_check(metrics["perf/mfu"])
                grad_norm = engine.get_global_grad_norm() if cfg.impl.zero_stage else result.grad_norm
                emit({**metrics, "train/lr": scheduler.get_last_lr()[0],
                      "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                      "perf/memory_gb": _memory_gb(device), "train/tokens_seen": state.tokens_seen,
                      "train/nonfinite_skipped": state.nonfinite_total}, step,
                     f" left={console.time_left(cfg.train.max_steps - step, metrics['perf/step_time_s'])}")
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last:
                emit(evaluate(engine, cfg, manifest, special, info), step)
            if tasks and probe_due(step, cfg.eval.downstream_every, cfg.train.eval_every, last):
                probe(step)
            halting = step == cfg.train.halt_at_step
            periodic = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and not result.nonfinite
            if result.stop or halting or last or periodic:
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
            emit(evaluate(engine, cfg, manifest, special, info), state.step)
            if tasks:
                probe(state.step)
            export_final(cfg, tracker, state.step)
        log.info("%s", console.summary(state, cfg, time.perf_counter() - t_fit, latest, tracker))
        status = "FINISHED"
        return 0
    finally:
        watchdog.stop()
        tracker.finish(status)        # flushes what it buffered and marks the run


def checkpoint(engine, cfg: Config, model, manifest: dict, tracker, state: TrainState, stream: TrainStream,
               resolved_yaml: str, export: bool, final: bool) -> None:
    """A complete checkpoint (with the config, model config, manifest and tokenizer beside it, so
    that it exports on its own), recorded by the tracker; optionally exported to Hugging Face."""
    state.data = stream.state_dict()
    snapshot = state.state_dict()
    readable = {k: v for k, v in snapshot.items() if k != "rng"}      # for checks before any process group
    tag = checkpointing.save(engine, cfg, state.step, {STATE_KEY: snapshot},
                             {"config.yaml": resolved_yaml, "hf_config.json": model.hf_model.config.to_json_string(),
                              "manifest.json": json.dumps(manifest), checkpointing.STATE_FILE: json.dumps(readable)},
                             {"tokenizer": Path(cfg.data.dir) / manifest["tokenizer"]["path"]})
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

    from pretrain.export import export_checkpoint

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with console.chatter_to_file():
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


@torch.no_grad()
def evaluate(engine, cfg: Config, manifest: dict, special: SpecialIds, info: eng.DistInfo) -> dict:
    """Validation loss and accuracy at 15% token masking with a fixed seed, whatever training uses."""
    if not any(s["split"] == cfg.data.eval_split for s in manifest["shards"]):
        return {}
    engine.eval()
    mcfg = eval_masking_config(cfg.masking)
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    for batch in eval_batches(cfg.data.dir, manifest, cfg.data.eval_split, info.rank, info.world,
                              cfg.impl.micro_batch_size, cfg.train.eval_batches):
        ids = batch["input_ids"].to(info.device)
        m = mask_batch(ids, batch["word_starts"].to(info.device), special, mcfg,
                       sample_ids=batch["sample_ids"].to(info.device), step=0)
        with eng.eager_forward(engine, eager=True):
            loss_sum, correct, count = engine(m.input_ids, ids != special.pad, m.positions, m.labels)
        sums += torch.stack([loss_sum.double(), correct.double(), count.double()])
    dist.all_reduce(sums)
    engine.train()
    loss_sum, correct, count = sums.tolist()
    return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count} if count else {}


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
    first_rank = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO if first_rank else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    # Everything that can be wrong with the input is found before any process group starts; every
    # rank finds the same problems, the first one reports them.
    try:
        cfg = load_config(args.config, args.overrides)
        console.quiet_third_party(cfg.train.out_dir, int(os.environ.get("RANK", "0")))
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
