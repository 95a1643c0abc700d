"""Where one training step of ours goes, and what each known lead for a faster step is worth.

Called by ``bench/train_throughput.py --breakdown | --profile | --leads``. Everything runs in one
process at world size 1 on the real components (``pretrain.model.mlm.build_model``, the DeepSpeed engine
from ``pretrain.runtime.engine.initialize``, ``TrainStream``, ``mask_batch``), built once per setting:

* ``breakdown``: the calls of ``pretrain.train.fit``'s step in the same order, each timed (on the
  CPU every op is synchronous, so a phase's time is its own).
* ``profile``: ``torch.profiler`` over a few steps of ours and of the bare loop (the same model,
  sparse head, ``torch.optim.AdamW``): the ops that take the time, side by side.
* ``leads``: A/B timings, each a median over ``--steps - --warmup-steps`` repeats taken in turn
  (A, B, A, B, ...), of one change at a time: through a config switch where one exists
  (``impl.fused_optimizer``, ZeRO stage, dropout), else the two ways side by side (the accuracy
  argmax, the padding mask), so a gain is measured before anyone edits the file it lives in.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import format_table

# Wall time by default. On a shared machine, run with one thread and ``use_cpu_clock()``: the
# process's CPU seconds then count only its own work, whatever else holds the cores.
_clock: Callable[[], float] = time.perf_counter


def use_cpu_clock() -> None:
    global _clock
    _clock = time.process_time


@dataclass
class Setup:
    cfg: object
    special: object
    info: object
    precision: str
    model: torch.nn.Module  # our MLMModel (inside the engine when ``engine`` is set)
    engine: object  # DeepSpeed engine, or None for the bare loop
    optimizer: torch.optim.Optimizer
    scheduler: object
    batches: object
    seq_len: int


def _load(config: Path, overrides: list[str]):
    from pretrain.config.schema import load_config
    from pretrain.runtime import engine as eng

    if not dist.is_initialized():  # once per process: DeepSpeed caches the world group
        eng.prepare_env()
    cfg = load_config(str(config), overrides)
    return cfg, eng.init_distributed(cfg)


def build(config: Path, overrides: list[str], shards: Path, *, bare: bool = False) -> Setup:
    """Ours (DeepSpeed engine) or the bare loop's pieces (model + torch AdamW + LambdaLR).
    ``impl.fused_optimizer`` picks the bare loop's AdamW kernel too (false: foreach, else fused)."""
    from data_prep.common.manifest import load_manifest
    from pretrain.data.stream import TrainStream
    from pretrain.model.masking import SpecialIds
    from pretrain.model.mlm import build_model
    from pretrain.model.schedule import lr_schedule
    from pretrain.runtime import engine as eng
    from pretrain.runtime import hardware

    cfg, info = _load(config, overrides)
    manifest = load_manifest(shards)
    precision, _ = hardware.resolve_precision(cfg.impl.precision, info.device)
    special = SpecialIds.from_manifest(manifest)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, manifest.tokenizer.vocab_size, special, cfg.impl, seq_len=manifest.seq_len)
    batches = iter(
        TrainStream(
            shards, manifest, "train", 0, 1, cfg.impl.micro_batch_size, cfg.train.global_batch_size, cfg.data.seed
        )
    )
    if bare:
        o = cfg.optim
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=cfg.impl.fused_optimizer is not False or None,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
        engine = None
    else:
        engine, scheduler, _, optimizer = eng.initialize(model, cfg, info, precision)
        if cfg.compile_now(cfg.train.max_steps, info.device.type, precision):
            engine.compile()
    return Setup(cfg, special, info, precision, model, engine, optimizer, scheduler, batches, manifest.seq_len)


PHASES = ["data", "mask", "all_reduce", "forward", "backward", "step"]


def timed_step(s: Setup, step: int) -> list[float]:
    """One optimiser step of one micro-batch, the calls of ``pretrain.train.train_step`` in the same
    order, each timed; returns the phases' seconds."""
    from pretrain.config.seeds import derive_seed
    from pretrain.model.masking import mask_batch
    from pretrain.runtime import engine as eng

    t = [_clock()]
    batch = next(s.batches)
    t.append(_clock())
    m = mask_batch(
        batch["input_ids"], batch["word_starts"], s.special, s.cfg.masking, sample_ids=batch["sample_ids"], step=step
    )
    attention_mask = (batch["input_ids"] != s.special.pad) if batch.get("has_padding", True) else None
    t.append(_clock())
    predicted = m.num_masked.double().reshape(1)
    dist.all_reduce(predicted)
    scale = 1.0 / predicted.clamp(min=1.0)
    local_bad = torch.zeros(2)  # the loop's second collective: non-finite loss / stop flags
    dist.all_reduce(local_bad, op=dist.ReduceOp.MAX)
    t.append(_clock())
    torch.manual_seed(derive_seed("dropout", s.cfg.train.seed, step, 0, 0))
    if s.engine is not None:
        with eng.eager_forward(s.engine, eager=attention_mask is not None):
            loss_sum, _, _ = s.engine(m.input_ids, attention_mask, m.positions, m.labels)
        t.append(_clock())
        s.engine.backward(loss_sum * scale)
        t.append(_clock())
        s.engine.step()
    else:
        with torch.autocast("cpu", torch.bfloat16, enabled=s.precision == "bf16"):
            loss_sum, _, _ = s.model(m.input_ids, batch["input_ids"] != s.special.pad, m.positions, m.labels)
        t.append(_clock())
        (loss_sum * scale).backward()
        t.append(_clock())
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), s.cfg.optim.grad_clip)
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
    t.append(_clock())
    return [b - a for a, b in zip(t, t[1:])]


def phase_medians(s: Setup, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds of each phase (and of the whole step) over the steps after warm-up."""
    runs = [timed_step(s, i) for i in range(steps)][warmup:]
    out = {name: statistics.median(r[i] for r in runs) for i, name in enumerate(PHASES)}
    out["total"] = statistics.median(sum(r) for r in runs)
    return out


def breakdown(
    config: Path, overrides: list[str], shards: Path, steps: int, warmup: int, label: str, tokens_per_step: int
) -> str:
    s = build(config, overrides, shards)
    med = phase_medians(s, steps, warmup)
    rows = [[name, f"{1000 * med[name]:.1f}", f"{100 * med[name] / med['total']:.1f}%"] for name in PHASES]
    rows.append(["total", f"{1000 * med['total']:.1f}", f"{tokens_per_step / med['total']:,.0f} tokens/s"])
    return format_table([f"{label} ({s.precision}): phase", "median ms/step", "share"], rows)


def profile(config: Path, overrides: list[str], shards: Path, steps: int, out_dir: Path, top: int = 18) -> str:
    """torch.profiler tables (self CPU time per op) for ours and the bare loop; chrome traces saved."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tables = []
    for label, bare in (("ours (DeepSpeed engine)", False), ("bare loop", True)):
        s = build(config, overrides, shards, bare=bare)
        for i in range(2):
            timed_step(s, i)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                timed_step(s, 2 + i)
        out_dir.mkdir(parents=True, exist_ok=True)
        trace = out_dir / f"trace-{'bare' if bare else 'ours'}.json"
        prof.export_chrome_trace(str(trace))
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        rows = [
            [
                e.key,
                e.count // steps,
                f"{e.self_cpu_time_total / 1000 / steps:.1f}",
                f"{100 * e.self_cpu_time_total / total:.1f}%",
            ]
            for e in events[:top]
        ]
        tables.append(
            f"{label}, {s.precision}, {steps} steps, trace {trace}:\n"
            + format_table(["op", "calls/step", "self ms/step", "share"], rows)
        )
    return "\n\n".join(tables)


# ------------------------------------------------------------------------------------------ leads


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    return _ab_median_ms([fn], repeats, warmup)[0]


def _ab_median_ms(fns: list[Callable[[], object]], repeats: int, warmup: int = 2) -> list[float]:
    """Median ms of each function, called in turn (A, B, A, B, ...) so that they share the load."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + repeats):
        for fn, t in zip(fns, times):
            start = _clock()
            fn()
            t.append(_clock() - start)
    return [1000 * statistics.median(t[warmup:]) for t in times]


def _sample_masked(s: Setup):
    from pretrain.model.masking import mask_batch

    batch = next(s.batches)
    return batch, mask_batch(
        batch["input_ids"], batch["word_starts"], s.special, s.cfg.masking, sample_ids=batch["sample_ids"], step=0
    )


def optimizer_lead(config, overrides, shards, steps, warmup) -> list[list]:
    """Phases of ours at ZeRO 0/1/2 with today's optimiser and with torch's fused AdamW, and of the
    bare loop with both: what the engine adds per micro-step, and what the fused kernel saves.
    The settings take their steps in turn (round-robin), so a change of load hits them alike."""
    settings = [(f"ours ZeRO {z}", [f"impl.zero_stage={z}"], False) for z in (0, 1, 2)]
    settings.append(("bare loop", [], True))
    setups = [
        (
            label,
            fused,
            build(config, overrides + extra + [f"impl.fused_optimizer={str(fused).lower()}"], shards, bare=bare),
        )
        for label, extra, bare in settings
        for fused in (False, True)
    ]
    runs: list[list[list[float]]] = [[] for _ in setups]
    for i in range(steps):
        for k, (_, _, s) in enumerate(setups):
            runs[k].append(timed_step(s, i))
    rows = []
    for (label, fused, s), r in zip(setups, runs):
        r = r[warmup:]
        med = [statistics.median(x[PHASES.index(p)] for x in r) for p in ("forward", "backward", "step")]
        wrapper = type(s.engine.optimizer).__name__ if s.engine is not None else "-"
        rows.append(
            [
                label,
                "torch AdamW fused" if fused else "torch AdamW foreach",
                wrapper,
                *(f"{1000 * v:.1f}" for v in med),
                f"{1000 * statistics.median(sum(x) for x in r):.1f}",
            ]
        )
    return rows


def argmax_lead(s: Setup, repeats: int) -> list[list]:
    """Ways to take the accuracy's argmax, timed on the logits of one real micro-batch's masked
    positions. The model takes it on logged steps only: with ``impl.fused_mlm_loss`` from the max that
    shifts the softmax (``pretrain.model.mlm_loss``), else on the fp32 copy cross-entropy makes."""
    _, m = _sample_masked(s)
    dtype = torch.bfloat16 if s.precision == "bf16" else torch.float32
    logits = torch.randn(m.positions.numel(), s.model.config.vocab_size).to(dtype)
    logits32 = logits.float()
    labels = m.labels
    counted = labels != -100
    rows = [
        [
            "argmax on the model-dtype logits",
            f"{_median_ms(lambda: ((logits.argmax(-1) == labels) & counted).sum(), repeats):.1f}",
        ],
        [
            "argmax on the fp32 copy CE makes (impl.fused_mlm_loss=false)",
            f"{_median_ms(lambda: ((logits32.argmax(-1) == labels) & counted).sum(), repeats):.1f}",
        ],
        [
            "fp32: target logit >= amax (gather)",
            f"{_median_ms(lambda: ((logits32.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) >= logits32.amax(-1)) & counted).sum(), repeats):.1f}",
        ],
        ["(the fp32 copy itself, made once for CE)", f"{_median_ms(lambda: logits.float(), repeats):.1f}"],
        [
            "(cross-entropy on the fp32 copy, forward)",
            f"{_median_ms(lambda: F.cross_entropy(logits32, labels, reduction='sum'), repeats):.1f}",
        ],
    ]
    return [[f"{m.positions.numel()} x {logits.shape[1]} {str(dtype).removeprefix('torch.')}", *r] for r in rows]


def encoder_lead(config, overrides, shards, repeats, compiled: bool = False) -> list[list]:
    """Encoder forward + backward (train mode) with the padding mask as a tensor (today; in eager
    mode HF checks ``mask.all()`` and drops an all-true mask itself, but not while torch.compile
    traces) or as None (nothing to check), with dropout as configured and with dropout off."""
    rows = []
    dropouts = (
        ("dropout as configured", []),
        ("attention dropout 0", ["model.attention_dropout=0"]),
        ("all dropout 0", ["model.attention_dropout=0", "model.hidden_dropout=0"]),
    )
    for label, extra in dropouts[:1] if compiled else dropouts:
        s = build(config, overrides + extra, shards, bare=True)
        encoder = s.model.hf_model.bert
        if s.precision == "bf16":
            encoder.to(torch.bfloat16)
        if compiled:
            encoder = torch.compile(encoder)
            label += ", torch.compile"
        batch, m = _sample_masked(s)
        ids = m.input_ids
        mask = batch["input_ids"] != s.special.pad

        def run(attention_mask):
            encoder(input_ids=ids, attention_mask=attention_mask).last_hidden_state.float().sum().backward()
            encoder.zero_grad(set_to_none=True)

        with_mask, no_mask = _ab_median_ms([lambda: run(mask), lambda: run(None)], repeats)
        rows.append([label, f"{bool(mask.all())}", f"{with_mask:.1f}", f"{no_mask:.1f}", f"{with_mask - no_mask:+.1f}"])
    return rows


def small_costs(s: Setup, repeats: int) -> list[list]:
    """Per-micro-step costs outside the model: seeding, masking, the two collectives, data."""
    from pretrain.config.seeds import derive_seed
    from pretrain.model.masking import mask_batch, mask_generator

    batch = next(s.batches)
    fixed = type(s.cfg.masking)(**{**vars(s.cfg.masking), "fixed_count": True})
    flags = torch.zeros(2)
    count = torch.ones(1, dtype=torch.float64)
    return [
        [
            "dropout re-seed: torch.manual_seed(derive_seed(...))",
            f"{_median_ms(lambda: torch.manual_seed(derive_seed('dropout', 42, 7, 0, 0)), repeats):.3f}",
        ],
        [
            "masking, keyed by sample id (the trainer's)",
            f"{_median_ms(lambda: mask_batch(batch['input_ids'], batch['word_starts'], s.special, s.cfg.masking, sample_ids=batch['sample_ids'], step=1), repeats):.3f}",
        ],
        [
            "masking, keyed by sample id, fixed_count",
            f"{_median_ms(lambda: mask_batch(batch['input_ids'], batch['word_starts'], s.special, fixed, sample_ids=batch['sample_ids'], step=1), repeats):.3f}",
        ],
        [
            "masking from a torch.Generator (before)",
            f"{_median_ms(lambda: mask_batch(batch['input_ids'], batch['word_starts'], s.special, s.cfg.masking, mask_generator(0, 1, 0, 0)), repeats):.3f}",
        ],
        ["all_reduce: masked count (world 1, gloo)", f"{_median_ms(lambda: dist.all_reduce(count), repeats):.3f}"],
        [
            "all_reduce: non-finite/stop flags (world 1, gloo)",
            f"{_median_ms(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX), repeats):.3f}",
        ],
        ["next micro-batch from TrainStream (workers 0)", f"{_median_ms(lambda: next(s.batches), repeats):.3f}"],
        ["padding mask: input_ids != pad", f"{_median_ms(lambda: batch['input_ids'] != s.special.pad, repeats):.3f}"],
    ]


def leads(config: Path, overrides: list[str], shards: Path, steps: int, warmup: int, compiled: bool = True) -> None:
    """Prints each table as soon as it is measured."""
    repeats = max(3, steps - warmup)
    rows = optimizer_lead(config, overrides, shards, steps, warmup)
    print(
        "Optimiser and engine (median ms per step; ours = DeepSpeed engine; bare = model + "
        "torch AdamW + clip + LambdaLR; the kernel from impl.fused_optimizer=false|true):\n"
        + format_table(["setting", "optimiser", "DeepSpeed wrapper", "forward", "backward", "step", "whole step"], rows)
        + "\n",
        flush=True,
    )
    s = build(config, overrides, shards)
    print(
        "Accuracy metric in MLMModel.forward (median ms per micro-step):\n"
        + format_table(["logits", "what", "ms"], argmax_lead(s, repeats))
        + "\n",
        flush=True,
    )
    print(
        "Per-micro-step costs outside the model (median ms):\n"
        + format_table(["what", "ms"], small_costs(s, repeats))
        + "\n",
        flush=True,
    )
    del s
    header = ["dropout", "batch has no padding", "mask tensor (today)", "mask None", "difference"]
    print(
        "Encoder forward + backward, train mode, one micro-batch (median ms):\n"
        + format_table(header, encoder_lead(config, overrides, shards, repeats))
        + "\n",
        flush=True,
    )
    if compiled:
        print(
            "The same under torch.compile (compile time not counted):\n"
            + format_table(header, encoder_lead(config, overrides, shards, repeats, compiled=True)),
            flush=True,
        )
