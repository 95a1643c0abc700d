"""BERT against ModernBERT of about equal size: same text, same wall-clock budget, side by side.

    python bench/arch_compare.py [--budget-s 600] [--threads 2] [--precision bf16] [--batch-size 32]
                                 [--seq-len 128] [--eval-batches 0] [--archs bert modernbert] [--seed 7]

Both rows are ``configs/mini.yaml`` (4 layers, hidden 256, 4 heads, lr 1e-3, AdamW) run by the real
entry point, ``python -m pretrain.train``, one process (world size 1, ZeRO 0, no data workers, no
tracking, eager: no torch.compile, whose start-up would eat the budget), the same shards, data order
and masking seeds (15%; ``--seed N`` sets ``train.seed`` and ``data.seed`` of both), the same
micro-batch and precision:

* ``bert``: ``model.arch=bert``, FFN 1024, its standard hidden dropout 0.1 (no attention-probability
  dropout, as base.yaml), learned absolute positions.
* ``modernbert``: ``model.arch=modernbert``, GeGLU FFN of 704 (3 x 256 x 704 weights per layer against
  BERT's 2 x 256 x 1024: the parameter counts differ by under 1%), its standard settings: no dropout,
  rotary positions, global attention in layers 0 and 3 and a 128-token window in layers 1 and 2.

The learning rate is constant after a short warm-up (``optim.schedule=constant``), so where the budget
cuts a run does not change its schedule. The budget runs from the trainer's ``start:`` log line (model
built, engine ready) to SIGTERM, after which the trainer finishes its step, checkpoints and exits
(code 3); "seconds trained" includes that last step. That checkpoint is exported with
``python -m pretrain.export``, and the export is evaluated here on the held-out split: masked-token
loss and accuracy at the trainer's own evaluation masking (15%, 80/10/10, fixed seed, masks keyed by
sequence id; ``pretrain.eval.cli.mlm_eval_model``), and the downstream probe of ``pretrain.evaluate``
(logistic regression on frozen mean-pooled features, on the word-order task built from the held-out
split, with the random-init baseline beside it; its accuracy with Wilson's 95% interval over its
test examples, ``pretrain.eval.intervals``). tokens/s and MFU are the trainer's own ``perf/*``
figures (``metrics.jsonl``, the first logging window dropped as warm-up), MFU against one matmul peak
measured here before the runs and passed to both (``impl.peak_tflops``).

Shards: ``--data DIR`` (it needs a validation split), or the embedded Wikipedia sample sharded with
the real ``data_prep`` CLI into ``--work-dir`` (bert-base-uncased vocabulary, 5% of documents held out).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import ensure_sample_shards, format_table, load_average, thread_env  # noqa: E402
from pretrain import metric_names as names  # noqa: E402
from pretrain.eval.intervals import TEST_EXAMPLES, wilson  # noqa: E402

CONFIG = REPO / "configs" / "mini.yaml"
# Each with its standard dropout; mini.yaml itself trains BERT without any, and its hidden_dropout is
# a BERT setting that a ModernBERT config refuses (null: not set).
ARCHS: dict[str, list[str]] = {
    "bert": ["model.arch=bert", "model.hidden_dropout=0.1"],
    "modernbert": ["model.arch=modernbert", "model.intermediate_size=704", "model.hidden_dropout=null"],
}


def held_out_shards(folder: Path, seq_len: int) -> Path:
    """The embedded Wikipedia sample as shards with a validation split (bench.common)."""
    return ensure_sample_shards(folder, seq_len, validation_fraction=0.05)


def matmul_peak(precision: str, threads: int) -> float:
    import torch

    try:  # where the lead's hardware module has it
        from pretrain.runtime.hardware import measure_matmul_peak_tflops
    except ImportError:
        from pretrain.model.flops import measure_matmul_peak_tflops
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return max(measure_matmul_peak_tflops("cpu", dtype, seconds=1.0) for _ in range(2))


def train_command(arch: str, args, shards: Path, out_dir: Path, peak: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pretrain.train",
        "--config",
        str(CONFIG),
        *ARCHS[arch],
        f"data.dir={shards}",
        f"train.out_dir={out_dir}",
        "train.resume=none",
        "train.max_steps=1000000",
        f"train.log_every={args.log_every}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.keep_checkpoints=1",
        f"train.global_batch_size={args.batch_size}",
        f"model.max_position_embeddings={max(512, args.seq_len)}",
        "optim.schedule=constant",
        f"optim.warmup_steps={args.warmup_steps}",
        f"impl.micro_batch_size={args.batch_size}",
        "impl.zero_stage=0",
        "impl.num_workers=0",
        "impl.compile=false",
        f"impl.precision={args.precision}",
        f"impl.peak_tflops={peak}",
        "tracking.backend=none",
        *([] if args.seed is None else [f"train.seed={args.seed}", f"data.seed={args.seed}"]),
    ]


def train_for(arch: str, args, shards: Path, peak: float) -> dict:
    """One budget-limited training run; returns its figures and the exported model folder."""
    out_dir = Path(args.work_dir) / "runs" / arch
    cmd = train_command(arch, args, shards, out_dir, peak)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    load_before = load_average()
    started = None
    with open(out_dir / "stdout.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=thread_env(args.threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:  # the trainer logs a line per log_every steps
            log.write(line)
            if started is None and " start: step " in line:
                started = time.perf_counter()
                timer = _sigterm_after(proc, args.budget_s)
        proc.wait()
    if started is None or proc.returncode != 3:
        raise RuntimeError(
            f"{arch}: pretrain.train exited {proc.returncode} (expected 3 after SIGTERM); "
            f"command:\n  {' '.join(cmd)}\nlast output:\n{(out_dir / 'stdout.log').read_text()[-3000:]}"
        )
    timer.cancel()
    trained_s = time.perf_counter() - started
    hf_dir = out_dir / "hf"
    subprocess.run(
        [sys.executable, "-m", "pretrain.export", str(out_dir / "checkpoints"), str(hf_dir)],
        cwd=REPO,
        env=thread_env(args.threads),
        check=True,
        capture_output=True,
    )
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not any(names.PERF_TOKENS_PER_S in r for r in rows):
        raise RuntimeError(
            f"{arch}: no logging window finished in {args.budget_s} s; raise --budget-s or lower "
            f"--log-every ({out_dir / 'stdout.log'})"
        )
    windows = [r for r in rows if names.PERF_TOKENS_PER_S in r][1:] or [r for r in rows if names.PERF_TOKENS_PER_S in r]
    steps = max(r["step"] for r in rows)
    return {
        "arch": arch,
        "hf_dir": hf_dir,
        "steps": steps,
        "trained_s": trained_s,
        "tokens": steps * args.batch_size * args.seq_len,
        "tokens_per_s": sum(r[names.PERF_TOKENS_PER_S] for r in windows) / len(windows),
        "mfu": sum(r[names.PERF_MFU] for r in windows) / len(windows),
        "train_loss": [r for r in rows if names.TRAIN_LOSS in r][-1][names.TRAIN_LOSS],
        "load": (load_before[0], load_average()[0]),
    }


def _sigterm_after(proc: subprocess.Popen, seconds: float):
    import threading

    timer = threading.Timer(seconds, lambda: proc.poll() is None and proc.send_signal(signal.SIGTERM))
    timer.daemon = True
    timer.start()
    return timer


def held_out_mlm(hf_dir: Path, shards: Path, batch_size: int, max_batches: int, threads: int) -> dict:
    """Masked-token loss and accuracy of an exported model on the validation split at the trainer's
    evaluation masking (``pretrain.eval.cli.mlm_eval_model``)."""
    import torch
    import transformers
    from transformers import AutoModelForMaskedLM

    from data_prep.common.manifest import load_manifest
    from pretrain.eval.cli import mlm_eval_model

    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar would sit in the log
    model = AutoModelForMaskedLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    out = mlm_eval_model(model, shards, load_manifest(shards), batch_size, max_batches)
    return {
        "eval_loss": out["loss"],
        "eval_accuracy": out["accuracy"],
        "params": sum(p.numel() for p in model.parameters()),
    }


def word_order_probe(hf_dir: Path, shards: Path, max_examples: int, threads: int) -> dict:
    """The evaluation issue's downstream probe (``pretrain.evaluate``): a logistic regression on frozen
    mean-pooled features, on the word-order task made from the held-out split, beside the same
    architecture with random weights."""
    import torch
    import transformers

    from pretrain.config.schema import DownstreamTaskConfig
    from pretrain.eval.cli import evaluate_model

    torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()  # as pretrain.evaluate: its load report (the MLM head unused) would bury the table
    transformers.utils.logging.disable_progress_bar()
    spec = DownstreamTaskConfig(name="word_order", path="word_order", max_examples=max_examples)
    metrics = evaluate_model(hf_dir, [spec], "probe", str(shards))
    return {
        "probe_accuracy": metrics[names.downstream(names.DOWNSTREAM, "word_order", "accuracy")],
        "probe_random_init_accuracy": metrics[names.downstream(names.DOWNSTREAM, "word_order", "random_init_accuracy")],
        "probe_test_examples": int(metrics[names.downstream(names.DOWNSTREAM, "word_order", TEST_EXAMPLES)]),
    }


def probe_cell(r: dict) -> str:
    """``0.540 (0.508-0.571; random init 0.521)``: both architectures are scored on the same sentences."""
    if "probe_accuracy" not in r:
        return "-"
    low, high = wilson(r["probe_accuracy"], r["probe_test_examples"])
    return f"{r['probe_accuracy']:.3f} ({low:.3f}-{high:.3f}; random init {r['probe_random_init_accuracy']:.3f})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=600.0, help="training wall-clock seconds per architecture")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128, help="of the sample shards written when --data is not given")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=0, help="validation batches (0: the whole split)")
    p.add_argument(
        "--probe-examples", type=int, default=2000, help="word-order probe examples per split (0: skip the probe)"
    )
    p.add_argument("--data", default="", help="shards with a validation split (default: the embedded sample)")
    p.add_argument("--work-dir", default="/tmp/mlm_arch_compare")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="a seed for both runs' weights, dropout, data order and masking (train.seed and data.seed); "
        "default: the config's own (train.seed 42, data.seed 1234)",
    )
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shards = Path(args.data) if args.data else held_out_shards(work, args.seq_len)
    from data_prep.common.manifest import load_manifest

    args.seq_len = load_manifest(shards).seq_len
    peak = matmul_peak(args.precision, args.threads)
    print(
        f"shards {shards} (seq len {args.seq_len}); {args.precision} matmul peak {peak:.3f} TFLOP/s "
        f"on {args.threads} threads; budget {args.budget_s:.0f} s per architecture; "
        f"seed {'the config' if args.seed is None else args.seed}",
        flush=True,
    )
    results = []
    for arch in args.archs:
        res = train_for(arch, args, shards, peak)
        res.update(held_out_mlm(res["hf_dir"], shards, args.batch_size, args.eval_batches, args.threads))
        if args.probe_examples:
            res.update(word_order_probe(res["hf_dir"], shards, args.probe_examples, args.threads))
        results.append(res)
        print(json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in res.items()}), flush=True)

    header = [
        "arch",
        "params",
        "seconds trained",
        "steps",
        "tokens",
        "tokens/s",
        "MFU",
        "train loss (last window)",
        "held-out MLM loss",
        "held-out MLM accuracy (15%)",
        "word-order probe acc (95% interval; random init)",
        "load avg before/after",
    ]
    table = [
        [
            r["arch"],
            f"{r['params'] / 1e6:.2f}M",
            f"{r['trained_s']:.0f}",
            r["steps"],
            f"{r['tokens']:,}",
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['train_loss']:.3f}",
            f"{r['eval_loss']:.3f}",
            f"{100 * r['eval_accuracy']:.2f}%",
            probe_cell(r),
            f"{r['load'][0]:.1f} / {r['load'][1]:.1f}",
        ]
        for r in results
    ]
    print()
    print(format_table(header, table))
    if len(results) == 2:
        a, b = results
        print(
            f"\n{b['arch']} / {a['arch']}: tokens/s x{b['tokens_per_s'] / a['tokens_per_s']:.2f}, "
            f"MFU x{b['mfu'] / a['mfu']:.2f}, "
            f"held-out accuracy {100 * (b['eval_accuracy'] - a['eval_accuracy']):+.2f} points, "
            f"held-out loss {b['eval_loss'] - a['eval_loss']:+.3f} (perplexity x"
            f"{math.exp(b['eval_loss'] - a['eval_loss']):.2f}) in the same {args.budget_s:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
