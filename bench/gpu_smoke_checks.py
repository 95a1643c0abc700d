"""The Python half of ``bench/gpu_smoke.sh``: the peak it measures MFU against, direct checks of the
GPU-only code paths, and the tokens/s + MFU table read from each run's ``metrics.jsonl``.

    python bench/gpu_smoke_checks.py peak                 # "<TFLOP/s>\t<source>" for cuda:0, bf16
    python bench/gpu_smoke_checks.py paths CONFIG SHARDS  # fused AdamW, LAMB, flash SDPA on cuda:0
    python bench/gpu_smoke_checks.py resumed REF RUN      # RUN's losses after a halt and resume = REF's
    python bench/gpu_smoke_checks.py nonfinite RUN        # RUN skipped its non-finite steps, schedule held
    python bench/gpu_smoke_checks.py heldout RUN          # RUN evaluated its held-out split: finite loss
    python bench/gpu_smoke_checks.py export RUN           # RUN/hf_final loads (fp32) and fills a mask
    python bench/gpu_smoke_checks.py report RUN_DIR...    # one row per run
    python bench/gpu_smoke_checks.py yardsticks PEAK OURS OURS_AT_ONCE HF BARE [OURS_ROW]
                                         # base.yaml at its real shape beside the HF Trainer and a bare loop
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import format_table  # noqa: E402
from pretrain import metric_names as names  # noqa: E402
from pretrain.runtime import graph_records  # noqa: E402


def peak() -> str:
    import torch

    from pretrain.runtime.hardware import peak_tflops

    device = torch.device("cuda", 0)
    value, source = peak_tflops(device, "bf16")  # the vendor table; measured for unknown GPUs
    return f"{value:.1f}\t{source} ({torch.cuda.get_device_name(device)})"


# The optimiser paths: overrides, the class build_optimizer must give, whether it must be fused.
OPTIMIZER_CHECKS = (
    (["optim.name=adamw", "impl.fused_optimizer=true"], "AdamW", True),
    (["optim.name=lamb", "impl.zero_stage=0"], "Lamb", False),
)


def path_configs(config: str, shards: str) -> list:
    """The configs ``paths`` checks, loaded (on any machine: ``tests/bench/test_bench.py`` loads them on the CPU)."""
    from pretrain.config.schema import load_config

    return [
        (load_config(config, [f"data.dir={shards}", "impl.attention=sdpa", *overrides]), overrides, name, fused)
        for overrides, name, fused in OPTIMIZER_CHECKS
    ]


def paths(config: str, shards: str) -> str:
    """Each GPU-only path once, directly, so a silent fallback cannot pass for it: the optimiser
    class ``build_optimizer`` picks (and one step of it), and our model's forward + backward in bf16
    with SDPA restricted to the flash kernel (an error if flash cannot take these inputs)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from data_prep.common.manifest import load_manifest
    from pretrain.config.schema import load_config
    from pretrain.data.stream import TrainStream
    from pretrain.model.masking import SpecialIds, mask_batch
    from pretrain.model.mlm import build_model
    from pretrain.model.optim import build_optimizer

    device = torch.device("cuda", 0)
    manifest = load_manifest(shards)
    special = SpecialIds.from_manifest(manifest)
    lines = []
    for cfg, overrides, expected, fused in path_configs(config, shards):
        model = build_model(cfg.model, manifest.tokenizer.vocab_size, special, cfg.impl).to(device)
        opt = build_optimizer(model, cfg)
        if type(opt).__name__ != expected or bool(opt.defaults.get("fused")) != fused:
            raise SystemExit(
                f"{' '.join(overrides)}: build_optimizer gave {type(opt).__name__} "
                f"(fused={opt.defaults.get('fused')}), expected {expected} (fused={fused})"
            )
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        before = model.hf_model.bert.embeddings.word_embeddings.weight.detach().clone()
        opt.step()
        moved = (model.hf_model.bert.embeddings.word_embeddings.weight - before).abs().max().item()
        if not moved > 0:
            raise SystemExit(f"{expected}: one step left the weights unchanged")
        lines.append(
            f"{expected} (fused={fused}): built by build_optimizer for {' '.join(overrides)}; one step "
            f"moved weights by up to {moved:.2e}"
        )

    cfg = load_config(config, [f"data.dir={shards}", "impl.attention=sdpa"])
    model = build_model(cfg.model, manifest.tokenizer.vocab_size, special, cfg.impl).to(device, torch.bfloat16)
    batch = next(iter(TrainStream(shards, manifest, "train", 0, 1, 8, 8, cfg.data.seed)))
    ids = batch["input_ids"].to(device)
    full = (ids != special.pad).all(dim=1)  # flash takes no padding mask: unpadded rows only
    if not full.any():
        raise SystemExit(f"{shards}: no unpadded row in the first batch to try flash attention on")
    m = mask_batch(
        ids[full],
        batch["word_starts"].to(device)[full],
        special,
        cfg.masking,
        sample_ids=batch["sample_ids"].to(device)[full],
        step=0,
    )
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        loss_sum, _, count = model(m.input_ids, None, m.positions, m.labels)
        loss_sum.backward()
    lines.append(
        f"flash SDPA: forward + backward of {int(full.sum())} unpadded rows in bf16 with only "
        f"SDPBackend.FLASH_ATTENTION allowed; loss {loss_sum.item() / max(count.item(), 1):.3f}"
    )
    return "\n".join(lines)


def logged(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r[key] for r in rows if key in r}


def resumed(reference: str, resumed_dir: str, rtol: float = 1e-3) -> str:
    """The halted-and-resumed run logged the uninterrupted run's losses. Bit for bit on the CPU; on a
    GPU the backward's atomic adds may reorder sums, so the largest relative difference is printed
    and must stay under ``rtol``."""
    want, got = logged(Path(reference), names.TRAIN_LOSS), logged(Path(resumed_dir), names.TRAIN_LOSS)
    if sorted(want) != sorted(got):
        raise SystemExit(f"resume: steps {sorted(got)} logged, the uninterrupted run has {sorted(want)}")
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    verdict = "bit-exact" if worst == 0 else f"largest relative difference {worst:.1e}"
    if worst > rtol:
        raise SystemExit(f"resume: {verdict}, over {rtol:g}")
    return f"resume: {len(want)} logged losses after a halt and a resume at another ZeRO stage: {verdict}"


def _beside(check: str, reference: str, run: str, against: str, rtol: float) -> tuple:
    """``run``'s logged losses within ``rtol`` of ``reference``'s at every step (``against`` names the
    reference in the messages): (the losses of each, the largest relative difference, run's tokens/s
    and MFU, the reference's tokens/s)."""
    want, got = logged(Path(reference), names.TRAIN_LOSS), logged(Path(run), names.TRAIN_LOSS)
    if sorted(want) != sorted(got) or not want:
        raise SystemExit(f"{check}: steps {sorted(got)} logged, {sorted(want)} in {against}")
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    if worst > rtol:
        raise SystemExit(f"{check}: losses differ from {against} by up to {worst:.1e}, over {rtol:g}")
    (ours, mfu), (theirs, _) = _ours_tokens_per_s(Path(run)), _ours_tokens_per_s(Path(reference))
    return want, got, worst, ours, mfu, theirs


def graphs(eager_dir: str, graphs_dir: str, rtol: float = 2e-2) -> str:
    """The same run (base.yaml, one micro-batch a step) compiled, and compiled with its forward and
    backward replayed as CUDA graphs (``impl.cuda_graphs=true``): the same losses to bf16 round-off
    (the largest relative difference printed, under ``rtol``), and the graphs' tokens/s against eager's."""
    want, _, worst, ours, mfu, theirs = _beside("graphs", eager_dir, graphs_dir, "the run without graphs", rtol)
    said = f"graphs: {len(want)} logged losses within {worst:.1e} of the run without graphs; "
    said += f"{ours:,.0f} tokens/s ({100 * mfu:.1f}% MFU), {ours / theirs:.3f}x without graphs"
    # what inductor did that a replay should not need, as the run said it (pretrain/runtime/graph_records.py)
    records = graph_records.seen((Path(graphs_dir) / "stdout.log").read_text(errors="replace").splitlines())
    if records:
        raise SystemExit(f"{said}; but " + "; ".join(f"{kind} {n} times: {why}" for (kind, why), n in records.items()))
    return said


def fp8(bf16_dir: str, fp8_dir: str, rtol: float = 2e-2) -> str:
    """base.yaml at its real shape in bf16 and with ``impl.precision=fp8``: the losses within ``rtol``
    of bf16's at every logged step (float8's rounding, not another run), and what float8 gains; MFU
    against the bf16 peak for both, as NVIDIA's MLPerf figures count it."""
    want, got, worst, ours, mfu, theirs = _beside("fp8", bf16_dir, fp8_dir, "bf16's", rtol)
    return (
        f"fp8: {len(want)} logged losses within {worst:.1e} of bf16's (last {got[max(got)]:.4f} against "
        f"{want[max(want)]:.4f}); {ours:,.0f} tokens/s ({100 * mfu:.1f}% MFU of the bf16 peak), {ours / theirs:.3f}x bf16"
    )


def dropout_hash(per_pair_dir: str, per_element_dir: str, rtol: float = 2e-2) -> str:
    """base.yaml at its real shape with keyed dropout's hash once a pair (written out and read back)
    and once an element inside the kernel around it (``impl.dropout_hash``): the same masks, so the
    losses within ``rtol`` (other kernels, bf16's round-off), and what keeping the hash in registers gains."""
    want, _, worst, ours, mfu, theirs = _beside("dropout-hash", per_pair_dir, per_element_dir, "per_pair's", rtol)
    return (
        f"dropout-hash: {len(want)} logged losses within {worst:.1e} of per_pair's; per_element "
        f"{ours:,.0f} tokens/s ({100 * mfu:.1f}% MFU), {ours / theirs:.3f}x per_pair"
    )


def autotune(default_dir: str, tuned_dir: str, rtol: float = 2e-2) -> str:
    """base.yaml at its real shape compiled by default and with ``impl.autotune_kernels=true``: the
    losses within ``rtol`` at every logged step (other kernels, bf16's round-off) and what the tuned
    kernels gain (the compile's cost is the two runs' times, in results.txt)."""
    want, _, worst, ours, mfu, theirs = _beside("autotune", default_dir, tuned_dir, "the default compile's", rtol)
    return (
        f"autotune: {len(want)} logged losses within {worst:.1e} of the default compile's; "
        f"{ours:,.0f} tokens/s ({100 * mfu:.1f}% MFU), {ours / theirs:.3f}x the default"
    )


def checkpointing(kept_dir: str, recomputed_dir: str, rtol: float = 2e-2) -> str:
    """base.yaml at its real shape with the layers' activations kept (the default) and recomputed in
    the backward (``impl.activation_checkpointing=true``): the losses within ``rtol`` (the recompute's
    kernels under torch.compile, bf16's round-off), its tokens/s and peak device memory against the
    default's (``perf/memory_gb``: the peak allocated)."""
    want, _, worst, ours, mfu, theirs = _beside("checkpointing", kept_dir, recomputed_dir, "the default's", rtol)
    kept, recomputed = (max(logged(Path(d), names.PERF_MEMORY_GB).values()) for d in (kept_dir, recomputed_dir))
    return (
        f"checkpointing: {len(want)} logged losses within {worst:.1e} of the default's; {ours:,.0f} tokens/s "
        f"({100 * mfu:.1f}% MFU), {ours / theirs:.3f}x the default; peak memory {recomputed:.2f} GB against "
        f"{kept:.2f} ({recomputed / kept:.2f}x)"
    )


def nonfinite(run_dir: str) -> str:
    """A run whose weights blew up after step 1: every later step skipped without moving the
    learning-rate schedule, until the cap stopped it (its exit code, 4, is checked by the caller)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    lrs = [r[names.TRAIN_LR] for r in rows if names.TRAIN_LR in r]
    skipped = max((r.get(names.TRAIN_NONFINITE_SKIPPED, 0) for r in rows), default=0)
    if skipped < 1 or len(lrs) < 2:
        raise SystemExit(f"nonfinite: {skipped} skipped steps and {len(lrs)} logged rates in {run_dir}")
    if len(set(lrs[1:])) != 1 or lrs[1] != lrs[0]:
        raise SystemExit(f"nonfinite: the schedule moved on skipped steps: train/lr {lrs}")
    return f"nonfinite: {skipped} non-finite steps skipped, train/lr held at {lrs[0]:.3g} through them"


def heldout(run_dir: str) -> str:
    """The run evaluated its held-out split (compiled, at its last step): a finite loss and an accuracy."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if names.EVAL_LOSS in r]
    if not evals or not all(math.isfinite(r[names.EVAL_LOSS]) and 0 <= r[names.EVAL_ACCURACY] <= 1 for r in evals):
        raise SystemExit(f"heldout: no finite eval/loss with an eval/accuracy in {run_dir}/metrics.jsonl: {evals}")
    last = evals[-1]
    return f"heldout: step {last['step']}: eval/loss {last[names.EVAL_LOSS]:.3f}, eval/accuracy {last[names.EVAL_ACCURACY]:.4f}"


def export(run_dir: str) -> str:
    """The run's final export loads in transformers with fp32 weights and fills a mask."""
    import torch
    from transformers import AutoModelForMaskedLM, pipeline

    folder = Path(run_dir) / "hf_final"
    model = AutoModelForMaskedLM.from_pretrained(folder)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise SystemExit(f"export: {folder} holds {dtypes} weights, not the fp32 masters")
    answers = pipeline("fill-mask", model=str(folder), device=0 if torch.cuda.is_available() else -1)(
        "The capital of France is [MASK]."
    )
    return f"export: {folder} loads (fp32); fill-mask answers {', '.join(a['token_str'] for a in answers[:3])}"


def profile(*run_dirs: str) -> str:
    """Each run's rank-0 profile summary (``impl.profile_at_step``: pretrain/runtime/profiling.py)."""
    lines = []
    for d in map(Path, run_dirs):
        tables = sorted((d / "profile").glob("step*-rank0.txt"))
        if not tables:
            raise SystemExit(f"profile: no profile in {d}/profile (impl.profile_at_step)")
        lines.append(f"profile {d.name}: {tables[-1].read_text().splitlines()[0]}")
    return "\n".join(lines)


def report(run_dirs: list[str]) -> tuple[str, bool]:
    """tokens/s and MFU per run, averaged over the logged windows after the first (start-up)."""
    rows, ok = [], True
    for d in map(Path, run_dirs):
        path = d / "metrics.jsonl"
        windows = (
            [
                r
                for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
                if names.PERF_TOKENS_PER_S in r
            ]
            if path.is_file()
            else []
        )
        timed = windows[1:] or windows
        if not timed:
            rows.append([d.name, "-", "-", "-", "-", f"no metrics in {path}"])
            ok = False
            continue
        tps = sum(r[names.PERF_TOKENS_PER_S] for r in timed) / len(timed)
        mfu = sum(r[names.PERF_MFU] for r in timed) / len(timed)
        rows.append(
            [
                d.name,
                timed[-1]["step"],
                f"{tps:,.0f}",
                f"{100 * mfu:.1f}%",
                f"{timed[-1][names.TRAIN_LOSS]:.3f}",
                f"{len(timed)} windows after the first",
            ]
        )
    anchor = "\nAnchor for bert-base: NVIDIA's BERT pretraining reaches about 45% MFU (bf16, sequence 128)."
    return format_table(["run", "steps", "tokens/s", "MFU (vs the peak above)", "loss", "note"], rows) + anchor, ok


def _ours_tokens_per_s(run_dir: Path) -> tuple[float, float]:
    """(tokens/s, MFU) of one of our runs: the mean of its logged windows after the first."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    windows = [r for r in rows if names.PERF_TOKENS_PER_S in r]
    timed = windows[1:] or windows
    if not timed:
        raise SystemExit(f"yardsticks: no logged windows in {path}")
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    return mean(names.PERF_TOKENS_PER_S), mean(names.PERF_MFU)


def _yardstick_tokens_per_s(run_dir: Path, peak_tflops: float, dense_head: bool) -> tuple[float, float]:
    """(tokens/s, MFU) of a bench/reference_loops.py run (its ``spec.json`` and ``result.json``): the
    steps after the spec's warm-up, at its own FLOPs per sequence (HF's head runs on every token)."""
    from data_prep.common.manifest import load_manifest
    from pretrain.config.schema import load_config
    from pretrain.model.flops import mlm_flops_per_sequence

    spec = json.loads((run_dir / "spec.json").read_text())
    result_file = run_dir / "result.json"
    if not result_file.is_file():
        raise SystemExit(f"yardsticks: {run_dir.name} wrote no result.json (its log: {run_dir / 'stdout.log'})")
    ends = json.loads(result_file.read_text())["step_end_unix"]
    warm = spec["warmup_steps"]
    if len(ends) <= warm + 1:
        raise SystemExit(f"yardsticks: {run_dir.name} timed {len(ends)} steps, fewer than its warm-up + 2")
    manifest = load_manifest(spec["shards"])
    seq_len = manifest.seq_len
    cfg = load_config(spec["config"], spec["overrides"])
    sequences = (len(ends) - warm) * spec["batch_size"] * spec["grad_accum"]
    tokens_per_s = sequences * seq_len / (ends[-1] - ends[warm - 1])
    flops = mlm_flops_per_sequence(
        cfg.model,
        seq_len,
        cfg.masking.rate * seq_len,
        sparse_head=not dense_head,
        vocab_size=manifest.tokenizer.vocab_size,
    )
    return tokens_per_s, tokens_per_s / seq_len * flops / (peak_tflops * 1e12)


def yardsticks(peak: str, ours: str, ours_at_once: str, hf: str, bare: str, ours_row: str = "-") -> str:
    """configs/base.yaml at its real shape (several micro-batches a step), its decisions read a step
    late (ours, ``impl.deferred_reads``) and at once, beside the Hugging Face Trainer and a bare
    compiled loop at the same shape on the same GPU; the ratios the GPU-step issue set goals for, each
    at one attention scope: base.yaml and the bare loop around our model attend inside each document,
    the HF Trainer across the whole row, as ``ours_row`` does (``model.attention_scope=row``).
    ``ours_at_once`` or ``ours_row`` "-": that run was not made (the budget left it out)."""
    peak_tflops = float(peak)
    rows, measured = [], {}
    for key, name, run in (
        ("ours", "ours (base.yaml; attention inside each document)", ours),
        ("at_once", "ours, every step read at once", ours_at_once),
        ("row", "ours, attention across the row (HF's scope)", ours_row),
        ("hf", "HF Trainer (bf16, SDPA across the row, fused AdamW, compiled)", hf),
        ("bare", "bare loop around our model (inside each document; compiled, fused AdamW)", bare),
    ):
        if run == "-":
            continue
        run_dir = Path(run)
        if key in ("ours", "at_once", "row"):
            tps, mfu = _ours_tokens_per_s(run_dir)
        else:
            tps, mfu = _yardstick_tokens_per_s(run_dir, peak_tflops, dense_head=key == "hf")
        measured[key] = tps
        rows.append([name, f"{tps:,.0f}", f"{100 * mfu:.1f}%"])
    lines = [format_table(["run", "tokens/s", "MFU"], rows)]
    if "row" in measured:
        lines.append(f"ours / HF Trainer, both across the row: {measured['row'] / measured['hf']:.2f}x (goal >= 2.5)")
    lines += [
        f"ours inside each document / HF Trainer across the row: {measured['ours'] / measured['hf']:.2f}x",
        f"ours / bare loop, both inside each document: {measured['ours'] / measured['bare']:.2f}x (goal >= 0.9)",
    ]
    if "at_once" in measured:
        lines.append(f"deferred reads / at once: {measured['ours'] / measured['at_once']:.3f}x")
    return "\n".join(lines)


def micro(run: str) -> str:
    """``impl.micro_batch_size=auto``'s line (the micro-batches timed, the one chosen) and the run's speed."""
    said = [line for line in (Path(run) / "stdout.log").read_text().splitlines() if "micro-batch: " in line]
    if not said:
        raise SystemExit(f"{run}: no 'micro-batch:' line in its log")
    tps, mfu = _ours_tokens_per_s(Path(run))
    return f"{said[-1].split('micro-batch: ', 1)[1]}\n  at it: {tps:,.0f} tokens/s, {100 * mfu:.1f}% MFU"


def patches(every: str, *without: str) -> str:
    """base.yaml at one micro-batch a step with every DeepSpeed patch, and with each group off in turn
    (``bert-base-no-<group>``): what each group gains (issue 84, item 5)."""
    ours = _ours_tokens_per_s(Path(every))
    lines = [f"every DeepSpeed patch on: {ours[0]:,.0f} tokens/s ({100 * ours[1]:.1f}% MFU)"]
    for run in without:
        tps, mfu = _ours_tokens_per_s(Path(run))
        group = Path(run).name.removeprefix("bert-base-no-")
        lines.append(f"  {group} off: {tps:,.0f} tokens/s ({100 * mfu:.1f}%): the group gains {ours[0] / tps:.3f}x")
    return "\n".join(lines)


def reads(deferred: str, at_once: str) -> str:
    """base.yaml at one micro-batch a step (the multi-node regime, where a step's host time shows)
    with its decisions read a step late (``impl.deferred_reads``, the default) and at once."""
    ours, theirs = _ours_tokens_per_s(Path(deferred)), _ours_tokens_per_s(Path(at_once))
    return (
        f"one micro-batch a step: deferred reads {ours[0]:,.0f} tokens/s ({100 * ours[1]:.1f}% MFU), "
        f"at once {theirs[0]:,.0f} ({100 * theirs[1]:.1f}%): {ours[0] / theirs[0]:.3f}x"
    )


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "peak":
        print(peak())
    elif command == "paths":
        print(paths(*rest))
    elif command == "resumed":
        print(resumed(*rest))
    elif command == "nonfinite":
        print(nonfinite(*rest))
    elif command == "heldout":
        print(heldout(*rest))
    elif command == "export":
        print(export(*rest))
    elif command == "profile":
        print(profile(*rest))
    elif command == "yardsticks":
        print(yardsticks(*rest))
    elif command == "reads":
        print(reads(*rest))
    elif command == "micro":
        print(micro(*rest))
    elif command == "patches":
        print(patches(*rest))
    elif command == "graphs":
        print(graphs(*rest))
    elif command == "fp8":
        print(fp8(*rest))
    elif command == "autotune":
        print(autotune(*rest))
    elif command == "dropout_hash":
        print(dropout_hash(*rest))
    elif command == "checkpointing":
        print(checkpointing(*rest))
    elif command == "report":
        text, all_ok = report(rest)
        print(text)
        sys.exit(0 if all_ok else 1)
    else:
        sys.exit(
            f"unknown command {command!r}: peak | paths CONFIG SHARDS | resumed REF RUN | nonfinite RUN | heldout RUN | export RUN | profile RUN... | "
            "report RUN_DIR... | yardsticks PEAK OURS OURS_AT_ONCE HF BARE [OURS_ROW] | reads DEFERRED AT_ONCE | micro RUN | patches EVERY WITHOUT... | graphs EAGER GRAPHS | fp8 BF16 FP8 | autotune DEFAULT TUNED | dropout_hash PER_PAIR PER_ELEMENT | checkpointing KEPT RECOMPUTED"
        )
