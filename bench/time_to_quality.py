"""Time to quality: our trainer against the Hugging Face recipe, the same wall-clock budget each.

    python bench/time_to_quality.py --minutes 10 --out bench_results/ttq     # 2 x 10 min, one after the other
    python bench/time_to_quality.py --minutes 0.5 --out /tmp/ttq             # smoke test
    python bench/time_to_quality.py --minutes 10 --seed 7 --out /tmp/ttq7     # another seed for both runs

One machine, one command, one run after the other, world size 1, the same shards (the embedded
Wikipedia sample, bert-base-uncased vocabulary, seq len 128; or ``--data``), the same model shape
(``configs/mini.yaml``: 4 layers x 256), micro-batch, optimiser settings and precision:

* ``hf``: ``transformers.Trainer`` + ``DataCollatorForLanguageModeling(mlm_probability=0.15)``,
  ``BertForMaskedLM`` built from the same ``BertConfig`` with BERT's dropout 0.1 (``HF_RECIPE``),
  ``optim="adamw_torch"``: what users would otherwise run (``run_mlm.py``).
* ``ours``: ``python -m pretrain.train --config configs/mini.yaml`` (ZeRO 0, no tracking), our
  recipe: no dropout. ``--ours-overrides model.hidden_dropout=0.1 model.attention_dropout=0.1``
  compares at equal dropout; ``--reuse-hf`` takes the HF run of an earlier results.json.

The learning rate is constant after warm-up in both (``constant_with_warmup`` / ``optim.schedule=
constant``): with a wall-clock budget the step count is not known in advance, and a decay tied to a
guessed step count would favour whichever run guessed better.

Time is *training* time: the sum of step times (data, masking, forward, backward, optimiser),
without start-up and without the periodic evaluations, which both runs make every ``--eval-every``
steps on the same held-out batches with the same masks (``pretrain.eval.cli.mlm_eval_model``: the
trainer's fixed 15% evaluation masking). HF stops itself when its training time reaches the budget;
ours gets SIGTERM from this script when its logged step times reach it (it checkpoints and exits),
and its checkpoint is exported to Hugging Face format.

Both final models are then scored alike: held-out MLM loss/accuracy (whole validation split; with
the unigram baseline), a linear probe on the word-order task (from the validation shards) and on
the Wikipedia-articles task (sentences of 10 articles labelled by article), beside the probe on the
same architecture with random weights. Reported: those rows, and the training time and tokens each
run needed to reach the HF run's final periodic eval loss. Written to ``--out``: ``results.json``,
``results.md`` (tables, loss against tokens) and ``loss_vs_tokens.png`` when matplotlib is there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import auto_precision as bench_auto_precision  # noqa: E402
from bench.common import ensure_sample_shards, format_table, load_average, thread_env  # noqa: E402
from pretrain import metric_names as names  # noqa: E402
from pretrain.eval.intervals import TEST_EXAMPLES, wilson  # noqa: E402

CONFIG = REPO / "configs" / "mini.yaml"
# The model users would otherwise train: mini's shape with BertConfig's own dropout, which
# run_mlm.py keeps when it pretrains from scratch (mini.yaml has none: our recipe).
HF_RECIPE = ("model.hidden_dropout=0.1", "model.attention_dropout=0.1")


def sample_shards(folder: Path, seq_len: int = 128, validation_fraction: float = 0.03) -> Path:
    """The embedded Wikipedia sample with a held-out split for the evaluations (bench.common)."""
    return ensure_sample_shards(folder, seq_len, validation_fraction=validation_fraction)


# ------------------------------------------------------------------------------------------ HF


def hf_worker(spec: dict) -> None:
    """The HF run, in a child process of its own (fresh thread pools), writing curve.json and hf/."""
    import torch
    from transformers import TrainerCallback

    from bench.reference_loops import hf_mlm_trainer
    from data_prep.common.manifest import load_manifest
    from pretrain.config.schema import load_config
    from pretrain.eval.cli import mlm_eval_model

    shards, out = Path(spec["shards"]), Path(spec["out_dir"])
    manifest = load_manifest(shards)
    seed = [] if spec["seed"] is None else [f"train.seed={spec['seed']}"]
    cfg = load_config(str(CONFIG), [f"data.dir={shards}", *seed, *HF_RECIPE])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens_per_step = spec["batch_size"] * manifest.seq_len

    class Budget(TrainerCallback):
        """Sums step times (the evaluations between steps excluded), evaluates every eval_every
        steps and stops the run when the sum reaches the budget."""

        def __init__(self):
            self.train_s, self.mark, self.curve = 0.0, 0.0, []

        def evaluate(self, model, step):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16"):
                r = mlm_eval_model(model, shards, manifest, spec["batch_size"], spec["eval_batches"], device=device)
            self.curve.append(
                {
                    "step": step,
                    "tokens": step * tokens_per_step,
                    "train_s": self.train_s,
                    "loss": r["loss"],
                    "accuracy": r["accuracy"],
                }
            )
            print(f"hf step {step} train {self.train_s:.1f}s eval loss {r['loss']:.4f}", flush=True)

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.train_s += time.perf_counter() - self.mark
            done = self.train_s >= spec["budget_s"]
            if state.global_step % spec["eval_every"] == 0 or done:
                self.evaluate(model, state.global_step)
            if done:
                control.should_training_stop = True
            self.mark = time.perf_counter()

    budget = Budget()
    # constant after warm-up: with a wall-clock budget the step count is not known in advance
    trainer, tokenizer = hf_mlm_trainer(
        shards,
        cfg,
        spec["batch_size"],
        spec["precision"],
        spec["threads"],
        out / "trainer",
        [budget],
        max_steps=10**7,
        lr_scheduler_type="constant_with_warmup",
        logging_strategy="no",
    )
    trainer.train()
    trainer.model.float().save_pretrained(out / "hf")
    tokenizer.save_pretrained(out / "hf")
    (out / "curve.json").write_text(json.dumps(budget.curve))


def run_hf(args, shards: Path) -> dict:
    out = Path(args.work_dir) / "runs" / "hf"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {
        "shards": str(shards),
        "out_dir": str(out),
        "batch_size": args.batch_size,
        "precision": args.precision,
        "threads": args.threads,
        "budget_s": args.minutes * 60,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "seed": args.seed,
    }
    started = time.time()
    with open(out / "stdout.log", "w") as log:
        done = subprocess.run(
            [sys.executable, __file__, "--hf-worker", json.dumps(spec)],
            cwd=REPO,
            env=thread_env(args.threads),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:
        raise RuntimeError(f"the HF Trainer run exited {done.returncode}:\n{(out / 'stdout.log').read_text()[-3000:]}")
    return {
        "curve": json.loads((out / "curve.json").read_text()),
        "hf_dir": str(out / "hf"),
        "wall_s": time.time() - started,
    }


# ------------------------------------------------------------------------------------------ ours


def run_ours(args, shards: Path) -> dict:
    out = Path(args.work_dir) / "runs" / "ours"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pretrain.train",
        "--config",
        str(CONFIG),
        f"data.dir={shards}",
        f"train.out_dir={out}",
        "train.max_steps=10000000",
        f"train.log_every={args.log_every}",
        f"train.eval_every={args.eval_every}",
        f"train.eval_batches={args.eval_batches}",
        "train.checkpoint_every=0",
        "train.resume=none",
        "train.keep_checkpoints=1",
        f"train.global_batch_size={args.batch_size}",
        f"impl.micro_batch_size={args.batch_size}",
        "impl.zero_stage=0",
        "impl.num_workers=0",
        f"impl.precision={args.precision}",
        "impl.peak_tflops=1",
        "optim.schedule=constant",
        "tracking.backend=none",
        *([] if args.seed is None else [f"train.seed={args.seed}", f"data.seed={args.seed}"]),
        *args.ours_overrides,
    ]
    started = time.time()
    metrics = out / "metrics.jsonl"
    with open(out / "stdout.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=thread_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
        signalled = False
        while proc.poll() is None:
            time.sleep(0.5)
            if not signalled and _train_seconds(metrics)[-1][1] >= args.minutes * 60:
                proc.send_signal(signal.SIGTERM)  # the trainer finishes the step, checkpoints, exits 3
                signalled = True
    if proc.returncode not in (0, 3):
        raise RuntimeError(
            f"ours: pretrain.train exited {proc.returncode}; command:\n  {' '.join(cmd)}\n"
            f"{(out / 'stdout.log').read_text()[-3000:]}"
        )
    from pretrain.checkpoint.hf_export import export_checkpoint, resolve_checkpoint
    from pretrain.eval.cli import mlm_eval

    _, tag = resolve_checkpoint(out / "checkpoints")
    export_checkpoint(out / "checkpoints", tag, out / "hf")
    logged = _train_seconds(metrics)
    times = dict(logged)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    tokens_per_step = args.batch_size * _seq_len(shards)
    curve = [
        {
            "step": r["step"],
            "tokens": r["step"] * tokens_per_step,
            "train_s": times.get(r["step"], float("nan")),
            "loss": r[names.EVAL_LOSS],
            "accuracy": r[names.EVAL_ACCURACY],
        }
        for r in records
        if names.EVAL_LOSS in r
    ]
    # The stop comes between evaluations: the checkpointed weights get the same evaluation (same
    # batches, same masks) as a last point, at the step time summed so far plus the unlogged steps.
    final_step = int(tag.removeprefix("step"))
    if not curve or curve[-1]["step"] < final_step:
        last_step, last_s = logged[-1]
        per_step = last_s / last_step if last_step else 0.0
        r = mlm_eval(out / "hf", shards, args.batch_size, args.eval_batches)
        curve.append(
            {
                "step": final_step,
                "tokens": final_step * tokens_per_step,
                "train_s": last_s + (final_step - last_step) * per_step,
                "loss": r["loss"],
                "accuracy": r["accuracy"],
            }
        )
    return {"curve": curve, "hf_dir": str(out / "hf"), "wall_s": time.time() - started}


def _seq_len(shards: Path) -> int:
    from data_prep.common.manifest import load_manifest

    return load_manifest(shards).seq_len


def _train_seconds(metrics: Path) -> list[tuple[int, float]]:
    """(step, summed step time up to it) at each logged step of our trainer's metrics.jsonl."""
    out, total, previous = [(0, 0.0)], 0.0, 0
    if not metrics.exists():
        return out
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line being written
            continue
        if names.PERF_STEP_TIME_S in r:
            total += r[names.PERF_STEP_TIME_S] * (r["step"] - previous)
            previous = r["step"]
            out.append((r["step"], total))
    return out


# ------------------------------------------------------------------------------------------ scoring


def crossing(curve: list[dict], target: float, key: str) -> float:
    """``key`` (train_s or tokens) where the eval loss first reaches ``target``, linearly
    interpolated between evaluations; NaN if it never does."""
    prev = None
    for point in curve:
        if point["loss"] <= target:
            if prev is None or prev["loss"] == point["loss"]:
                return point[key]
            f = (prev["loss"] - target) / (prev["loss"] - point["loss"])
            return prev[key] + f * (point[key] - prev[key])
        prev = point
    return float("nan")


def score(hf_dir: str, shards: Path, tasks, batch_size: int, device: str) -> dict:
    from transformers import AutoModel

    from pretrain.eval.cli import mlm_eval
    from pretrain.eval.downstream import probe_metrics

    mlm = mlm_eval(hf_dir, shards, batch_size=batch_size, device=device)
    encoder = AutoModel.from_pretrained(hf_dir, add_pooling_layer=False).to(device)
    return {**{f"mlm/{k}": v for k, v in mlm.items()}, **probe_metrics(encoder, tasks, device)}


def report(results: dict, out: Path) -> str:
    hf, ours, base = results["hf"], results["ours"], results["baselines"]
    target = hf["curve"][-1]["loss"]
    rows = []
    for label, key in [
        ("held-out MLM loss (15% masking)", "mlm/loss"),
        ("held-out MLM accuracy", "mlm/accuracy"),
        ("word-order probe accuracy", names.downstream(names.DOWNSTREAM, "word_order", "accuracy")),
        ("word-order probe macro-F1", names.downstream(names.DOWNSTREAM, "word_order", "macro_f1")),
        ("articles probe accuracy", names.downstream(names.DOWNSTREAM, "articles", "accuracy")),
        ("articles probe macro-F1", names.downstream(names.DOWNSTREAM, "articles", "macro_f1")),
    ]:
        b = base.get(key.replace("/accuracy", "/random_init_accuracy").replace("/macro_f1", "/random_init_macro_f1"))
        if key == "mlm/accuracy":
            b = hf["scores"]["mlm/unigram_accuracy"]
        examples = base.get(key.replace("/accuracy", f"/{TEST_EXAMPLES}")) if key.endswith("/accuracy") else None

        def cell(value: float) -> str:  # a probe's accuracy with its 95% interval: its test set is small
            low, high = wilson(value, int(examples)) if examples else (None, None)
            return f"{value:.4f}" + (f" ({low:.3f}-{high:.3f}, n={int(examples)})" if examples else "")

        rows.append(
            [
                label,
                cell(hf["scores"][key]),
                cell(ours["scores"][key]),
                "-" if b is None or key == "mlm/loss" else cell(b),
            ]
        )
    for label, key in [
        ("training time to HF's final eval loss (s)", "train_s"),
        ("tokens to HF's final eval loss (M)", "tokens"),
    ]:
        h, o = crossing(hf["curve"], target, key), crossing(ours["curve"], target, key)
        scale = 1e-6 if key == "tokens" else 1.0
        rows.append([label, f"{h * scale:.3f}", f"{o * scale:.3f}", f"ours/HF = {o / h:.2f}" if h else "-"])
    rows.append(
        [
            "optimiser steps in the budget",
            hf["curve"][-1]["step"],
            ours["curve"][-1]["step"] if ours["curve"] else "-",
            "",
        ]
    )
    main_table = format_table(["row", "HF Trainer", "ours", "random init / unigram"], rows)
    # Loss against tokens: both evaluate at the same steps on the same masked batches.
    by_step = {p["step"]: p for p in ours["curve"]}
    curve_rows = [
        [
            p["step"],
            f"{p['tokens'] / 1e6:.3f}",
            f"{p['loss']:.4f}",
            f"{by_step[p['step']]['loss']:.4f}" if p["step"] in by_step else "-",
            f"{p['train_s']:.0f}",
            f"{by_step[p['step']]['train_s']:.0f}" if p["step"] in by_step else "-",
        ]
        for p in hf["curve"]
    ]
    curve_rows += [
        [p["step"], f"{p['tokens'] / 1e6:.3f}", "-", f"{p['loss']:.4f}", "-", f"{p['train_s']:.0f}"]
        for p in ours["curve"]
        if p["step"] > hf["curve"][-1]["step"]
    ]
    curve_table = format_table(
        ["step", "tokens (M)", "HF eval loss", "ours eval loss", "HF train s", "ours train s"], curve_rows
    )
    text = (
        f"{results['setup']}\n\nTarget: HF's final periodic eval loss {target:.4f}\n\n{main_table}\n\n"
        f"Eval loss against tokens seen\n\n{curve_table}\n"
    )
    (out / "results.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for name, run in (("HF Trainer", hf), ("ours", ours)):
            ax[0].plot([p["tokens"] / 1e6 for p in run["curve"]], [p["loss"] for p in run["curve"]], label=name)
            ax[1].plot([p["train_s"] for p in run["curve"]], [p["loss"] for p in run["curve"]], label=name)
        ax[0].set_xlabel("tokens seen (M)"), ax[1].set_xlabel("training time (s)")
        for a in ax:
            a.set_ylabel("held-out MLM loss (15%)"), a.axhline(target, color="grey", lw=0.5), a.legend()
        fig.tight_layout()
        fig.savefig(out / "loss_vs_tokens.png", dpi=110)
    except ImportError:
        pass
    return text


SAME_RUN_KEYS = (
    "data",
    "work_dir",
    "minutes",
    "batch_size",
    "precision",
    "threads",
    "eval_every",
    "eval_batches",
    "seed",
)


def reused_hf_run(args, parser) -> dict:
    prior = json.loads(Path(args.reuse_hf).read_text())
    differ = [
        f"--{k.replace('_', '-')} {prior['args'].get(k)} there, {getattr(args, k)} here"
        for k in SAME_RUN_KEYS
        if prior["args"].get(k) != getattr(args, k)
    ]
    if differ:
        parser.error(f"--reuse-hf {args.reuse_hf}: not the same HF run: " + "; ".join(differ))
    if not Path(prior["hf"]["hf_dir"], "config.json").exists():
        parser.error(f"--reuse-hf {args.reuse_hf}: its HF model {prior['hf']['hf_dir']} is gone")
    print(f"hf: reused from {args.reuse_hf} ({prior['setup']})", flush=True)
    return {k: prior["hf"][k] for k in ("curve", "hf_dir", "wall_s", "load_after")} | {"reused_from": args.reuse_hf}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="training-time budget of each run (default 10)")
    p.add_argument("--data", help="a shard folder (data_prep shard + finalize); default: the embedded sample")
    p.add_argument("--work-dir", default="/tmp/bench_time_to_quality", help="shards, runs and logs")
    p.add_argument("--out", default="/tmp/bench_time_to_quality/results", help="results.json, results.md, plot")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (configs/mini.yaml's micro-batch)")
    p.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default=None,
        help="default: what the trainer's impl.precision=auto picks (bf16 where native, else fp32)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--eval-every", type=int, default=50, help="steps between periodic evaluations")
    p.add_argument("--log-every", type=int, default=10, help="our trainer's logging window (divides --eval-every)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per periodic evaluation")
    p.add_argument(
        "--seed",
        type=int,
        help="a seed for both runs' weights, dropout and data order (train.seed, and data.seed for ours); "
        "default: the config's own (train.seed 42, data.seed 1234)",
    )
    p.add_argument("--ours-overrides", nargs="*", default=[], help="extra dotted overrides for our trainer")
    p.add_argument(
        "--reuse-hf",
        metavar="RESULTS_JSON",
        help="an earlier results.json from this machine: take its HF run (same data, budget, batch, "
        "precision, threads, evaluation) instead of training it again, to compare our settings",
    )
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hf_worker:
        hf_worker(json.loads(args.hf_worker))
        return 0
    if args.eval_every % args.log_every:
        p.error(f"--log-every ({args.log_every}) must divide --eval-every ({args.eval_every})")
    import torch

    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    if args.precision is None:  # the trainer's own choice for mini's step at these threads
        from pretrain.runtime.hardware import auto_precision

        args.precision = (
            auto_precision(torch.device("cuda"))[0] if torch.cuda.is_available() else bench_auto_precision(CONFIG)[0]
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = Path(args.data) if args.data else sample_shards(Path(args.work_dir))

    import transformers
    from transformers import AutoConfig

    transformers.utils.logging.set_verbosity_error()

    from data_prep.common.manifest import load_manifest
    from data_prep.common.tokenizer_cache import tokenizer_dir
    from pretrain.config.schema import DownstreamTaskConfig
    from pretrain.eval.downstream import baseline_metrics, prepare_tasks
    from pretrain.eval.tasks import sample_article_task

    manifest = load_manifest(shards)
    articles = sample_article_task(Path(args.work_dir) / "articles.csv", num_articles=10)
    tasks = prepare_tasks(
        [
            DownstreamTaskConfig(path="word_order", max_examples=1500, max_length=64),
            DownstreamTaskConfig(path=str(articles), name="articles", max_length=64),
        ],
        tokenizer_dir(manifest, shards),
        data_dir=str(shards),
        manifest=manifest,
    )
    setup = (
        f"shards {shards} (seq {manifest.seq_len}); configs/mini.yaml (HF: {' '.join(HF_RECIPE)}); "
        f"batch {args.batch_size}; "
        f"{args.precision}; {args.threads} threads; budget {args.minutes} min of training time each; "
        f"eval every {args.eval_every} steps on {args.eval_batches} batches; "
        f"seed {'the config' if args.seed is None else args.seed}; load {load_average()}"
        + (f"; ours with {' '.join(args.ours_overrides)}" if args.ours_overrides else "")
    )
    print(setup, flush=True)
    results = {"setup": setup, "args": vars(args)}
    for name, run in (("hf", run_hf), ("ours", run_ours)):
        if name == "hf" and args.reuse_hf:
            results["hf"] = reused_hf_run(args, p)
            continue
        results[name] = run(args, shards)
        results[name]["load_after"] = load_average()
        c = results[name]["curve"][-1]
        print(
            f"{name}: {c['step']} steps, {c['train_s']:.0f} s training, eval loss {c['loss']:.4f} "
            f"({results[name]['wall_s']:.0f} s wall)",
            flush=True,
        )
    for name in ("hf", "ours"):
        results[name]["scores"] = score(results[name]["hf_dir"], shards, tasks, args.batch_size, device)
    config = AutoConfig.from_pretrained(results["hf"]["hf_dir"])
    results["baselines"] = baseline_metrics(config, tasks, device)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(report(results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
