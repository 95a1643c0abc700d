"""Training tokens/s of our trainer against the Hugging Face ``Trainer`` and a bare PyTorch loop, with MFU.

    python bench/train_throughput.py [--shapes mini base] [--precision auto|bf16|fp32] [--threads 2]
                                     [--variants hf ours ours-compile bare ...] [--repeats 1]
    python bench/train_throughput.py --breakdown   # where our step's time goes, phase by phase
    python bench/train_throughput.py --profile     # torch.profiler: ours vs the bare loop, op by op
    python bench/train_throughput.py --leads --threads 1 --cpu-clock   # what each known fix is worth

One machine, one process per measurement (world size 1), the same shards, model shape, batch size,
optimiser hyperparameters (AdamW, lr/betas/eps/weight decay/clipping/schedule of the shape's YAML),
precision and thread count for every row. Shapes: ``mini`` = ``configs/mini.yaml`` (4 x 256, FFN
1024, masking 15%, default batch 32, 24 steps) and ``base`` = ``configs/base.yaml`` (BERT-base,
12 x 768, FFN 3072, masking 30%; default batch 8, 6 steps: a few minutes at most on 2 cores).

* ``hf*``: ``transformers.Trainer`` + ``DataCollatorForLanguageModeling`` (``bench/reference_loops.py``);
  its MLM head runs on every token. ``bf16=True`` is autocast over fp32 weights.
* ``ours*``: the real entry point, ``python -m pretrain.train --config <shape YAML>`` with ZeRO 0,
  no data workers, no tracking (DeepSpeed bf16: bf16 weights, fp32 master copy); see ``VARIANTS``.
* ``bare*``: the efficiency yardstick, a plain PyTorch loop around our model with the same sparse
  head, data stream and masking (``bench/reference_loops.py``).

Measured: wall time from the end of step ``--warmup-steps`` to the end of the last step (HF: a
``TrainerCallback``; bare: the loop itself; ours: arrival of the trainer's own ``step N`` log lines,
whose logging window is the warm-up length), over sequences x seq_len tokens. Our trainer's own
``perf/tokens_per_s`` (``metrics.jsonl``, first window dropped) is printed beside it as a cross-check.
MFU: ``pretrain.model.flops.mlm_flops_per_sequence`` (the dense-head count for rows whose head runs on every
token) against a matmul peak in the precision used with the same threads: the highest of a
measurement before the runs, one after, and the trainer's own (``pretrain.runtime.hardware.peak_tflops``). The CPU model, its flags and what
``impl.precision=auto`` picks are printed first and go into ``--json``.

The machine may be shared: each row also shows its *CPU share* (CPU seconds the process got in the
timed window / (wall seconds x threads); ~100% when it had its cores to itself), *tokens per
CPU-second* (what the work cost, whatever else ran; exact with ``--threads 1``, while spinning
OpenMP threads inflate it with more), *MFU (CPU time)* (the same per CPU-second, against the matmul
peak timed by CPU seconds: the load-proof MFU on a shared machine with ``--threads 1``) and the
1-minute load.
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
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import (
    auto_precision,
    cpu_record,
    ensure_sample_shards,
    format_table,  # noqa: E402
    load_average,
    matmul_peak,
    matmul_peak_cpu_time,
    thread_env,
    trainer_peak,
)
from pretrain import metric_names as names  # noqa: E402

if TYPE_CHECKING:  # numpy and torch are imported once main() has set their thread counts
    from data_prep.common.manifest import Manifest

# shape -> (YAML, overrides every row of ours and of the bare loop gets, default batch, steps, warm-up)
SHAPES: dict[str, tuple[Path, list[str], int, int, int]] = {
    "mini": (REPO / "configs" / "mini.yaml", [], 32, 24, 8),
    # base.yaml trains in document scope; HF's collator attends across the row, so the yardstick runs
    # row scope in every row (ours-doc and ours-compile-doc measure the difference).
    "base": (REPO / "configs" / "base.yaml", ["model.attention_scope=row"], 8, 6, 2),
}


@dataclass(frozen=True)
class Variant:
    what: str
    runner: str  # "hf" | "ours" | "bare"
    overrides: tuple[str, ...] = ()  # ours and bare: config overrides
    dense_head: bool = False  # MLM head on every token (FLOPs counted so)
    options: tuple[tuple[str, object], ...] = ()  # hf: optim; bare: fused / compile


NO_DROPOUT = ("model.hidden_dropout=0", "model.attention_dropout=0")
VARIANTS: dict[str, Variant] = {
    "hf": Variant(
        "HF Trainer + DataCollatorForLanguageModeling", "hf", dense_head=True, options=(("optim", "adamw_torch"),)
    ),
    "hf-fused": Variant(
        "HF Trainer, optim=adamw_torch_fused (HF's default)",
        "hf",
        dense_head=True,
        options=(("optim", "adamw_torch_fused"),),
    ),
    "hf-keepmem": Variant(
        "HF Trainer, with our keep_freed_cpu_memory() (not HF's default)",
        "hf",
        dense_head=True,
        options=(("optim", "adamw_torch"), ("keep_freed_memory", True)),
    ),
    "ours": Variant("ours, eager, sparse head", "ours"),
    "ours-plainloss": Variant(
        "ours, eager, impl.fused_mlm_loss=false (F.linear + F.cross_entropy)", "ours", ("impl.fused_mlm_loss=false",)
    ),
    "ours-flash": Variant("ours, eager, impl.attention=sdpa_flash", "ours", ("impl.attention=sdpa_flash",)),
    "ours-math": Variant("ours, eager, impl.attention=sdpa_math", "ours", ("impl.attention=sdpa_math",)),
    "ours-eagerattn": Variant(
        "ours, eager, impl.attention=eager (HF's explicit attention)", "ours", ("impl.attention=eager",)
    ),
    "ours-dense": Variant("ours, eager, dense head", "ours", ("impl.sparse_head=false",), dense_head=True),
    "ours-compile": Variant("ours, torch.compile, sparse head", "ours", ("impl.compile=true",)),
    "ours-compile-dense": Variant(
        "ours, torch.compile, dense head", "ours", ("impl.compile=true", "impl.sparse_head=false"), dense_head=True
    ),
    "ours-compile-fixed": Variant(
        "ours, torch.compile, sparse head, masking.fixed_count",
        "ours",
        ("impl.compile=true", "masking.fixed_count=true"),
    ),
    "ours-zero1": Variant("ours, eager, sparse head, ZeRO 1", "ours", ("impl.zero_stage=1",)),
    "ours-fusedopt": Variant(
        "ours, eager, impl.fused_optimizer=true (CPU: torch fused AdamW)", "ours", ("impl.fused_optimizer=true",)
    ),
    "ours-unfusedopt": Variant(
        "ours, eager, impl.fused_optimizer=false (torch foreach AdamW)", "ours", ("impl.fused_optimizer=false",)
    ),
    "ours-nodrop": Variant("ours, eager, no dropout", "ours", NO_DROPOUT),
    "ours-drop": Variant("ours, eager, hidden dropout 0.1 (keyed)", "ours", ("model.hidden_dropout=0.1",)),
    "ours-compile-drop": Variant(
        "ours, torch.compile, hidden dropout 0.1 (keyed)", "ours", ("impl.compile=true", "model.hidden_dropout=0.1")
    ),
    # Attention inside each packed document (model.attention_scope): compare with ours / ours-compile.
    "ours-doc": Variant("ours, eager, model.attention_scope=document", "ours", ("model.attention_scope=document",)),
    "ours-compile-doc": Variant(
        "ours, torch.compile, model.attention_scope=document",
        "ours",
        ("impl.compile=true", "model.attention_scope=document"),
    ),
    # What per-layer health (pretrain/guards/health.py) costs: compare with ours / ours-zero1.
    "ours-health10": Variant("ours, eager, train.health_every=10", "ours", ("train.health_every=10",)),
    "ours-zero1-health10": Variant(
        "ours, eager, ZeRO 1, train.health_every=10", "ours", ("impl.zero_stage=1", "train.health_every=10")
    ),
    "bare": Variant(
        "bare PyTorch loop, our model + sparse head, AdamW (foreach)",
        "bare",
        options=(("fused", False), ("compile", False)),
    ),
    "bare-fused": Variant("bare loop, fused AdamW", "bare", options=(("fused", True), ("compile", False))),
    "bare-nodrop-fused": Variant(
        "bare loop, no dropout, fused AdamW", "bare", NO_DROPOUT, options=(("fused", True), ("compile", False))
    ),
    "bare-compile": Variant(
        "bare loop, torch.compile, fused AdamW", "bare", options=(("fused", True), ("compile", True))
    ),
}
DEFAULT_VARIANTS = ["hf", "ours", "ours-compile", "bare", "bare-fused"]
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO step (\d+) ")


@dataclass
class Measurement:
    variant: str
    shape: str
    sequences: int  # after warm-up
    seconds: float  # wall, after warm-up
    metrics_tokens_per_s: float = float("nan")  # ours only: the trainer's own figure
    final_loss: float = float("nan")
    load_before: tuple = ()
    load_after: tuple = ()
    startup_s: float = float("nan")  # process start to the end of the warm-up steps
    # CPU seconds the run got in the timed window / (wall seconds x threads): near 1 on an idle
    # machine (OpenMP threads spin while waiting), lower when other processes took cores.
    cpu_share: float = float("nan")
    memory_gb: float = float("nan")  # ours only: the trainer's perf/memory_gb, its peak
    attention: str = ""  # ours only: the kernel the trainer ran (impl.attention=auto's choice, and why)


@dataclass
class Row:
    variant: str
    shape: str
    runs: list[Measurement] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """One shape's settings, the same for every row of that shape."""

    shape: str
    config: Path
    batch_size: int
    steps: int
    warmup_steps: int


def base_overrides(args, plan: Plan, shards: Path, out_dir: Path) -> list[str]:
    """What every row of ours and of the bare loop shares (the bare loop reads model, masking,
    optim and seeds from the same resolved config)."""
    return [
        f"data.dir={shards}",
        f"train.out_dir={out_dir}",
        f"train.max_steps={plan.steps}",
        f"train.log_every={plan.warmup_steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.resume=none",
        "train.keep_checkpoints=1",
        f"train.global_batch_size={plan.batch_size * args.grad_accum}",
        f"impl.micro_batch_size={plan.batch_size}",
        "impl.zero_stage=0",
        "impl.num_workers=0",
        f"impl.precision={args.precision}",
        "impl.compile=false",
        "impl.device=auto",
        "tracking.backend=none",
        *SHAPES[plan.shape][1],
        *args.set,
    ]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fresh_dir(args, plan: Plan, variant: str) -> Path:
    out_dir = Path(args.work_dir) / "runs" / f"{plan.shape}-{variant}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    return out_dir


def run_ours(variant: str, args, plan: Plan, shards: Path, peak: float) -> Measurement:
    out_dir = _fresh_dir(args, plan, variant)
    cmd = [
        sys.executable,
        "-m",
        "pretrain.train",
        "--config",
        str(plan.config),
        *base_overrides(args, plan, shards, out_dir),
        f"impl.peak_tflops={peak}",
        *VARIANTS[variant].overrides,
    ]
    load_before = load_average()
    started = time.perf_counter()
    seen: dict[int, tuple[float, float]] = {}  # step -> (time its log line arrived, process CPU s)
    with open(out_dir / "stdout.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=thread_env(args.threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        attention = ""
        for line in proc.stdout:
            log.write(line)
            if " INFO attention: " in line:
                attention = line.split(" INFO attention: ", 1)[1].strip()
            m = _LOG_LINE.match(line)
            if m and int(m.group(2)) in (plan.warmup_steps, plan.steps):
                seen[int(m.group(2))] = (time.perf_counter(), _cpu_seconds(proc.pid))
        proc.wait()
    if proc.returncode:
        raise RuntimeError(
            f"{variant}: pretrain.train exited {proc.returncode}; command:\n  {' '.join(cmd)}\n"
            f"last output:\n{(out_dir / 'stdout.log').read_text()[-3000:]}"
        )
    if plan.warmup_steps not in seen or plan.steps not in seen:
        raise RuntimeError(
            f"{variant}: no 'step {plan.warmup_steps}' / 'step {plan.steps}' log lines in {out_dir / 'stdout.log'}"
        )
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if names.PERF_TOKENS_PER_S in r]
    tokens, seconds, previous = 0.0, 0.0, 0
    for r in windows:  # the trainer's own figure, first (warm-up) window dropped
        steps_in_window, previous = r["step"] - previous, r["step"]
        if r["step"] > plan.warmup_steps:
            tokens += r[names.PERF_TOKENS_PER_S] * r[names.PERF_STEP_TIME_S] * steps_in_window
            seconds += r[names.PERF_STEP_TIME_S] * steps_in_window
    (t0, c0), (t1, c1) = seen[plan.warmup_steps], seen[plan.steps]
    result = Measurement(
        variant,
        plan.shape,
        sequences=(plan.steps - plan.warmup_steps) * plan.batch_size * args.grad_accum,
        seconds=t1 - t0,
        metrics_tokens_per_s=tokens / seconds if seconds else float("nan"),
        final_loss=windows[-1][names.TRAIN_LOSS],
        load_before=load_before,
        load_after=load_average(),
        startup_s=t0 - started,
        cpu_share=(c1 - c0) / (t1 - t0) / args.threads,
        memory_gb=max((r.get(names.PERF_MEMORY_GB, float("nan")) for r in windows), default=float("nan")),
        attention=attention,
    )
    if not args.keep:
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(out_dir / "hf_final", ignore_errors=True)
    return result


def run_reference(variant: str, args, plan: Plan, shards: Path) -> Measurement:
    """The HF Trainer or the bare loop, in a child process (``bench/reference_loops.py``)."""
    v = VARIANTS[variant]
    out_dir = _fresh_dir(args, plan, variant)
    spec = {
        "kind": v.runner,
        "shards": str(shards),
        "out_dir": str(out_dir),
        "config": str(plan.config),
        "overrides": base_overrides(args, plan, shards, out_dir) + list(v.overrides),
        "steps": plan.steps,
        "warmup_steps": plan.warmup_steps,
        "batch_size": plan.batch_size,
        "grad_accum": args.grad_accum,
        "precision": args.precision,
        "threads": args.threads,
        **dict(v.options),
    }
    load_before = load_average()
    started = time.time()
    with open(out_dir / "stdout.log", "w") as log:
        done = subprocess.run(
            [sys.executable, str(REPO / "bench" / "reference_loops.py"), json.dumps(spec)],
            cwd=REPO,
            env=thread_env(args.threads),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:
        raise RuntimeError(
            f"{variant}: the {v.runner} run exited {done.returncode}:\n{(out_dir / 'stdout.log').read_text()[-3000:]}"
        )
    res = json.loads((out_dir / "result.json").read_text())
    ends, cpu = res["step_end_unix"], res["step_end_cpu"]
    first, last = plan.warmup_steps - 1, plan.steps - 1
    return Measurement(
        variant,
        plan.shape,
        sequences=(plan.steps - plan.warmup_steps) * plan.batch_size * args.grad_accum,
        seconds=ends[last] - ends[first],
        final_loss=res["final_loss"],
        load_before=load_before,
        load_after=load_average(),
        startup_s=ends[first] - started,
        cpu_share=(cpu[last] - cpu[first]) / (ends[last] - ends[first]) / args.threads,
    )


# ------------------------------------------------------------------------------------------ report


def table(rows: list[Row], args, plan: Plan, peak: float, cpu_peak: float, manifest: Manifest) -> str:
    from pretrain.config.loader import load_yaml
    from pretrain.config.schema import MaskingConfig, ModelConfig
    from pretrain.model.flops import mlm_flops_per_sequence

    raw = load_yaml(plan.config)
    model, rate = ModelConfig(**raw["model"]), MaskingConfig(**raw.get("masking", {})).rate
    seq_len, vocab = manifest.seq_len, manifest.tokenizer.vocab_size

    def tokens_per_s(m: Measurement) -> float:
        return m.sequences * seq_len / m.seconds

    best = {r.variant: max(r.runs, key=tokens_per_s) for r in rows}
    base = tokens_per_s(best["hf"]) if "hf" in best else None
    out = []
    for r in rows:
        m = best[r.variant]
        tps = tokens_per_s(m)
        per_cpu_s = m.sequences * seq_len / (m.seconds * m.cpu_share * args.threads)
        flops = mlm_flops_per_sequence(
            model, seq_len, rate * seq_len, sparse_head=not VARIANTS[r.variant].dense_head, vocab_size=vocab
        )
        out.append(
            [
                r.variant,
                VARIANTS[r.variant].what,
                f"{tps:,.0f}",
                f"{tps / base:.2f}x" if base else "-",
                f"{100 * flops * tps / seq_len / (peak * 1e12):.1f}%",
                f"{plan.batch_size * args.grad_accum * seq_len / tps:.3f}",
                "-" if m.metrics_tokens_per_s != m.metrics_tokens_per_s else f"{m.metrics_tokens_per_s:,.0f}",
                f"{m.final_loss:.3f}",
                "-" if m.memory_gb != m.memory_gb else f"{m.memory_gb:.3f}",
                f"{m.startup_s:.0f}",
                f"{100 * m.cpu_share:.0f}%",
                f"{per_cpu_s:,.0f}",
                f"{100 * flops * per_cpu_s * args.threads / seq_len / (cpu_peak * 1e12):.1f}%",
                f"{m.load_before[0]:.1f}/{m.load_after[0]:.1f}",
                " ".join(f"{tokens_per_s(x):,.0f}" for x in r.runs),
            ]
        )
    return format_table(
        [
            "variant",
            "what",
            "tokens/s",
            "vs HF",
            "MFU",
            "s/step",
            "trainer's own tokens/s",
            "loss",
            "trainer's peak memory GB",
            "start-up s",
            "CPU share",
            "tokens per CPU-s",
            "MFU (CPU time)",
            "load before/after",
            "all runs tokens/s",
        ],
        out,
    )


def ratios(rows: list[Row], seq_len: int, seqs_per_step: int) -> list[str]:
    """The comparisons the goals are stated in, one line each, and when torch.compile pays off."""
    tps = {r.variant: max(m.sequences * seq_len / m.seconds for m in r.runs) for r in rows}
    lines = []
    for name in tps:
        for ref in ("hf", "bare", "bare-fused"):
            if ref in tps and name != ref and (ref == "hf" or name.startswith("ours")):
                lines.append(f"{name} / {ref} = {tps[name] / tps[ref]:.2f}x")
    best = {r.variant: max(r.runs, key=lambda m: m.sequences / m.seconds) for r in rows}
    for dropped, plain in (("ours-drop", "ours-nodrop"), ("ours-compile-drop", "ours-compile")):
        if dropped in tps and plain in tps:
            lines.append(f"what dropout 0.1 costs: {dropped} / {plain} = {tps[dropped] / tps[plain]:.2f}x")
    for document, row in (("ours-doc", "ours"), ("ours-compile-doc", "ours-compile")):
        if document in tps and row in tps:
            lines.append(f"what attention inside documents costs: {document} / {row} = {tps[document] / tps[row]:.2f}x")
    for name, m in best.items():
        if m.attention:
            lines.append(f"{name}: attention {m.attention}")
    for eager, compiled in (("ours", "ours-compile"), ("bare-fused", "bare-compile")):
        if eager in best and compiled in best:
            e, c = best[eager], best[compiled]
            saved = (e.seconds / e.sequences - c.seconds / c.sequences) * seqs_per_step  # s per step
            extra = c.startup_s - e.startup_s
            verdict = (
                "never pays for itself"
                if saved <= 0
                else "no start-up cost"
                if extra <= 0
                else f"pays for itself after ~{extra / saved:,.0f} steps"
            )
            lines.append(
                f"{compiled} vs {eager}: start-up {extra:+.0f} s, {1000 * saved:+.0f} ms/step saved: {verdict}"
            )
    return lines


def plans(args) -> list[Plan]:
    out = []
    for shape in args.shapes:
        config, _, batch, steps, warmup = SHAPES[shape]
        steps = args.steps or steps
        warmup = args.warmup_steps or min(warmup, steps - 1)
        if not 0 < warmup < steps:
            raise SystemExit(f"--warmup-steps must be in [1, --steps), got {warmup} with --steps {steps}")
        out.append(Plan(shape, config, args.batch_size or batch, steps, warmup))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a shard folder (data_prep shard + finalize); default: the embedded sample")
    p.add_argument("--work-dir", default="/tmp/bench_train_throughput", help="shards, runs and logs")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["mini"],
        choices=sorted(SHAPES),
        help="model shapes, one table each (default: mini)",
    )
    p.add_argument("--steps", type=int, help="optimiser steps per run (default: 24 mini, 6 base)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        help="steps left out of the timing, also our trainer's logging window (default: 8 mini, 2 base)",
    )
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch (default: 32 mini, 8 base)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step (default 1)")
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="for every row; auto: what impl.precision=auto picks on this CPU",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP/torch threads for every run")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=sorted(VARIANTS))
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per variant, round-robin; the fastest counts (a shared machine only slows runs down)",
    )
    p.add_argument("--peak-seconds", type=float, default=2.0, help="matmul peak measurement length")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every row, HF's model included (e.g. model.hidden_dropout=0.1)",
    )
    p.add_argument("--keep", action="store_true", help="keep checkpoints and exports of our runs")
    p.add_argument("--json", help="also write the machine record and raw measurements here")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--breakdown",
        action="store_true",
        help="instead of the comparison: median time of each phase of our step (data, masking, "
        "all-reduce, forward, backward, optimiser), in this process, for each of our --variants",
    )
    mode.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison: torch.profiler op tables of our step and the bare loop's",
    )
    mode.add_argument(
        "--leads",
        action="store_true",
        help="instead of the comparison: A/B timings of each known lead for a faster step",
    )
    p.add_argument(
        "--cpu-clock",
        action="store_true",
        help="--breakdown/--leads: time with the process's CPU seconds, not wall time "
        "(use with --threads 1 on a shared machine)",
    )
    args = p.parse_args(argv)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))

    machine = cpu_record()
    config, _, batch, _, _ = SHAPES[args.shapes[0]]
    auto, reason = auto_precision(config, 128, args.batch_size or batch)
    if args.precision == "auto":
        args.precision = auto
    print(
        f"CPU: {machine.get('model')}; flags {' '.join(machine.get('flags', []))}; native bf16 "
        f"{machine.get('native_bf16')}; impl.precision=auto -> {auto} ({reason}); this run: {args.precision}",
        flush=True,
    )
    shards = Path(args.data) if args.data else ensure_sample_shards(Path(args.work_dir), seq_len=128)
    from data_prep.common.manifest import load_manifest

    manifest = load_manifest(shards)
    seq_len = manifest.seq_len
    peak_before, source = matmul_peak(args.precision, args.threads, args.peak_seconds)
    print(f"matmul peak: {peak_before:.4f} TFLOP/s ({source}); load {load_average()}", flush=True)
    peak_trainer, trainer_source = trainer_peak(args.precision, args.threads, args.work_dir)
    cpu_peaks = [matmul_peak_cpu_time(args.precision, args.threads, args.peak_seconds)]
    print(f"the trainer's peak: {peak_trainer:.4f} TFLOP/s ({trainer_source})", flush=True)

    if args.breakdown or args.profile or args.leads:
        return diagnose(args, plans(args), shards, seq_len)

    results: dict[str, list[Row]] = {}
    for plan in plans(args):
        print(
            f"\n{plan.shape} ({plan.config.name}): batch {plan.batch_size} x accum {args.grad_accum} x seq {seq_len}, "
            f"{args.precision}, {args.threads} threads, {plan.steps} steps ({plan.warmup_steps} warm-up)"
            + (f", with {' '.join(args.set)}" if args.set else ""),
            flush=True,
        )
        rows = {v: Row(v, plan.shape) for v in args.variants}
        for rep in range(args.repeats):
            for v in args.variants:
                run = run_ours if VARIANTS[v].runner == "ours" else run_reference
                m = run(v, args, plan, shards, peak_before) if run is run_ours else run(v, args, plan, shards)
                rows[v].runs.append(m)
                print(
                    f"[{rep + 1}/{args.repeats}] {plan.shape} {v}: {m.sequences * seq_len / m.seconds:,.0f} tokens/s "
                    f"({m.seconds:.1f} s for {m.sequences} sequences; start-up {m.startup_s:.0f} s; "
                    f"CPU share {100 * m.cpu_share:.0f}%; loss {m.final_loss:.3f}; "
                    f"load {m.load_before[0]:.2f} -> {m.load_after[0]:.2f})",
                    flush=True,
                )
        results[plan.shape] = list(rows.values())
    peak_after, _ = matmul_peak(args.precision, args.threads, args.peak_seconds)
    peak = max(peak_before, peak_after, peak_trainer)
    cpu_peaks.append(matmul_peak_cpu_time(args.precision, args.threads, args.peak_seconds))
    print(
        f"\nmatmul peak: {peak_before:.4f} before, {peak_after:.4f} after, {peak_trainer:.4f} the trainer's; "
        f"MFU uses the highest, {peak:.4f} TFLOP/s; by CPU time {max(cpu_peaks):.4f} "
        f"(before {cpu_peaks[0]:.4f}, after {cpu_peaks[1]:.4f}) for MFU (CPU time)"
    )
    for plan in plans(args):
        print(f"\n{plan.shape}, {args.precision}, batch {plan.batch_size}, {args.threads} threads:")
        print(table(results[plan.shape], args, plan, peak, max(cpu_peaks), manifest))
        print("\n".join(ratios(results[plan.shape], seq_len, plan.batch_size * args.grad_accum)))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "cpu": machine,
                    "auto_precision": [auto, reason],
                    "peak_tflops": [peak_before, peak_after],
                    "trainer_peak": [peak_trainer, trainer_source],
                    "cpu_time_peak_tflops": cpu_peaks,
                    "runs": [asdict(m) for rows in results.values() for r in rows for m in r.runs],
                },
                indent=2,
            )
        )
    return 0


def diagnose(args, plan_list: list[Plan], shards: Path, seq_len: int) -> int:
    """--breakdown / --profile / --leads: in this process, one shape at a time (bench/step_profile.py)."""
    import torch

    from bench import step_profile

    torch.set_num_threads(args.threads)
    if args.cpu_clock:
        step_profile.use_cpu_clock()
    for plan in plan_list:
        common = base_overrides(args, plan, shards, Path(args.work_dir) / "runs" / f"{plan.shape}-diagnose")
        common.append("impl.peak_tflops=1")  # nothing in-process reads it; skips a measurement
        print(
            f"\n{plan.shape}: batch {plan.batch_size}, {args.precision}, {args.threads} threads, "
            f"{'CPU' if args.cpu_clock else 'wall'} clock",
            flush=True,
        )
        if args.breakdown:
            for v in args.variants:
                if VARIANTS[v].runner == "ours":
                    print(
                        step_profile.breakdown(
                            plan.config,
                            common + list(VARIANTS[v].overrides),
                            shards,
                            plan.steps,
                            plan.warmup_steps,
                            f"{plan.shape} {v}",
                            plan.batch_size * seq_len,
                        ),
                        flush=True,
                    )
        elif args.profile:
            print(
                step_profile.profile(
                    plan.config,
                    common,
                    shards,
                    plan.steps - plan.warmup_steps,
                    Path(args.work_dir) / "profile" / plan.shape,
                ),
                flush=True,
            )
        else:
            step_profile.leads(plan.config, common, shards, plan.steps, plan.warmup_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
