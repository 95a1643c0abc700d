"""The one owner of a cleaned folder's layout: ``part-sSSSSS-gGGGGG.jsonl`` (or ``.parquet``) files of
kept documents, one per input group, ``report.json`` written last (a folder without it is
unfinished), with ``write_removed`` the removed records under ``removed/`` (same names, a
``removed_by`` field added), and ``.clean/`` the stages' work files (``clean.work``).

``report.json``: ``format`` ("data_prep-clean"), ``version``, ``settings`` and ``settings_sha256``,
``sources`` (inputs with size and content fingerprint), ``decontaminated_against`` (the same for the
held-out files), ``files`` (name, documents, bytes, sha256), ``totals`` (``in``/``out``: documents,
words), ``removed`` (per step or rule: documents, words), ``clusters`` (the largest duplicate
clusters: size, kept id and snippet, a removed member's snippet) and ``examples`` (a few removed
documents per step or rule).
"""

from __future__ import annotations

import json

from data_prep.common.storage import open_store

from .errors import DataPrepError

REPORT = "report.json"
FORMAT = "data_prep-clean"
VERSION = 1
STEPS = ("language", "quality", "decontamination", "exact_duplicate", "near_duplicate", "quality_model")


REMOVED_DIR = "removed/"
REMOVED_FIELD = "removed_by"


def part_name(group_tag: str, output_format: str, removed: bool = False) -> str:
    """The kept (or removed) documents of one input group (``s00003-g00012``): named after the input,
    never after the task that wrote them."""
    return f"{REMOVED_DIR if removed else ''}part-{group_tag}.{output_format}"


def is_part(name: str) -> bool:
    return name.removeprefix(REMOVED_DIR).startswith("part-") and name.endswith((".jsonl", ".parquet"))


def read_report(location: str) -> dict | None:
    """A cleaned folder's report, or None when ``location`` has no ``report.json`` of ours."""
    text = open_store(location).read_text(REPORT)
    if text is None:
        return None
    try:
        report = json.loads(text)
    except ValueError:
        return None
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        return None
    if report.get("version") != VERSION:
        raise DataPrepError(
            f"{location}/{REPORT}: cleaning report version {report.get('version')!r}, "
            f"this code reads {VERSION}; clean again"
        )
    return report


def step_totals(report: dict) -> dict[str, int]:
    """Documents removed per step (quality rules summed)."""
    out = {step: 0 for step in STEPS}
    for name, counts in report["removed"].items():
        out[name.split("/")[0]] += counts["documents"]
    return out


def manifest_summary(report: dict) -> dict:
    """What a shard manifest records of the cleaning its input had (and a training run logs as
    ``data/clean/...`` parameters)."""
    s = report["settings"]
    return {
        "settings_sha256": report["settings_sha256"],
        "documents_in": report["totals"]["in"]["documents"],
        "documents_out": report["totals"]["out"]["documents"],
        "words_in": report["totals"]["in"]["words"],
        "words_out": report["totals"]["out"]["words"],
        **{f"removed_{step}": n for step, n in step_totals(report).items()},
        "exact": s["exact"]["enabled"],
        "near": s["near"]["enabled"],
        "near_ngram": s["near"]["ngram"],
        "near_bands": s["near"]["bands"],
        "near_rows": s["near"]["rows"],
        "quality": s["quality"]["enabled"],
        "languages": ",".join(s["language"]["keep"]),
        "decontaminated_against": len(report.get("decontaminated_against", [])),
    }


def cleaning_of(paths: list[str]) -> list[dict]:
    """For the inputs of a ``shard`` run (paths or URLs): a ``manifest_summary`` (with its ``folder``)
    of each cleaned folder some input file belongs to, in order; empty when no input was cleaned."""
    out = []
    for folder in sorted({p.rsplit("/", 1)[0] for p in paths if is_part(p.rsplit("/", 1)[-1])}):
        report = read_report(folder)
        if report is not None and any(f"{folder}/{f['name']}" in paths for f in report["files"]):
            out.append({"folder": folder, **manifest_summary(report)})
    return out


def format_table(report: dict) -> str:
    t_in, t_out = report["totals"]["in"], report["totals"]["out"]
    rows = [("documents in", t_in["documents"], t_in["words"])]
    for name, counts in sorted(report["removed"].items(), key=lambda kv: (STEPS.index(kv[0].split("/")[0]), kv[0])):
        rows.append((f"  removed: {name}", counts["documents"], counts["words"]))
    rows.append(("documents out", t_out["documents"], t_out["words"]))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'documents':>10}  {'words':>12}"]
    for label, docs, words in rows:
        share = f"  {100 * docs / max(1, t_in['documents']):5.1f}%" if label.startswith("  ") else ""
        lines.append(f"{label:{width}}  {docs:>10,}  {words:>12,}{share}")
    if "quality_model" in report:
        m = report["quality_model"]
        how = f"the top {m['keep_top']:g}%: scores >= {m['cut']:.4f}" if m["keep_top"] else f"scores >= {m['cut']:g}"
        lines.append(f"quality model ({m['label']}, {m['sha256'][:12]}): {m['scored']:,} documents scored, kept {how}")
        if m.get("warning"):
            lines.append(f"WARNING: {m['warning']}")
    if report["clusters"]:
        lines.append("largest duplicate clusters:")
        for c in report["clusters"]:
            lines.append(f"  {c['size']:>5} x  kept {c['kept_id']!r}: {c['kept_snippet'][:90]!r}")
    return "\n".join(lines)


def one_line(report: dict) -> str:
    """The demo's summary: what was removed, in one line."""
    t_in, t_out = report["totals"]["in"]["documents"], report["totals"]["out"]["documents"]
    steps = step_totals(report)
    if t_in == t_out:
        return (
            f"cleaning: {t_in:,} documents in, none removed (no duplicates, other languages or low-quality pages found)"
        )
    said = ", ".join(f"{n:,} {step.replace('_', ' ')}" for step, n in steps.items() if n)
    return f"cleaning: {t_in:,} documents in, {t_out:,} kept; removed {said}"


def inspect_report(location: str, samples: int = 3) -> None:
    report = read_report(location)
    if report is None:
        raise DataPrepError(f"{location}: no {REPORT} of data_prep clean")
    print(
        f"{location}: cleaned by data_prep clean ({len(report['files'])} file(s), settings "
        f"{report['settings_sha256'][:12]})"
    )
    print(format_table(report))
    for name, examples in sorted(report["examples"].items()):
        print(f"removed by {name}:")
        for e in examples[:samples]:
            print(f"  {e['id']!r}: {e['snippet']!r}")
