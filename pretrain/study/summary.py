"""A study's summary: one row per variant (Markdown and CSV) and two plots, from each variant's
``metrics.jsonl`` (what the trainer wrote; the same numbers went to its MLflow child run).

Columns: the grid values, status, steps and tokens trained, every ``eval/*`` metric (evaluation
always masks 15% of tokens, 80/10/10, with a fixed seed, so these compare across masking settings),
every ``downstream/*`` metric any variant logged (probe and labelled tasks, with their baselines),
training tokens/s (median of the logged windows) and wall time. A metric a variant lacks shows "-".
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from pathlib import Path
from typing import Callable

from pretrain import metric_names as names
from pretrain.eval.intervals import TEST_EXAMPLES, wilson

FIXED_COLUMNS = ("variant", "status", "steps", "tokens_seen")
FIRST_EVAL = (names.EVAL_LOSS, names.EVAL_ACCURACY)


def read_metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return rows


def _last(rows: list[dict], key: str):
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None


def variant_state(status: dict) -> str:
    """An unfinished variant's state from its ``study_status.json``: interrupted (a signal stopped it, or it
    checkpointed and exited 0/3: the next run resumes it), failed (its training exited with an error),
    or not started."""
    code = status.get("last_exit")
    if not status.get("launches"):
        return "not started"
    # A signal's death: -N from Popen, 128 + N from a shell.
    if code in (0, 3) or status.get("stopped_by_signal") or (code is not None and (code < 0 or code > 128)):
        return "interrupted"
    return "failed"


def variant_row(variant, rows: list[dict], status: dict, finished: bool) -> dict:
    steps = max((r["step"] for r in rows), default=0)
    tokens_per_s = [r[names.PERF_TOKENS_PER_S] for r in rows if names.PERF_TOKENS_PER_S in r]
    row = {
        "variant": variant.name,
        **{k: v for k, v in variant.values.items()},
        "status": "finished" if finished else variant_state(status),
        "steps": steps,
        "tokens_seen": _last(rows, names.TRAIN_TOKENS_SEEN),
    }
    for key in sorted({k for r in rows for k in r if k.startswith((names.EVAL + "/", names.DOWNSTREAM + "/"))}):
        row[key] = _last(rows, key)
    row["tokens_per_s"] = statistics.median(tokens_per_s) if tokens_per_s else None
    row["wall_s"] = round(status["wall_s"], 1) if status.get("launches") else None
    return row


def eval_curve(rows: list[dict]) -> tuple[list[float], list[float]]:
    """(tokens seen, eval loss) at every evaluation; tokens per step from the logged tokens_seen."""
    per_step = [r[names.TRAIN_TOKENS_SEEN] / r["step"] for r in rows if names.TRAIN_TOKENS_SEEN in r and r["step"]]
    if not per_step:
        return [], []
    points = [(r["step"] * per_step[-1], r[names.EVAL_LOSS]) for r in rows if names.EVAL_LOSS in r]
    return [p[0] for p in points], [p[1] for p in points]


def columns(table: list[dict], grid_keys: list[str]) -> list[str]:
    metric_keys = sorted({k for row in table for k in row if k.startswith((names.EVAL + "/", names.DOWNSTREAM + "/"))})
    evals = [k for k in FIRST_EVAL if k in metric_keys] + [
        k for k in metric_keys if k.startswith(names.EVAL + "/") and k not in FIRST_EVAL
    ]
    downstream = [k for k in metric_keys if k.startswith(names.DOWNSTREAM + "/")]
    return ["variant", *grid_keys, "status", "steps", "tokens_seen", *evals, *downstream, "tokens_per_s", "wall_s"]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


def accuracy_interval(row: dict, key: str) -> tuple[float, float] | None:
    """The 95% interval of a ``downstream/<task>/...accuracy`` in ``row``, where the variant logged
    the task's ``test_examples``; else None."""
    if not (key.startswith(names.DOWNSTREAM + "/") and key.endswith("accuracy")) or row.get(key) is None:
        return None
    examples = row.get(names.downstream(names.DOWNSTREAM, key.split("/")[1], TEST_EXAMPLES))
    return wilson(row[key], int(examples)) if examples else None


def _cell(row: dict, key: str) -> str:
    """A Markdown cell: a probe's accuracy with its 95% interval, ``0.857 (0.788-0.907)``."""
    interval = accuracy_interval(row, key)
    return _fmt(row.get(key)) + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else "")


def to_markdown(table: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(row, c) for c in cols) + " |" for row in table]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, table: list[dict], cols: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(cols)
        for row in table:
            writer.writerow(["-" if row.get(c) is None else row[c] for c in cols])


def plot_eval_loss(path: Path, curves: dict[str, tuple[list, list]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (x, y) in curves.items():
        if x:
            ax.plot(x, y, marker="o", markersize=3, label=name)
    if not any(x for x, _ in curves.values()):
        ax.text(0.5, 0.5, "no evaluation logged yet", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("eval loss (15% token masking, fixed seed)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _is_probe_accuracy(key: str) -> bool:
    return key.startswith(names.DOWNSTREAM + "/") and key.endswith("/accuracy")


def plot_probe_accuracy(path: Path, table: list[dict], title: str) -> None:
    """Final ``downstream/<task>/accuracy`` per variant, grouped by task, each with its 95% interval
    where the task's ``test_examples`` was logged, and the task's logged baselines
    (``downstream/<task>/<name>_accuracy``: random init, majority class) as dashed lines. The y axis
    starts just below the lowest bar, interval or baseline, so differences of a point show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k.split("/")[1] for row in table for k in row if _is_probe_accuracy(k) and row[k] is not None})
    fig, ax = plt.subplots(figsize=(max(6, 1.5 + len(table) * max(len(tasks), 1) * 0.5) + 3, 5))
    width = 0.8 / max(len(table), 1)
    shown = []
    for t, task in enumerate(tasks):
        for i, row in enumerate(table):
            key = names.downstream(names.DOWNSTREAM, task, "accuracy")
            value = row.get(key)
            if value is not None:
                x = t + (i - (len(table) - 1) / 2) * width
                ax.bar(x, value, width, color=f"C{i}", label=row["variant"] if t == 0 else None)
                ax.text(x, value, f"{value:.3f}", fontsize=7, ha="left", va="bottom")
                shown.append(value)
                if interval := accuracy_interval(row, key):
                    ax.errorbar(x, value, [[value - interval[0]], [interval[1] - value]], color="k", capsize=3, lw=1)
                    shown.extend(interval)
        task_prefix = names.downstream(names.DOWNSTREAM, task, "")
        for key in sorted({k for row in table for k in row if k.startswith(task_prefix) and k.endswith("_accuracy")}):
            base = next((row[key] for row in table if row.get(key) is not None), None)
            if base is not None:
                ax.hlines(base, t - 0.45, t + 0.45, colors="k", linestyles="dashed")
                ax.text(
                    t + 0.45, base, key.split("/")[-1].removesuffix("_accuracy"), fontsize=7, va="bottom", ha="right"
                )
                shown.append(base)
    if tasks:
        ax.set_xticks(range(len(tasks)), tasks)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_ylim(max(0.0, min(shown) - 0.05), min(1.0, max(shown) + 0.05))
    else:
        ax.text(
            0.5,
            0.5,
            "no downstream/<task>/accuracy metric in any variant",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_xticks([])
    ax.set_ylabel("final probe accuracy")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COMPARE = "compare"  # its section sorts before the measures' (eval_*, probe_*) on the chart page


def comparison_metrics(table: list[dict]) -> list[tuple[str, float, int]]:
    """The parent run's metrics ``(name, value, step)``, so that its MLflow chart page compares the
    variants. First, one chart per measure with every variant in it: ``compare/eval_loss`` at
    step = the variant's row in the table (MLflow draws a chart per metric name, its x axis is the
    step). Then a section per measure (``eval_loss``, ``eval_accuracy``, ``probe_<task>_accuracy``
    with the probes' baselines) with a chart per variant named after it
    (``eval_loss/rate:0.15-strategy:token``: ``=`` is not allowed in a metric name)."""
    out = []
    for step, row in enumerate(table):
        variant = re.sub(r"[^A-Za-z0-9_\-. :]", "_", row["variant"].replace("=", ":"))
        for key, value in row.items():
            if value is None or not isinstance(value, (int, float)):
                continue
            probe = re.match(r"^downstream/([^/]+)/(accuracy|(random_init|majority)_accuracy)$", key)
            measure = (
                key.replace("/", "_") if key in FIRST_EVAL else f"probe_{probe.group(1)}_accuracy" if probe else None
            )
            if measure is None:
                continue
            if probe and probe.group(3):  # a baseline: the same for every variant
                if step == 0:
                    out.append((f"{measure}/baseline {probe.group(3)}", float(value), 0))
                continue
            out.append((f"{COMPARE}/{measure}", float(value), step))
            out.append((f"{measure}/{variant}", float(value), 0))
    return out


def comparison_note(table: list[dict], markdown: str) -> str:
    """The parent run's description (its Overview page): which step is which variant, and the table."""
    steps = "\n".join(f"- step {i}: `{row['variant']}`" for i, row in enumerate(table))
    return f"In the `{COMPARE}` charts the x axis (step) is the variant:\n\n{steps}\n\n{markdown}"


def summary_table(study, read_status: Callable, is_finished: Callable) -> tuple[list[dict], dict]:
    """One row per variant, and each variant's eval curve."""
    table, curves = [], {}
    for variant in study.variants:
        rows = read_metrics(variant.out_dir)
        table.append(variant_row(variant, rows, read_status(variant), is_finished(variant)))
        curves[variant.name] = eval_curve(rows)
    return table, curves


def write_summary(study, read_status: Callable, is_finished: Callable) -> list[Path]:
    """summary.md, summary.csv, eval_loss.png and probe_accuracy.png in the study folder."""
    table, curves = summary_table(study, read_status, is_finished)
    cols = columns(table, study.grid_keys)
    out = study.dir
    md = out / "summary.md"
    md.write_text(
        f"# Study {study.section.name}\n\nGrid: "
        + (", ".join(f"`{k}` in {v}" for k, v in study.section.grid.items()) or "none")
        + f"; {study.section.ranks} rank(s) per variant; config `{study.config_path}`.\n"
        "Eval metrics at 15% token masking (80/10/10, fixed seed) whatever the variant trains with.\n\n"
        + to_markdown(table, cols)
    )
    write_csv(out / "summary.csv", table, cols)
    plot_eval_loss(out / "eval_loss.png", curves, f"{study.section.name}: eval loss")
    plot_probe_accuracy(out / "probe_accuracy.png", table, f"{study.section.name}: final probe accuracy")
    return [md, out / "summary.csv", out / "eval_loss.png", out / "probe_accuracy.png"]
