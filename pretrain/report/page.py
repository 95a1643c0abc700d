"""A run report: one self-contained HTML file and the same figures as PNGs, from a run folder.

    python -m pretrain.report RUN_DIR            # writes RUN_DIR/report/report.html and *.png

Made from what the run folder holds: ``metrics.jsonl`` (figures, see ``pretrain.report.figures``),
the resolved config and data manifest saved with the latest complete checkpoint, the checkpoints
and Hugging Face exports on disk, and the MLflow run id. The trainer makes it at the end of a run
(rank 0) and logs the folder to the MLflow run as ``report/``; a failure there only warns.

Exit codes: 0 written, 2 not a run folder (no ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from data_prep.common.manifest import Manifest
from pretrain import metric_names as names
from pretrain.checkpoint.checkpointing import complete_tags, latest_complete_tag, saved_manifest
from pretrain.checkpoint.files import CONFIG_FILE
from pretrain.config import loader as configlib
from pretrain.tracking.jsonl import read_metrics

log = logging.getLogger("pretrain")
REPORT_DIR = "report"
EXIT_BAD_INPUT = 2


class NotARunFolder(Exception):
    pass


def run_facts(run_dir: Path, config: dict | None = None, manifest: Manifest | None = None) -> dict:
    """Everything the report shows besides the figures. ``config``/``manifest`` default to the
    copies saved with the latest complete checkpoint."""
    root = run_dir / "checkpoints"  # checkpointing.checkpoint_root: always out_dir/checkpoints
    tag = latest_complete_tag(root)
    if config is None and tag:
        config = yaml.safe_load((root / tag / CONFIG_FILE).read_text())
    if manifest is None and tag:
        manifest = saved_manifest(root, tag)
    run_id_file = run_dir / "mlflow_run_id"
    exports = sorted(p.name for p in run_dir.glob("hf_*") if p.is_dir() and (p / "config.json").is_file())
    return {
        "config": config,
        "manifest": manifest,
        "checkpoint_root": root,
        "checkpoints": complete_tags(root),
        "latest_checkpoint": tag,
        "exports": exports,
        "mlflow_run_id": run_id_file.read_text().strip() if run_id_file.is_file() else None,
    }


def _png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _summary_rows(rows: list[dict], facts: dict) -> list[tuple[str, str]]:
    def last(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return values[-1] if values else None

    out = [
        ("steps", str(max((r.get("step", 0) for r in rows), default=0))),
        ("tokens seen", _num(last(names.TRAIN_TOKENS_SEEN))),
    ]
    for key in (
        names.TRAIN_LOSS,
        names.EVAL_LOSS,
        names.EVAL_ACCURACY,
        names.PERF_TOKENS_PER_S,
        names.PERF_MFU,
        names.TRAIN_NONFINITE_SKIPPED,
        names.TRAIN_SPIKE_RECOVERIES,
    ):
        if last(key) is not None:
            out.append((f"final {key}", _num(last(key))))
    if facts["mlflow_run_id"]:
        out.append(("MLflow run", facts["mlflow_run_id"]))
    return out


def _link(url: str | None) -> str:
    return f'<p>Watch the run in MLflow: <a href="{html.escape(url)}">{html.escape(url)}</a></p>' if url else ""


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    return f"{v:.4g}"


def _manifest_rows(manifest: Manifest | None) -> list[tuple[str, str]]:
    if manifest is None:
        return [("manifest", "not found (no complete checkpoint yet)")]
    out = [
        ("sequence length", str(manifest.seq_len)),
        ("vocab size", str(manifest.tokenizer.vocab_size)),
        ("tokenizer sha256", manifest.tokenizer.sha256[:16]),
    ]
    for split, totals in sorted(manifest.totals.items()):
        out.append((f"{split} split", ", ".join(f"{_num(v)} {k}" for k, v in totals.items())))
    return out


def _place_rows(run_dir: Path, facts: dict) -> list[tuple[str, str]]:
    cks = facts["checkpoints"]
    out = [
        ("run folder", str(run_dir.resolve())),
        (
            "checkpoints",
            f"{facts['checkpoint_root']} ({len(cks)} complete"
            + (f": {cks[0]} … {cks[-1]}" if len(cks) > 1 else f": {cks[0]}" if cks else "")
            + ")",
        ),
        ("latest checkpoint", facts["latest_checkpoint"] or "none"),
    ]
    out += [(f"export {name}", str((run_dir / name).resolve())) for name in facts["exports"]] or [
        ("export", "none yet")
    ]
    return out


def _table(rows: list[tuple[str, str]]) -> str:
    return (
        "<table>"
        + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
        + "</table>"
    )


STYLE = """body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}th,td{text-align:left;padding:2px 12px 2px 0;vertical-align:top}
th{color:#555;font-weight:normal}figure{margin:1em 0}img{max-width:100%}figcaption{color:#555;font-size:.9em}
pre{background:#f6f6f6;padding:1em;font-size:.8em;overflow:auto;max-height:40em}"""


def render_html(
    title: str,
    figures: list[tuple[str, str, bytes]],
    rows: list[dict],
    run_dir: Path,
    facts: dict,
    mlflow_url: str | None = None,
) -> str:
    figs = (
        "".join(
            f'<figure id="{stem}"><img alt="{html.escape(caption)}" src="data:image/png;base64,'
            f'{base64.b64encode(png).decode()}"><figcaption>{html.escape(caption)}</figcaption></figure>'
            for stem, caption, png in figures
        )
        or "<p>No metrics to draw yet.</p>"
    )
    config = yaml.safe_dump(facts["config"], sort_keys=False) if facts["config"] else "not found"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>Made {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from {html.escape(str(run_dir / 'metrics.jsonl'))}."
        f"</p>{_table(_summary_rows(rows, facts))}{_link(mlflow_url)}<h2>Figures</h2>{figs}"
        f"<h2>Where things are</h2>{_table(_place_rows(run_dir, facts))}"
        f"<h2>Data</h2>{_table(_manifest_rows(facts['manifest']))}"
        f"<h2>Resolved config</h2><pre>{html.escape(config)}</pre></body></html>"
    )


def write_report(
    run_dir: Path, config: dict | None = None, manifest: Manifest | None = None, mlflow_url: str | None = None
) -> Path:
    """Write ``run_dir/report/`` (report.html and one PNG per figure); returns the folder."""
    # lazy: pulls in matplotlib (~0.5 s); the trainer imports this module, but only its rank 0 draws, at the end
    from pretrain.report.figures import all_figures, tokens_per_step

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise NotARunFolder(f"{run_dir}: no metrics.jsonl here; give the folder a run wrote (train.out_dir)")
    rows = read_metrics(run_dir / "metrics.jsonl")
    facts = run_facts(run_dir, config, manifest)
    fallback = None
    if facts["config"] and facts["manifest"] is not None:
        fallback = facts["config"]["train"]["global_batch_size"] * facts["manifest"].seq_len
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    pngs = []
    for stem, caption, fig in all_figures(rows, tokens_per_step(rows, fallback)):
        png = _png_bytes(fig)
        (out / f"{stem}.png").write_bytes(png)
        pngs.append((stem, caption, png))
    name = (facts["config"] or {}).get("tracking", {}).get("run_name") or run_dir.resolve().name
    tmp = out / "report.html.tmp"
    tmp.write_text(render_html(f"Run report: {name}", pngs, rows, run_dir, facts, mlflow_url))
    tmp.replace(out / "report.html")
    return out


def report_at_end(cfg, manifest: Manifest, tracker) -> Optional[Path]:
    """The trainer's call (rank 0, end of a run): write the report and hand it to the tracker; returns
    its folder (None if it could not be written). Never raises: a report is not worth failing a
    finished run over."""
    try:
        start, cpu = time.perf_counter(), time.process_time()
        out = write_report(Path(cfg.train.out_dir), configlib.redact(configlib.to_dict(cfg)), manifest, tracker.run_url)
        tracker.log_artifacts(str(out), REPORT_DIR)
        log.info(
            "report: %s (%.1fs, %.1fs CPU)", out / "report.html", time.perf_counter() - start, time.process_time() - cpu
        )
        return out
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("report: could not be written (%s: %s); training is unaffected", type(exc).__name__, exc)
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pretrain.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dir", type=Path, help="a run folder (train.out_dir)")
    args = p.parse_args(argv)
    try:
        out = write_report(args.run_dir)
    except NotARunFolder as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(out / "report.html")
    return 0
