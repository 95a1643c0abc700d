"""The run report's figures, each drawn from the rows of ``metrics.jsonl`` alone.

Every function takes the rows (one dict per logged step, as ``pretrain.tracking.jsonl`` writes them)
and returns a matplotlib figure, or None when the run logged nothing it could draw: metric names
are read generically, so a figure appears as soon as its metrics exist (per-source evaluation,
per-layer health, probes) and no figure is drawn empty.

Events marked on the loss curve (see :func:`events`): a step where ``train/nonfinite_skipped``
grew (the update was skipped), and a spike recovery, recognised by any of
``train/spike_recoveries`` growing (a cumulative count), a metric under ``spike/`` in the row, or
a row ``"event": "spike_recovery"``.
"""

from __future__ import annotations

import math
import re

# Figures without pyplot: no backend or display to choose, and a third of the import time, which the
# trainer pays at the end of every run.
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from pretrain import metric_names as names
from pretrain.eval.intervals import TEST_EXAMPLES, wilson

FIG_SIZE = (9, 4.2)
HEALTH_KEY = re.compile(r"^health/([^/]+)/grad_norm$")
SOURCE_EVAL_KEY = re.compile(r"^eval/([^/]+)/loss$")
PROBE_KEY = re.compile(r"^downstream/([^/]+)/accuracy$")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; nulls (non-finite values in the file) are left out."""
    pts = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def tokens_per_step(rows: list[dict], fallback: float | None) -> float | None:
    """From the logged ``train/tokens_seen`` (the run's own count), else the config's batch × length."""
    for r in reversed(rows):
        if r.get(names.TRAIN_TOKENS_SEEN) and r.get("step"):
            return r[names.TRAIN_TOKENS_SEEN] / r["step"]
    return fallback


def events(rows: list[dict]) -> dict[str, list[int]]:
    """Steps of non-finite skips and spike recoveries (see the module docstring)."""
    out: dict[str, list[int]] = {"non-finite skip": [], "spike recovery": []}
    skipped = recoveries = 0
    for r in rows:
        step = r.get("step")
        n = r.get(names.TRAIN_NONFINITE_SKIPPED)
        if n is not None and n > skipped:
            out["non-finite skip"].append(step)
            skipped = n
        n = r.get(names.TRAIN_SPIKE_RECOVERIES)
        spike = (
            (n is not None and n > recoveries)
            or r.get("event") == "spike_recovery"
            or any(k.startswith(names.SPIKE) for k in r)
        )
        if n is not None:
            recoveries = max(recoveries, n)
        if spike and step not in out["spike recovery"]:
            out["spike recovery"].append(step)
    return out


def _finish(fig, ax, title: str):
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def loss_figure(rows: list[dict], tok_per_step: float | None):
    """Train and eval loss against tokens seen (steps when unknown), the learning rate on the right,
    non-finite skips and spike recoveries as vertical lines."""
    steps, loss = series(rows, names.TRAIN_LOSS)
    e_steps, e_loss = series(rows, names.EVAL_LOSS)
    if not steps and not e_steps:
        return None
    scale = tok_per_step or 1.0
    fig = Figure(figsize=FIG_SIZE)
    ax = fig.subplots()
    if steps:
        ax.plot([s * scale for s in steps], loss, color="C0", lw=1.2, label="train loss")
    if e_steps:
        ax.plot([s * scale for s in e_steps], e_loss, "o-", color="C1", ms=4, label="eval loss")
    styles = {"non-finite skip": ("C3", ":"), "spike recovery": ("C4", "--")}
    for name, marks in events(rows).items():
        for i, s in enumerate(marks):
            ax.axvline(
                s * scale,
                color=styles[name][0],
                ls=styles[name][1],
                lw=1.2,
                label=f"{name} ({len(marks)})" if i == 0 else None,
            )
    ax.set_xlabel("training tokens seen" if tok_per_step else "step")
    ax.set_ylabel("MLM loss")
    lr_steps, lr = series(rows, names.TRAIN_LR)
    handles, labels = ax.get_legend_handles_labels()
    if lr_steps:
        ax2 = ax.twinx()
        ax2.plot([s * scale for s in lr_steps], lr, color="C2", lw=1, alpha=0.7, label="learning rate")
        ax2.set_ylabel("learning rate")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    return _finish(fig, ax, "Loss and learning rate")


def throughput_figure(rows: list[dict]):
    """Tokens/s and MFU side by side: on one machine MFU is tokens/s times a constant, so drawn on
    one axis the two curves hide each other."""
    steps, tps = series(rows, names.PERF_TOKENS_PER_S)
    m_steps, mfu = series(rows, names.PERF_MFU)
    if not steps and not m_steps:
        return None
    fig = Figure(figsize=FIG_SIZE)
    left, right = fig.subplots(1, 2)
    left.plot(steps, tps, color="C0", lw=1.2)
    left.set_ylabel("tokens/s (all ranks)")
    right.plot(m_steps, [100 * v for v in mfu], color="C1", lw=1.2)
    right.set_ylabel("MFU (% of measured peak)")
    for ax, title in ((left, "Throughput"), (right, "MFU")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def source_eval_figure(rows: list[dict], tok_per_step: float | None):
    """``eval/<source>/loss`` per source, drawn only when there are two or more sources."""
    sources = sorted({m.group(1) for r in rows for k in r if (m := SOURCE_EVAL_KEY.match(k))})
    if len(sources) < 2:
        return None
    scale = tok_per_step or 1.0
    fig = Figure(figsize=FIG_SIZE)
    ax = fig.subplots()
    for i, name in enumerate(sources):
        steps, loss = series(rows, names.heldout(names.eval_source(name))[0])
        ax.plot([s * scale for s in steps], loss, "o-", ms=3, color=f"C{i}", label=name)
    ax.set_xlabel("training tokens seen" if tok_per_step else "step")
    ax.set_ylabel("eval loss")
    ax.legend(fontsize=8)
    return _finish(fig, ax, "Eval loss per data source")


def layer_order(name: str) -> tuple:
    """embeddings, layer_00, layer_01, ..., head, then anything else by name."""
    if name == "embeddings":
        return (0, 0, name)
    m = re.match(r"^layer_(\d+)$", name)
    if m:
        return (1, int(m.group(1)), name)
    return (2 if name == "head" else 3, 0, name)


def grad_norm_heatmap(rows: list[dict]):
    """Layers × steps of ``health/<layer>/grad_norm`` on a log colour scale."""
    layers = sorted({m.group(1) for r in rows for k in r if (m := HEALTH_KEY.match(k))}, key=layer_order)
    health_rows = [r for r in rows if any(HEALTH_KEY.match(k) for k in r)]
    steps = [r["step"] for r in health_rows]
    if not layers:
        return None
    grid = [[_positive(r.get(names.health(name, "grad_norm"))) for r in health_rows] for name in layers]
    finite = [v for line in grid for v in line if not math.isnan(v)]
    if not finite:
        return None
    fig = Figure(figsize=(FIG_SIZE[0], max(2.5, 0.3 * len(layers) + 1.5)))
    ax = fig.subplots()
    image = ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        norm=LogNorm(vmin=min(finite), vmax=max(max(finite), min(finite) * 1.0001)),
    )
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ticks = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label="gradient norm (log scale)")
    ax.set_title("Gradient norm per layer")
    fig.tight_layout()
    return fig


def _positive(v) -> float:
    """A value a log scale can place; zero, negative or missing shows as a blank cell."""
    return float(v) if v is not None and v > 0 else float("nan")


def probe_figure(rows: list[dict]):
    """``downstream/<task>/accuracy`` over steps, with its 95% interval as a band where the run logged
    the task's ``test_examples`` (``pretrain.eval.intervals``), and the task's baselines
    (``..._accuracy`` logged once, e.g. random_init and majority) as dashed horizontal lines."""
    tasks = sorted({m.group(1) for r in rows for k in r if (m := PROBE_KEY.match(k))})
    if not tasks:
        return None
    fig = Figure(figsize=FIG_SIZE)
    ax = fig.subplots()
    for i, task in enumerate(tasks):
        steps, acc = series(rows, names.downstream(names.DOWNSTREAM, task, "accuracy"))
        ax.plot(steps, acc, "o-", ms=4, color=f"C{i}", label=f"{task}: probe")
        _, examples = series(rows, names.downstream(names.DOWNSTREAM, task, TEST_EXAMPLES))
        if examples:
            low, high = zip(*(wilson(a, int(examples[-1])) for a in acc))
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.15, lw=0, label=f"{task}: 95% interval")
        bases = sorted(
            {
                k
                for r in rows
                for k in r
                if k.startswith(names.downstream(names.DOWNSTREAM, task, ""))
                and k.endswith("_accuracy")
                and not k.endswith("/accuracy")
            }
        )
        for j, key in enumerate(bases):
            _, values = series(rows, key)
            if values:
                ax.axhline(
                    values[-1],
                    color=f"C{i}",
                    ls=["--", ":", "-."][j % 3],
                    lw=1,
                    label=f"{task}: {key.split('/')[-1].removesuffix('_accuracy')}",
                )
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _finish(fig, ax, "Downstream probes and their baselines")


def all_figures(rows: list[dict], tok_per_step: float | None) -> list[tuple[str, str, object]]:
    """(file stem, caption, figure) for every figure the rows can draw, in report order."""
    made = [
        (
            "loss",
            "Loss against tokens seen, with the learning rate; skips and recoveries marked",
            loss_figure(rows, tok_per_step),
        ),
        ("throughput", "Throughput and model FLOPs utilisation", throughput_figure(rows)),
        ("eval_sources", "Evaluation per data source", source_eval_figure(rows, tok_per_step)),
        ("grad_norm_layers", "Gradient norm per layer over steps", grad_norm_heatmap(rows)),
        ("probes", "Downstream probes with their baselines", probe_figure(rows)),
    ]
    return [m for m in made if m[2] is not None]
