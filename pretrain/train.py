"""Pretrain a BERT-style encoder with masked-language modelling under DeepSpeed ZeRO.

    python -m pretrain.train --config configs/tiny.yaml data.dir=shards/ train.max_steps=100
    deepspeed --num_gpus 8 --module pretrain.train --config configs/base.yaml data.dir=...

``fit`` is the whole training loop: fetch ``grad_accum`` micro-batches, mask them on the device,
forward/backward through the ZeRO engine, step, log, evaluate, checkpoint. Exit codes: 0 done,
3 checkpointed after SIGUSR1/SIGTERM (requeue me), 4 too many non-finite losses, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep.shard_format import ShardError, load_manifest
from pretrain import configlib, engine as eng
from pretrain.config import Config, ConfigError, load_config
from pretrain.data import TrainStream, check_manifest, eval_batches
from pretrain.flops import measure_matmul_peak_tflops, mlm_flops_per_sequence
from pretrain.masking import SpecialIds, eval_masking_config, mask_batch, mask_generator
from pretrain.model import build_model
from pretrain.monitor import MetricLog, StopSignal, dropout_seed, run_params
from pretrain.tracking import make_tracker, share_run_id

log = logging.getLogger("pretrain")
EXIT_REQUEUE, EXIT_NONFINITE, EXIT_BAD_INPUT = 3, 4, 2


def fit(cfg: Config, manifest: dict, info: eng.DistInfo, stop: StopSignal) -> int:
    device, rank, world = info.device, info.rank, info.world
    precision = eng.resolve_precision(cfg, device)
    special = SpecialIds.from_manifest(manifest)
    seq_len = manifest["seq_len"]
    torch.manual_seed(cfg.train.seed)                       # identical initial weights on every rank
    model = build_model(cfg.model, manifest["tokenizer"]["vocab_size"], special, cfg.impl, seq_len=seq_len)
    engine, optimizer, scheduler, ds_config = eng.initialize(model, cfg, info, precision)
    if cfg.impl.compile:
        engine.compile()
    client_opt = eng.inner_optimizer(engine)
    resumed_tag, state = eng.load_checkpoint(engine, cfg)
    step, tokens_seen = state.get("step", 0), state.get("tokens_seen", 0)
    if state.get("rng"):
        eng.set_rng_state(state["rng"])
    grad_accum = cfg.grad_accum_steps(world)

    if rank == 0 and cfg.train.resume == "none":      # a fresh start is a new tracking run too
        (Path(cfg.train.out_dir) / "mlflow_run_id").unlink(missing_ok=True)
    tracker = make_tracker(cfg, rank)
    resolved_yaml = configlib.dump_yaml(cfg)
    run_id = share_run_id(tracker.start(state.get("run_id"), run_params(cfg, world, precision, manifest),
                                        {"config.yaml": resolved_yaml,
                                         "deepspeed.json": json.dumps(ds_config, indent=2)}))
    metrics = MetricLog(Path(cfg.train.out_dir), rank, tracker, resume_step=step)
    stream = TrainStream(cfg.data.dir, manifest, cfg.data.train_split, rank, world, cfg.impl.micro_batch_size,
                         cfg.train.global_batch_size, cfg.data.seed, cfg.impl.num_workers, cfg.impl.prefetch_factor,
                         start_samples=state.get("samples_consumed", 0))
    batches = iter(stream)
    flops_per_seq = mlm_flops_per_sequence(model.hf_model.config, seq_len,
                                           cfg.masking.rate * seq_len, cfg.impl.sparse_head)
    peak = cfg.impl.peak_tflops or measure_matmul_peak_tflops(device, torch.bfloat16 if precision == "bf16"
                                                              else torch.float32, seconds=0.5)
    if rank == 0:
        log.info("start: step %d%s, world %d, grad_accum %d, precision %s, ZeRO %d, %d params, peak %.2f TFLOP/s",
                 step, f" (resumed from {resumed_tag})" if resumed_tag else "", world, grad_accum, precision,
                 cfg.impl.zero_stage, sum(p.numel() for p in model.parameters()), peak)
    nonfinite_in_a_row, nonfinite_total = 0, state.get("nonfinite_total", 0)
    window = torch.zeros(4, dtype=torch.float64, device=device)   # loss_sum, correct, predicted, tokens
    window_time, window_wait, window_steps = 0.0, 0.0, 0
    stage0_grad_norm = None
    try:
        while step < cfg.train.max_steps:
            engine.train()
            t_start = time.perf_counter()
            micro = [next(batches) for _ in range(grad_accum)]
            t_data = time.perf_counter()
            masked = []
            for i, batch in enumerate(micro):
                ids = batch["input_ids"].to(device, non_blocking=True)
                starts = batch["word_starts"].to(device, non_blocking=True)
                gen = mask_generator(cfg.masking.seed, step, rank, i, device)
                masked.append((mask_batch(ids, starts, special, cfg.masking, gen), ids != special.pad))
            # The loss is normalised by the masked-token count of the whole step, all ranks together:
            # DeepSpeed then divides by grad_accum and averages over ranks, which this undoes.
            predicted = torch.stack([m.num_masked for m, _ in masked]).sum().double().reshape(1)
            dist.all_reduce(predicted)
            scale = world * grad_accum / predicted.clamp(min=1.0)
            local_bad = torch.zeros(2, device=device)                 # [non-finite loss, stop requested]
            step_sums = torch.zeros(4, dtype=torch.float64, device=device)
            for i, (m, attention_mask) in enumerate(masked):
                torch.manual_seed(dropout_seed(cfg.train.seed, step, rank, i))   # resume-exact dropout
                loss_sum, correct, count = engine(m.input_ids, attention_mask, m.positions, m.labels)
                local_bad[0] = torch.maximum(local_bad[0], (~torch.isfinite(loss_sum.detach())).float())
                step_sums[:3] += torch.stack([loss_sum.detach().double(), correct.double(), count.double()])
                step_sums[3] += attention_mask.sum()
                engine.backward(loss_sum * scale)
                if i == len(masked) - 1:
                    local_bad[1] = float(stop.requested)
                    dist.all_reduce(local_bad, op=dist.ReduceOp.MAX)   # every rank skips or stops together
                    client_opt.skip_next_step = bool(local_bad[0])
                    if cfg.impl.zero_stage == 0 and (step + 1) % cfg.train.log_every == 0:
                        stage0_grad_norm = eng.local_grad_norm(engine)   # DeepSpeed keeps none at stage 0
                engine.step()
            client_opt.skip_next_step = False
            step += 1
            tokens_seen += int(cfg.train.global_batch_size * seq_len)
            t_end = time.perf_counter()
            window_time, window_wait, window_steps = window_time + t_end - t_start, window_wait + t_data - t_start, window_steps + 1

            if local_bad[0]:
                nonfinite_in_a_row, nonfinite_total = nonfinite_in_a_row + 1, nonfinite_total + 1
                log.warning("step %d: non-finite loss on some rank; update skipped (%d in a row)", step, nonfinite_in_a_row)
                if nonfinite_in_a_row >= cfg.train.max_nonfinite_in_a_row:
                    metrics.emit({"train/nonfinite_skipped": nonfinite_total}, step)
                    log.error("stopping: %d non-finite losses in a row (last at step %d); the last complete "
                              "checkpoint is untouched. Lower optim.lr, raise warmup or check the data.",
                              nonfinite_in_a_row, step)
                    metrics.close("FAILED")
                    return EXIT_NONFINITE
            else:
                nonfinite_in_a_row = 0
                window += step_sums                                    # skipped steps are not averaged in

            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                dist.all_reduce(window)
                loss_sum, correct, count, tokens = window.tolist()
                seqs_per_s = cfg.train.global_batch_size * window_steps / window_time
                grad_norm = engine.get_global_grad_norm() if cfg.impl.zero_stage else stage0_grad_norm
                metrics.emit({
                    "train/loss": loss_sum / count if count else float("nan"),
                    "train/accuracy": correct / count if count else float("nan"),
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                    "perf/tokens_per_s": tokens / window_time, "perf/samples_per_s": seqs_per_s,
                    "perf/mfu": flops_per_seq * seqs_per_s / world / (peak * 1e12),
                    "perf/step_time_s": window_time / window_steps, "perf/data_wait_s": window_wait / window_steps,
                    "perf/memory_gb": _memory_gb(device), "train/tokens_seen": tokens_seen,
                    "train/nonfinite_skipped": nonfinite_total,
                }, step)
                window.zero_()
                window_time, window_wait, window_steps = 0.0, 0.0, 0

            last = step == cfg.train.max_steps
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last:
                metrics.emit(evaluate(engine, cfg, manifest, special, info), step)
            stopping = bool(local_bad[1])
            halting = step == cfg.train.halt_at_step
            periodic = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and not local_bad[0]
            if stopping or halting or last or periodic:
                client_state = {"step": step, "tokens_seen": tokens_seen, "samples_consumed": stream.samples_consumed,
                                "rng": eng.rng_state(), "run_id": tracker.run_id or run_id,
                                "nonfinite_total": nonfinite_total, "config": configlib.to_dict(cfg)}
                export = last or (cfg.train.export_every and step % cfg.train.export_every == 0)
                checkpoint(engine, cfg, model, manifest, tracker, client_state, resolved_yaml, export, final=last)
            if stopping:
                log.warning("signal %s: checkpointed at step %d; exiting for requeue", stop.name, step)
                metrics.close("KILLED")
                return EXIT_REQUEUE
            if halting and not last:
                log.info("train.halt_at_step=%d reached: checkpointed; resume with the same command", step)
                metrics.close("FINISHED")
                return 0
    except BaseException:
        metrics.close("FAILED")       # the tracker flushes what it buffered and marks the run
        raise
    metrics.close("FINISHED")
    return 0


def checkpoint(engine, cfg: Config, model, manifest: dict, tracker, client_state: dict, resolved_yaml: str,
               export: bool, final: bool) -> None:
    """A complete checkpoint (with the config, model config, manifest and tokenizer beside it, so
    that it exports on its own), recorded by the tracker; optionally exported to Hugging Face."""
    step = client_state["step"]
    tag = eng.save_checkpoint(engine, cfg, step, client_state,
                              {"config.yaml": resolved_yaml, "hf_config.json": model.hf_model.config.to_json_string(),
                               "manifest.json": json.dumps(manifest)},
                              {"tokenizer": Path(cfg.data.dir) / manifest["tokenizer"]["path"]})
    tracker.log_checkpoint(tag, step, str(eng.checkpoint_root(cfg) / tag))
    if export and dist.get_rank() == 0:
        from pretrain.export import export_checkpoint

        out = Path(cfg.train.out_dir) / ("hf_final" if final else f"hf_step{step:08d}")
        export_checkpoint(eng.checkpoint_root(cfg), tag, out)
        tracker.log_model(str(out), step, final=final)
    dist.barrier()


@torch.no_grad()
def evaluate(engine, cfg: Config, manifest: dict, special: SpecialIds, info: eng.DistInfo) -> dict:
    """Validation loss and accuracy at 15% token masking with a fixed seed, whatever training uses."""
    if not any(s["split"] == cfg.data.eval_split for s in manifest["shards"]):
        return {}
    engine.eval()
    mcfg = eval_masking_config(cfg.masking)
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    for i, batch in enumerate(eval_batches(cfg.data.dir, manifest, cfg.data.eval_split, info.rank, info.world,
                                           cfg.impl.micro_batch_size, cfg.train.eval_batches)):
        ids = batch["input_ids"].to(info.device)
        m = mask_batch(ids, batch["word_starts"].to(info.device), special, mcfg,
                       mask_generator(mcfg.seed, 0, info.rank, i, info.device))
        loss_sum, correct, count = engine(m.input_ids, ids != special.pad, m.positions, m.labels)
        sums += torch.stack([loss_sum.double(), correct.double(), count.double()])
    dist.all_reduce(sums)
    engine.train()
    loss_sum, correct, count = sums.tolist()
    if count == 0:
        return {}
    return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}


def _memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def init_from_problems(cfg: Config, manifest: dict) -> list[str]:
    """Continued pretraining: the checkpoint must fit the data, checked before any process starts."""
    if not cfg.model.init_from:
        return []
    folder = Path(cfg.model.init_from)
    try:
        model_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"model.init_from: {folder}/config.json unreadable ({exc})"]
    problems = []
    if model_cfg.get("vocab_size") != manifest["tokenizer"]["vocab_size"]:
        problems.append(f"model.init_from: {folder} has vocab_size {model_cfg.get('vocab_size')}, the data's "
                        f"tokenizer {manifest['tokenizer']['vocab_size']}: prepare the data with that model's tokenizer")
    if model_cfg.get("max_position_embeddings", 512) < manifest["seq_len"]:
        problems.append(f"model.init_from: {folder} has max_position_embeddings "
                        f"{model_cfg.get('max_position_embeddings')} < the data's seq_len {manifest['seq_len']}")
    data_vocab = Path(cfg.data.dir) / manifest["tokenizer"]["path"] / "vocab.txt"
    if (folder / "vocab.txt").is_file() and data_vocab.is_file() and \
            (folder / "vocab.txt").read_bytes() != data_vocab.read_bytes():
        problems.append(f"model.init_from: {folder}/vocab.txt differs from the vocabulary the data was "
                        f"tokenized with ({data_vocab})")
    return problems


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    # Everything that can be wrong with the input is found before any process group starts.
    try:
        cfg = load_config(args.config, args.overrides)
        manifest = load_manifest(cfg.data.dir)
        has_eval = any(s["split"] == cfg.data.eval_split for s in manifest.get("shards", []))
        problems = check_manifest(manifest, cfg.data.dir, max_positions=cfg.model.max_position_embeddings,
                                  splits=[cfg.data.train_split] + ([cfg.data.eval_split] if has_eval else []))
        problems += init_from_problems(cfg, manifest)
        if problems:
            raise ConfigError(problems, f"{cfg.data.dir}/manifest.json")
    except (ConfigError, ShardError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stop = StopSignal()          # from here on, SIGUSR1/SIGTERM mean "checkpoint after the current step"
    info = eng.init_distributed(cfg)
    if info.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        return fit(cfg, manifest, info, stop)
    except ShardError as exc:       # a shard that fails mid-run (e.g. an out-of-range token id): named, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
