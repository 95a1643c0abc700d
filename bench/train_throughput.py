"""Training tokens/s of our trainer against the Hugging Face ``Trainer``, side by side, with MFU.

    python bench/train_throughput.py [--steps 24] [--warmup-steps 8] [--batch-size 32] [--precision bf16]
                                     [--threads 2] [--variants hf ours ours-dense ours-compile] [--repeats 1]
    python bench/train_throughput.py --breakdown --variants ours      # where our step's time goes

One machine, one process per measurement (world size 1), the same shards, model shape
(``configs/mini.yaml``: 4 layers, hidden 256, 4 heads, FFN 1024, dropout 0.1), batch size, optimiser
(``torch.optim.AdamW``, same lr/betas/eps/weight decay/clipping/schedule), precision and thread count
for every row:

* ``hf``: ``transformers.Trainer`` + ``DataCollatorForLanguageModeling(mlm_probability=0.15)`` over
  the shards' ``input_ids`` (a torch ``Dataset`` of dicts), ``BertForMaskedLM`` built from the same
  ``BertConfig`` as ours (SDPA attention), ``optim="adamw_torch"`` (``hf-fused``: HF's default
  ``adamw_torch_fused``), ``bf16=True`` (autocast over fp32 weights) or fp32. This is what
  ``run_mlm.py`` does; its MLM head runs on every token.
* ``ours*``: the real entry point, ``python -m pretrain.train --config configs/mini.yaml`` with
  ZeRO stage 0, no data workers, no tracking (DeepSpeed bf16: bf16 weights, fp32 master copy); eager
  or ``impl.compile=true``, sparse or dense (``impl.sparse_head=false``) MLM head; see ``VARIANTS``.

Measured: wall time from the end of step ``--warmup-steps`` to the end of the last step (HF: a
``TrainerCallback``; ours: arrival of the trainer's own ``step N`` log lines, whose logging window is
set to the warm-up length), over sequences x seq_len tokens. Our trainer's own ``perf/tokens_per_s``
(``metrics.jsonl``, first window dropped, non-padding tokens) is printed beside it as a cross-check.
MFU: ``pretrain.flops.mlm_flops_per_sequence`` (the dense-head count for rows whose head runs on every
token) against ``measure_matmul_peak_tflops`` in the precision used, measured in this run with the
same threads (the higher of a measurement before and after the runs).

The machine may be shared: each row also shows its *CPU share* (CPU seconds the process got in the
timed window / (wall seconds x threads); ~100% when it had its cores to itself) and the 1-minute load.
With ``--repeats`` the variants run round-robin and the fastest run of each counts.

Shards: ``--data DIR``, or the embedded Wikipedia sample sharded with the real ``data_prep`` CLI into
``--work-dir`` (bert-base-uncased vocabulary, 30,522; seq len 128).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import ensure_sample_shards, format_table, load_average, thread_env  # noqa: E402

CONFIG = REPO / "configs" / "mini.yaml"

# name -> (description, trainer overrides, MLM head on every token?)
VARIANTS: dict[str, tuple[str, list[str], bool]] = {
    "hf": ("HF Trainer + DataCollatorForLanguageModeling", [], True),
    "hf-fused": ("HF Trainer, optim=adamw_torch_fused (HF's default)", [], True),
    "ours": ("ours, eager, sparse head", [], False),
    "ours-dense": ("ours, eager, dense head", ["impl.sparse_head=false"], True),
    "ours-compile": ("ours, torch.compile, sparse head", ["impl.compile=true"], False),
    "ours-compile-dense": ("ours, torch.compile, dense head", ["impl.compile=true", "impl.sparse_head=false"], True),
    "ours-compile-fixed": ("ours, torch.compile, sparse head, masking.fixed_count",
                           ["impl.compile=true", "masking.fixed_count=true"], False),
    "ours-zero1": ("ours, eager, sparse head, ZeRO 1 (configs/mini.yaml)", ["impl.zero_stage=1"], False),
    "ours-fusedopt": ("ours, eager, sparse head, DeepSpeed FusedAdam (CPU op, JIT-built)", ["impl.fused_optimizer='on'"], False),
}
DEFAULT_VARIANTS = ["hf", "ours", "ours-dense", "ours-compile"]
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO step (\d+) ")


@dataclass
class Measurement:
    variant: str
    sequences: int              # after warm-up
    seconds: float              # wall, after warm-up
    metrics_tokens_per_s: float = float("nan")   # ours only: the trainer's own figure
    final_loss: float = float("nan")
    load_before: tuple = ()
    load_after: tuple = ()
    startup_s: float = float("nan")              # process start to the end of the warm-up steps
    # CPU seconds the run got in the timed window / (wall seconds x threads): near 1 on an idle
    # machine (OpenMP threads spin while waiting), lower when other processes took cores.
    cpu_share: float = float("nan")


@dataclass
class Row:
    variant: str
    runs: list[Measurement] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ ours


def trainer_overrides(args, shards: Path, out_dir: Path, peak: float, extra: list[str]) -> list[str]:
    return [f"data.dir={shards}", f"train.out_dir={out_dir}", f"train.max_steps={args.steps}",
            f"train.log_every={args.warmup_steps}", "train.eval_every=0", "train.checkpoint_every=0",
            "train.resume=none", "train.keep_checkpoints=1",
            f"train.global_batch_size={args.batch_size * args.grad_accum}",
            f"impl.micro_batch_size={args.batch_size}", "impl.zero_stage=0", "impl.num_workers=0",
            f"impl.precision={args.precision}", f"impl.peak_tflops={peak}", "tracking.backend=none", *extra]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_ours(variant: str, args, shards: Path, peak: float) -> Measurement:
    out_dir = Path(args.work_dir) / "runs" / variant
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pretrain.train", "--config", str(CONFIG),
           *trainer_overrides(args, shards, out_dir, peak, VARIANTS[variant][1])]
    load_before = load_average()
    started = time.perf_counter()
    seen: dict[int, tuple[float, float]] = {}       # step -> (time its log line arrived, process CPU s)
    with open(out_dir / "stdout.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=thread_env(args.threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            m = _LOG_LINE.match(line)
            if m and int(m.group(2)) in (args.warmup_steps, args.steps):
                seen[int(m.group(2))] = (time.perf_counter(), _cpu_seconds(proc.pid))
        proc.wait()
    if proc.returncode:
        raise RuntimeError(f"{variant}: pretrain.train exited {proc.returncode}; command:\n  {' '.join(cmd)}\n"
                           f"last output:\n{(out_dir / 'stdout.log').read_text()[-3000:]}")
    if args.warmup_steps not in seen or args.steps not in seen:
        raise RuntimeError(f"{variant}: no 'step {args.warmup_steps}' / 'step {args.steps}' log lines in "
                           f"{out_dir / 'stdout.log'}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if "perf/tokens_per_s" in r]
    tokens, seconds, previous = 0.0, 0.0, 0
    for r in windows:                       # the trainer's own figure, first (warm-up) window dropped
        steps_in_window, previous = r["step"] - previous, r["step"]
        if r["step"] > args.warmup_steps:
            tokens += r["perf/tokens_per_s"] * r["perf/step_time_s"] * steps_in_window
            seconds += r["perf/step_time_s"] * steps_in_window
    result = Measurement(
        variant, sequences=(args.steps - args.warmup_steps) * args.batch_size * args.grad_accum,
        seconds=seen[args.steps][0] - seen[args.warmup_steps][0],
        metrics_tokens_per_s=tokens / seconds if seconds else float("nan"),
        final_loss=windows[-1]["train/loss"], load_before=load_before, load_after=load_average(),
        startup_s=seen[args.warmup_steps][0] - started,
        cpu_share=(seen[args.steps][1] - seen[args.warmup_steps][1])
        / (seen[args.steps][0] - seen[args.warmup_steps][0]) / args.threads)
    if not args.keep:
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(out_dir / "hf_final", ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------ HF


def run_hf(variant: str, args, shards: Path) -> Measurement:
    """In a child process of its own, like ours: fresh thread pools and allocator, same environment."""
    out_dir = Path(args.work_dir) / "runs" / variant
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    spec = {"shards": str(shards), "out_dir": str(out_dir), "steps": args.steps, "warmup_steps": args.warmup_steps,
            "batch_size": args.batch_size, "grad_accum": args.grad_accum, "precision": args.precision,
            "threads": args.threads, "optim": "adamw_torch_fused" if variant == "hf-fused" else "adamw_torch"}
    load_before = load_average()
    started = time.time()
    with open(out_dir / "stdout.log", "w") as log:
        done = subprocess.run([sys.executable, __file__, "--hf-worker", json.dumps(spec)], cwd=REPO,
                              env=thread_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{variant}: the HF Trainer run exited {done.returncode}:\n"
                           f"{(out_dir / 'stdout.log').read_text()[-3000:]}")
    res = json.loads((out_dir / "result.json").read_text())
    ends = res["step_end_unix"]
    return Measurement(variant, sequences=(args.steps - args.warmup_steps) * args.batch_size * args.grad_accum,
                       seconds=ends[args.steps - 1] - ends[args.warmup_steps - 1], final_loss=res["final_loss"],
                       load_before=load_before, load_after=load_average(),
                       startup_s=ends[args.warmup_steps - 1] - started,
                       cpu_share=(res["step_end_cpu"][args.steps - 1] - res["step_end_cpu"][args.warmup_steps - 1])
                       / (ends[args.steps - 1] - ends[args.warmup_steps - 1]) / args.threads)


def hf_worker(spec: dict) -> None:
    import numpy as np
    import torch
    from transformers import (AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer,
                              TrainerCallback, TrainingArguments)

    from data_prep.shard_format import iter_blocks, load_manifest
    from pretrain.config import load_config
    from pretrain.masking import SpecialIds
    from pretrain.model import bert_config

    torch.set_num_threads(spec["threads"])
    shards = Path(spec["shards"])
    manifest = load_manifest(shards)
    special = SpecialIds.from_manifest(manifest)
    cfg = load_config(str(CONFIG), [f"data.dir={shards}"])
    ids = np.concatenate([block for entry in sorted(manifest["shards"], key=lambda s: s["name"])
                          if entry["split"] == "train"
                          for block, _ in iter_blocks(shards / entry["name"], manifest["seq_len"])])
    ids = torch.from_numpy(ids.astype(np.int64))

    class Sequences(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "attention_mask": (ids[i] != special.pad).long()}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.cpu: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())
            self.cpu.append(time.process_time())

    tokenizer = AutoTokenizer.from_pretrained(shards / manifest["tokenizer"]["path"])
    if tokenizer.mask_token_id != special.mask or len(tokenizer) != manifest["tokenizer"]["vocab_size"]:
        raise RuntimeError(f"{shards}: the shard folder's tokenizer disagrees with its manifest")
    torch.manual_seed(cfg.train.seed)
    model = BertForMaskedLM(bert_config(cfg.model, manifest["tokenizer"]["vocab_size"], special, "sdpa"))
    o = cfg.optim
    targs = TrainingArguments(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], learning_rate=o.lr, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps, max_grad_norm=o.grad_clip,
        warmup_steps=o.warmup_steps, lr_scheduler_type=o.schedule, optim=spec["optim"],
        bf16=spec["precision"] == "bf16", use_cpu=True, seed=cfg.train.seed, dataloader_num_workers=0,
        logging_strategy="steps", logging_steps=spec["warmup_steps"], save_strategy="no", report_to="none",
        disable_tqdm=True)
    timer = StepTimer()
    trainer = Trainer(model=model, args=targs, train_dataset=Sequences(),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
                      callbacks=[timer])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (Path(spec["out_dir"]) / "result.json").write_text(json.dumps(
        {"step_end_unix": timer.ends, "step_end_cpu": timer.cpu, "final_loss": losses[-1] if losses else float("nan")}))


# ------------------------------------------------------------------------------------------ breakdown


def breakdown(variant: str, args, shards: Path, peak: float) -> str:
    """Where a step of our trainer goes: the calls of ``pretrain.train.fit``'s step, in the same
    order, each timed (on the CPU every op is synchronous, so a phase's time is its own)."""
    import torch
    import torch.distributed as dist

    from data_prep.shard_format import load_manifest
    from pretrain import engine as eng
    from pretrain.config import load_config
    from pretrain.data import TrainStream
    from pretrain.masking import SpecialIds, mask_batch, mask_generator
    from pretrain.model import build_model
    from pretrain.monitor import dropout_seed

    torch.set_num_threads(args.threads)
    out_dir = Path(args.work_dir) / "runs" / f"breakdown-{variant}"
    cfg = load_config(str(CONFIG), trainer_overrides(args, shards, out_dir, peak, VARIANTS[variant][1]))
    manifest = load_manifest(shards)
    if not dist.is_initialized():     # once per process: DeepSpeed caches the world group
        eng.prepare_env()
    info = eng.init_distributed(cfg)
    precision = eng.resolve_precision(cfg, info.device)
    special = SpecialIds.from_manifest(manifest)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, manifest["tokenizer"]["vocab_size"], special, cfg.impl, seq_len=manifest["seq_len"])
    engine, _, _, _ = eng.initialize(model, cfg, info, precision)
    if cfg.impl.compile:
        engine.compile()
    batches = iter(TrainStream(shards, manifest, "train", 0, 1, cfg.impl.micro_batch_size,
                               cfg.train.global_batch_size, cfg.data.seed))
    phases = ["data", "mask", "all_reduce", "forward", "backward", "step"]
    totals = dict.fromkeys(phases, 0.0)
    for step in range(args.steps):
        t = [time.perf_counter()]
        batch = next(batches)
        t.append(time.perf_counter())
        m = mask_batch(batch["input_ids"], batch["word_starts"], special, cfg.masking,
                       mask_generator(cfg.masking.seed, step, 0, 0, info.device))
        attention_mask = batch["input_ids"] != special.pad
        t.append(time.perf_counter())
        predicted = m.num_masked.double().reshape(1)
        dist.all_reduce(predicted)
        scale = 1.0 / predicted.clamp(min=1.0)
        local_bad = torch.zeros(2)          # the loop's second collective: non-finite loss / stop flags
        dist.all_reduce(local_bad, op=dist.ReduceOp.MAX)
        t.append(time.perf_counter())
        torch.manual_seed(dropout_seed(cfg.train.seed, step, 0, 0))
        loss_sum, _, _ = engine(m.input_ids, attention_mask, m.positions, m.labels)
        t.append(time.perf_counter())
        engine.backward(loss_sum * scale)
        t.append(time.perf_counter())
        engine.step()
        t.append(time.perf_counter())
        if step >= args.warmup_steps:
            for name, a, b in zip(phases, t, t[1:]):
                totals[name] += b - a
    n = args.steps - args.warmup_steps
    whole = sum(totals.values())
    rows = [[name, f"{1000 * totals[name] / n:.1f}", f"{100 * totals[name] / whole:.1f}%"] for name in phases]
    rows.append(["total", f"{1000 * whole / n:.1f}",
                 f"{args.batch_size * manifest['seq_len'] * n / whole:,.0f} tokens/s"])
    return format_table([f"{variant}: phase", "ms/step", "share"], rows)


# ------------------------------------------------------------------------------------------ report


def measure_peak(precision: str, threads: int, seconds: float) -> float:
    import torch

    from pretrain.flops import measure_matmul_peak_tflops

    torch.set_num_threads(threads)
    return measure_matmul_peak_tflops("cpu", torch.bfloat16 if precision == "bf16" else torch.float32,
                                      seconds=seconds)


def table(rows: list[Row], args, peak: float, manifest: dict) -> str:
    from pretrain.config import MaskingConfig, ModelConfig
    from pretrain.configlib import load_yaml
    from pretrain.flops import mlm_flops_per_sequence

    mini = load_yaml(CONFIG)
    model, rate = ModelConfig(**mini["model"]), MaskingConfig(**mini.get("masking", {})).rate
    seq_len, vocab = manifest["seq_len"], manifest["tokenizer"]["vocab_size"]

    def tokens_per_s(m: Measurement) -> float:
        return m.sequences * seq_len / m.seconds

    best = {r.variant: max(r.runs, key=tokens_per_s) for r in rows}
    base = tokens_per_s(best["hf"]) if "hf" in best else None
    out = []
    for r in rows:
        m = best[r.variant]
        tps = tokens_per_s(m)
        flops = mlm_flops_per_sequence(model, seq_len, rate * seq_len, sparse_head=not VARIANTS[r.variant][2],
                                       vocab_size=vocab)
        out.append([
            r.variant, VARIANTS[r.variant][0], f"{tps:,.0f}", f"{tps / base:.2f}x" if base else "-",
            f"{100 * flops * tps / seq_len / (peak * 1e12):.1f}%",
            f"{args.batch_size * args.grad_accum * seq_len / tps:.3f}",
            "-" if m.metrics_tokens_per_s != m.metrics_tokens_per_s else f"{m.metrics_tokens_per_s:,.0f}",
            f"{m.final_loss:.3f}", f"{m.startup_s:.0f}", f"{100 * m.cpu_share:.0f}%",
            f"{m.load_before[0]:.1f}/{m.load_after[0]:.1f}",
            " ".join(f"{tokens_per_s(x):,.0f}" for x in r.runs),
        ])
    return format_table(["variant", "what", "tokens/s", "vs HF", "MFU", "s/step", "trainer's own tokens/s",
                         "loss", "start-up s", "CPU share", "load before/after", "all runs tokens/s"], out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a shard folder (data_prep shard + finalize); default: the embedded sample")
    p.add_argument("--work-dir", default="/tmp/bench_train_throughput", help="shards, runs and logs")
    p.add_argument("--steps", type=int, default=24, help="optimiser steps per run (default 24)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="steps left out of the timing, also our trainer's logging window (default 8)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences per micro-batch (default 32, configs/mini.yaml's)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step (default 1)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP/torch threads for every run")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=sorted(VARIANTS))
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per variant, round-robin; the fastest counts (a shared machine only slows runs down)")
    p.add_argument("--peak-seconds", type=float, default=2.0, help="matmul peak measurement length")
    p.add_argument("--keep", action="store_true", help="keep checkpoints and exports of our runs")
    p.add_argument("--json", help="also write the raw measurements here")
    p.add_argument("--breakdown", action="store_true",
                   help="instead of the comparison: time the phases of our step (data, masking, all-reduce, "
                        "forward, backward, optimiser) in this process, for each of our --variants")
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hf_worker:
        hf_worker(json.loads(args.hf_worker))
        return 0
    if not 0 < args.warmup_steps < args.steps:
        p.error(f"--warmup-steps must be in [1, --steps), got {args.warmup_steps} with --steps {args.steps}")
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))

    shards = Path(args.data) if args.data else ensure_sample_shards(Path(args.work_dir), seq_len=128)
    manifest = json.loads((shards / "manifest.json").read_text())
    seq_len = manifest["seq_len"]
    print(f"shards {shards}; batch {args.batch_size} x accum {args.grad_accum} x seq {seq_len}, {args.precision}, "
          f"{args.threads} threads, {args.steps} steps ({args.warmup_steps} warm-up), load {load_average()}",
          flush=True)
    peak_before = measure_peak(args.precision, args.threads, args.peak_seconds)
    print(f"matmul peak ({args.precision}, {args.threads} threads): {peak_before:.4f} TFLOP/s", flush=True)

    if args.breakdown:
        for v in args.variants:
            if not v.startswith("hf"):
                print(breakdown(v, args, shards, peak_before), flush=True)
        return 0

    rows = {v: Row(v) for v in args.variants}
    for rep in range(args.repeats):
        for v in args.variants:
            m = run_hf(v, args, shards) if v.startswith("hf") else run_ours(v, args, shards, peak_before)
            rows[v].runs.append(m)
            print(f"[{rep + 1}/{args.repeats}] {v}: {m.sequences * seq_len / m.seconds:,.0f} tokens/s "
                  f"({m.seconds:.1f} s for {m.sequences} sequences; start-up {m.startup_s:.0f} s; "
                  f"CPU share {100 * m.cpu_share:.0f}%; "
                  f"loss {m.final_loss:.3f}; load {m.load_before[0]:.2f} -> {m.load_after[0]:.2f})", flush=True)
    peak_after = measure_peak(args.precision, args.threads, args.peak_seconds)
    peak = max(peak_before, peak_after)
    print(f"\nmatmul peak: {peak_before:.4f} before, {peak_after:.4f} after; MFU uses {peak:.4f} TFLOP/s")
    print(table(list(rows.values()), args, peak, manifest))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "peak_tflops": [peak_before, peak_after],
                                               "runs": [asdict(m) for r in rows.values() for m in r.runs]},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
