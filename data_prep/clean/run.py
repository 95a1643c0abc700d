"""``data_prep clean``: raw documents in, the documents worth training on out, and a report.

Two passes over the input, so that memory holds a few dozen bytes per document, never the text:

1. **signatures** (worker processes, the machine's cores): per document its identity, exact key,
   MinHash signature, language and the first quality rule it breaks (``signature``);
2. **decisions** (``clusters``, from those facts alone): language and quality removals, then
   documents that copy a held-out file (decontamination), then exact duplicates, then near
   duplicates; a duplicate cluster keeps its member with the smallest identity hash;
3. **writing**: the inputs read again in order, the kept records written whole in files of
   ``file_documents`` (each atomic), stale files of an earlier run removed, ``report.json`` last.

A re-run whose ``report.json`` has the same settings and input fingerprints does nothing.
"""
from __future__ import annotations

import glob
import io
import json
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass

import numpy as np

from ..atomic import json_bytes
from ..errors import DataPrepError
from ..reader import ReadOptions, Source, iter_source_records, resolve_inputs
from ..storage import open_store
from . import clusters
from .report import (FORMAT, REMOVED_FIELD, REPORT, VERSION, format_table, is_part, one_line, part_name,
                     read_report)
from ..settings import settings_sha256
from .settings import CleanSettings
from .signature import Signatures, analyse, worker_analyse, worker_init

log = logging.getLogger("data_prep")
CHUNK = 256                 # documents per message to a worker
SNIPPET = 240
EXAMPLES = 3
CLUSTERS = 5


@dataclass
class CleanResult:
    report: dict
    skipped: bool
    seconds: float


def _read_options(s: CleanSettings) -> ReadOptions:
    return ReadOptions(text_field=s.text_field, txt_mode=s.txt_mode, hf_split=s.hf_split)


def _iter_records(sources: list[Source], opts: ReadOptions):
    for source in sources:
        yield from iter_source_records(source, opts)


def _chunks(records, size: int):
    chunk = []
    for r in records:
        chunk.append(r)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _analyse_all(records, s: CleanSettings) -> Signatures:
    workers = s.workers or (os.cpu_count() or 1)
    num_perm = s.near.bands * s.near.rows
    if workers == 1:
        worker_init(s)
        return Signatures.concat([worker_analyse(chunk) for chunk in _chunks(records, CHUNK)], num_perm)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=worker_init, initargs=(s,)) as pool:
        return Signatures.concat(list(pool.imap(worker_analyse, _chunks(records, CHUNK), chunksize=2)), num_perm)


def _resolve_heldout(patterns: list[str]) -> list[Source]:
    for p in patterns:
        if not glob.has_magic(p) and not os.path.exists(os.path.expanduser(p)) and "://" not in p:
            raise DataPrepError(f"--decontaminate-against {p!r}: no such file")
    try:
        return resolve_inputs(patterns) if patterns else []
    except DataPrepError as exc:
        raise DataPrepError(f"--decontaminate-against: {exc}") from None


def _identity(s: CleanSettings, sources: list[Source], held: list[Source]) -> dict:
    return {**s.result_settings(), "sources": [src.to_dict() for src in sources],
            "decontaminated_against": [src.to_dict() for src in held]}


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[:SNIPPET] + "..."


def _encode_part(records: list[dict], output_format: str) -> bytes:
    if output_format == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def run_clean(s: CleanSettings) -> CleanResult:
    """Clean ``s.inputs`` into ``s.out``. Raises ``DataPrepError`` on bad input or settings, before
    anything is written."""
    t0 = time.perf_counter()
    s = s.checked()
    sources = resolve_inputs(s.inputs)
    held = _resolve_heldout(s.decontaminate_against)
    store = open_store(s.out)
    store.check(write=True)
    identity = _identity(s, sources, held)
    digest = settings_sha256(identity)
    previous = read_report(s.out)
    if previous is not None and previous.get("settings_sha256") == digest:
        log.info("clean: %s exists with the same settings and inputs, nothing to do", store.url(REPORT))
        return CleanResult(previous, skipped=True, seconds=time.perf_counter() - t0)

    opts = _read_options(s)
    # Pass 1: what each document is (in worker processes).
    sig = _analyse_all(_iter_records(sources, opts), s)
    n = len(sig)
    if not n:
        names = ", ".join(src.path for src in sources[:5])
        raise DataPrepError(f"empty input: no documents in {names}")
    removed_by, keys, exact, words = sig.removed_by, sig.keys, sig.exact, sig.words
    signatures = sig.signatures if s.near.enabled else None
    num_perm = s.near.bands * s.near.rows
    log.info("clean: %d documents analysed in %.1f s", n, time.perf_counter() - t0)

    # Decisions, from keys and signatures alone.
    alive = removed_by == ""
    rep = np.arange(n)
    if held:
        held_sig = Signatures.of([analyse(r, s.text_field, _no_filters(s), None) for r in _iter_records(held, opts)],
                                 num_perm)
        hit = clusters.contaminated(signatures, exact, alive, held_sig.signatures, held_sig.exact, s.near.bands,
                                    s.near.rows, s.near.min_similarity)
        removed_by[hit] = "decontamination"
        alive &= ~hit
    if s.exact.enabled:
        rep, gone = clusters.exact_groups(exact, keys, alive)
        removed_by[gone] = "exact_duplicate"
        alive &= ~gone
    if s.near.enabled:
        near_rep, gone = clusters.near_clusters(signatures, keys, alive, s.near.bands, s.near.rows,
                                                 s.near.min_similarity)
        rep = near_rep[rep]             # an exact duplicate's cluster is its representative's
        removed_by[gone] = "near_duplicate"
        alive &= ~gone

    # Pass 2: write the kept records, in input order.
    dup = (removed_by == "exact_duplicate") | (removed_by == "near_duplicate")
    cluster_size = np.bincount(rep[dup], minlength=n) + 1
    biggest = [int(i) for i in np.argsort(-cluster_size * alive, kind="stable")[:CLUSTERS] if cluster_size[i] > 1 and alive[i]]
    wanted = {i: None for i in biggest}
    member_of = {}
    for i in np.flatnonzero(dup):
        r = int(rep[i])
        if r in wanted and r not in member_of:
            member_of[r] = int(i)
    removed_members = set(member_of.values())
    snippets: dict[int, tuple[str, str]] = {}
    examples: dict[str, list[dict]] = {}
    files, part, removed_files, removed_part = [], [], [], []
    id_field = "id"
    count = 0
    for i, record in enumerate(_iter_records(sources, opts)):
        count += 1
        if i >= n:
            break
        why = removed_by[i]
        text = record[s.text_field]
        if why:
            bucket = examples.setdefault(why, [])
            if len(bucket) < EXAMPLES:
                bucket.append({"id": str(record.get(id_field, f"#{i}")), "snippet": _snippet(text)})
            if s.write_removed:
                removed_part.append({**record, REMOVED_FIELD: why})
                if len(removed_part) == s.file_documents:
                    removed_files.append(_write_part(store, len(removed_files), removed_part, s.output_format, True))
                    removed_part = []
        else:
            part.append(record)
            if len(part) == s.file_documents:
                files.append(_write_part(store, len(files), part, s.output_format))
                part = []
        if i in wanted or i in removed_members:
            snippets[i] = (str(record.get(id_field, f"#{i}")), _snippet(text))
    if count != n:
        raise DataPrepError(f"the inputs changed while cleaning ({n} documents in the first pass, "
                            f"{count} in the second)")
    if part or not files:
        files.append(_write_part(store, len(files), part, s.output_format))
    if removed_part:
        removed_files.append(_write_part(store, len(removed_files), removed_part, s.output_format, True))
    names = {f["name"] for f in files + removed_files}
    stale = [n for n in store.list() if is_part(n) and n not in names]
    if stale:
        store.delete(stale)

    removed: dict[str, dict] = {}
    for why in sorted(set(removed_by.tolist()) - {""}):
        mask = removed_by == why
        removed[why] = {"documents": int(mask.sum()), "words": int(words[mask].sum())}
    report = {
        "format": FORMAT, "version": VERSION, "settings": s.result_settings(), "settings_sha256": digest,
        "sources": identity["sources"], "decontaminated_against": identity["decontaminated_against"],
        "text_field": s.text_field, "files": files, "removed_files": removed_files,
        "totals": {"in": {"documents": n, "words": int(words.sum())},
                   "out": {"documents": int(alive.sum()), "words": int(words[alive].sum())}},
        "removed": removed,
        "clusters": [{"size": int(cluster_size[i]), "kept_id": snippets[i][0], "kept_snippet": snippets[i][1],
                      "removed_id": snippets.get(member_of.get(i), ("", ""))[0],
                      "removed_snippet": snippets.get(member_of.get(i), ("", ""))[1]} for i in biggest],
        "examples": examples,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    store.write_bytes(REPORT, json_bytes(report))     # last: a folder without it is unfinished
    return CleanResult(report, skipped=False, seconds=time.perf_counter() - t0)


def _no_filters(s: CleanSettings) -> CleanSettings:
    """Held-out documents are compared, never filtered."""
    import dataclasses

    return dataclasses.replace(s, quality=dataclasses.replace(s.quality, enabled=False))


def _write_part(store, index: int, records: list[dict], output_format: str, removed: bool = False) -> dict:
    import hashlib

    name = part_name(index, output_format, removed)
    data = _encode_part(records, output_format)
    store.write_bytes(name, data)
    return {"name": name, "documents": len(records), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def print_summary(result: CleanResult, out: str) -> None:
    """The table, where the output is, then the one-line summary (last: ``tail -n 1`` shows it)."""
    print(format_table(result.report))
    print(f"{out}: {result.report['totals']['out']['documents']:,} documents in {len(result.report['files'])} "
          f"file(s), report in {REPORT} ({result.seconds:.1f} s{', unchanged since the last run' if result.skipped else ''})")
    print(one_line(result.report))
