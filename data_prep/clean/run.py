"""``data_prep clean``: raw documents in, the documents worth training on out, and a report; in one
process or as three stages of Slurm jobs, with the same files either way.

The unit of work is the **group** of ``data_prep.groups`` (per input file, a run of documents that
closes at ``group_chars`` characters): which documents form a group depends only on the input, so
every file this command writes is named after a group or is global, never after a task. ``K`` array
tasks share the groups out as ``shard``'s tasks do.

1. ``--stage signatures`` (task I of K, the machine's cores in worker processes): per document of
   each owned group its identity, exact key, MinHash signature, word count and the language or
   quality rule that removes it (``signature``), saved as ``sig-<group>.npz``; then the task's
   marker ``sig-kK-tI.json`` listing its groups.
2. ``--stage clusters`` (one job): refuses, naming them, when a task's marker is missing; reads every
   group's signatures in group order and decides (``clusters``): decontamination against the held-out
   files, exact duplicates, near duplicates; a cluster keeps the member with the smallest identity
   hash. Writes ``decisions.npz`` (the step that removed each document) and ``decisions.json``.
3. ``--stage filter`` (task I of K): per owned group, the kept records written whole as
   ``part-<group>.jsonl`` (or ``.parquet``) and a marker ``filter-<group>.json``; the task that
   finds every group's marker present writes ``report.json`` (the same bytes whoever writes it),
   removes part files no group wrote, and stale work folders.

Work files live in ``.clean/<settings hash>/`` beside the output, each written whole (atomic), so a
killed task re-run skips finished groups and writes the same bytes. Without ``--stage`` the three run
in one process (K = 1). A finished folder whose ``report.json`` has the same settings hash is left
alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.common.atomic import json_bytes
from data_prep.common.storage import StorageError, Store, open_store

from ..errors import DataPrepError
from ..groups import GroupKey, ReadCount, iter_owned_documents
from ..reader import (
    ReadOptions,
    Source,
    encoding_problem,
    iter_source_records,
    resolve_inputs,
    resolve_partition,
)
from ..settings import settings_sha256
from . import clusters
from .report import FORMAT, REMOVED_FIELD, REPORT, VERSION, format_table, is_part, one_line, part_name, read_report
from .settings import CleanSettings
from .signature import Signatures, analyse, worker_analyse, worker_init
from .sorted_keys import KEY_ARRAYS, KeyFiles, band_candidates, clusters_of, exact_duplicates, group_keys, key_file

log = logging.getLogger("data_prep")
CHUNK = 256  # documents per message to a worker
SNIPPET = 240
EXAMPLES = 3
CLUSTERS = 5
STAGES = ("signatures", "clusters", "filter")
WORK = ".clean"


@dataclass
class CleanResult:
    report: dict | None  # None until the last filter task of a staged run finishes
    skipped: bool
    seconds: float


@dataclass
class _Job:
    """What every stage derives from the settings: inputs, identity, where its files go."""

    s: CleanSettings
    sources: list[Source]
    held: list[Source]
    partition: str
    store: Store
    identity: dict
    digest: str

    @property
    def work(self) -> str:
        return f"{WORK}/{self.digest[:16]}/"

    @property
    def opts(self) -> ReadOptions:
        return ReadOptions(text_field=self.s.text_field, txt_mode=self.s.txt_mode, hf_split=self.s.hf_split)

    def owned(self, num_tasks: int, task: int, count: ReadCount | None = None):
        return iter_owned_documents(
            self.sources, self.partition, num_tasks, task, self.opts, self.s.group_chars, count, records=True
        )


def input_problems(inputs: list[str], heldout: list[str], encoding: bool = True) -> list[str]:
    """Every problem of the inputs and the held-out files, each named, before anything is written: a
    pattern that matches nothing, a file that is not there, and (``encoding``: the one-process run; a
    Slurm task reads only its own files) text that is not UTF-8 in its first MiB."""
    problems = []
    for flag, patterns in (("--input", inputs), ("--decontaminate-against", heldout)):
        for pattern in patterns:
            missing = _missing_heldout(pattern) if flag != "--input" else None
            if missing:
                problems.append(missing)
                continue
            try:
                sources = resolve_inputs([pattern])
            except (DataPrepError, StorageError) as exc:
                problems.append(str(exc) if flag == "--input" else f"{flag}: {exc}")
                continue
            if encoding:
                problems += [p for p in map(encoding_problem, sources) if p]
    return problems


def _missing_heldout(pattern: str) -> str | None:
    if not glob.has_magic(pattern) and "://" not in pattern and not os.path.exists(os.path.expanduser(pattern)):
        return f"--decontaminate-against {pattern!r}: no such file"
    return None


def _resolve_heldout(patterns: list[str]) -> list[Source]:
    for p in patterns:
        if missing := _missing_heldout(p):
            raise DataPrepError(missing)
    try:
        return resolve_inputs(patterns) if patterns else []
    except (DataPrepError, StorageError) as exc:
        raise DataPrepError(f"--decontaminate-against: {exc}") from None


def _job(s: CleanSettings, num_tasks: int) -> _Job:
    s = s.checked()
    sources = resolve_inputs(s.inputs)
    held = _resolve_heldout(s.decontaminate_against)
    partition = resolve_partition(s.partition, len(sources), num_tasks)
    store = open_store(s.out)
    store.check(write=True)
    identity = {
        **s.result_settings(),
        "sources": [src.to_dict() for src in sources],
        "decontaminated_against": [src.to_dict() for src in held],
    }
    return _Job(s, sources, held, partition, store, identity, settings_sha256(identity))


def _finished(job: _Job) -> dict | None:
    previous = read_report(job.s.out)
    return previous if previous is not None and previous.get("settings_sha256") == job.digest else None


# ----------------------------------------------------------------------------------------------
# Stage 1: signatures


def _sig_name(key: GroupKey) -> str:
    return f"sig-{key.tag}.npz"


def _task_marker(num_tasks: int, task: int) -> str:
    return f"sig-k{num_tasks:05d}-t{task:05d}.json"


def _save_npz(store: Store, name: str, **arrays) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    store.write_bytes(name, buf.getvalue())


def _load_npz(store: Store, name: str, only: tuple[str, ...] | None = None) -> dict:
    """The arrays of a work file (``only`` those named: a local file's others are never read)."""
    source = store.local_dir / name if store.local_dir is not None else io.BytesIO(store.read_bytes(name))
    with np.load(source, allow_pickle=False) as data:
        return {k: data[k] for k in data.files if only is None or k in only}


def _chunks(owned, done: set[str], groups: dict):
    """(group, records) chunks of the groups not done yet, never spanning two groups; counts every
    group's documents in ``groups`` (done ones included)."""
    key, chunk = None, []
    for k, record in owned:
        groups[k] = groups.get(k, 0) + 1
        if k != key or len(chunk) == CHUNK:
            if chunk:
                yield key, chunk
            key, chunk = k, []
        if _sig_name(k) not in done:
            chunk.append(record)
    if chunk:
        yield key, chunk


def _analysed(chunks, s: CleanSettings):
    """(group, Signatures) per chunk, in order, computed by ``workers`` processes (1: in this one)."""
    workers = s.workers or (os.cpu_count() or 1)
    if workers == 1:
        worker_init(s)
        for key, chunk in chunks:
            yield key, worker_analyse(chunk)
        return
    ctx = multiprocessing.get_context("spawn")
    pending = []
    with ctx.Pool(workers, initializer=worker_init, initargs=(s,)) as pool:
        for key, chunk in chunks:
            pending.append((key, pool.apply_async(worker_analyse, (chunk,))))
            while len(pending) > 2 * workers:
                k, result = pending.pop(0)
                yield k, result.get()
        for k, result in pending:
            yield k, result.get()


def stage_signatures(job: _Job, num_tasks: int, task: int) -> None:
    s, store, work = job.s, job.store, job.work
    num_perm = s.near.bands * s.near.rows
    done = {n.removeprefix(work) for n in store.list(work.rstrip("/"))}
    groups: dict[GroupKey, int] = {}
    count = ReadCount()
    parts: list[Signatures] = []
    current = None

    def flush():
        if current is not None and parts:
            sig = Signatures.concat(parts, num_perm)
            alive = sig.removed_by == ""
            for name, data in group_keys(
                sig.exact, sig.keys, sig.signatures if s.near.enabled else None, alive, s.near.bands, s.near.rows
            ).items():
                store.write_bytes(work + key_file(current.tag, name), data)
            # last: the group counts as done once its signatures exist
            _save_npz(
                store,
                work + _sig_name(current),
                keys=sig.keys,
                exact=sig.exact,
                signatures=sig.signatures,
                words=sig.words,
                removed_by=sig.removed_by.astype(str),
            )

    for key, sig in _analysed(_chunks(job.owned(num_tasks, task, count), done, groups), s):
        if key != current:
            flush()
            current, parts = key, []
        parts.append(sig)
    flush()
    if count.documents_read == 0:
        names = ", ".join(src.path for src in job.sources[:5])
        raise DataPrepError(f"empty input: no documents in {names}")
    store.write_bytes(
        work + _task_marker(num_tasks, task),
        json_bytes(
            {
                "settings_sha256": job.digest,
                "num_tasks": num_tasks,
                "task": task,
                "groups": [[k.source, k.group, n] for k, n in sorted(groups.items())],
            }
        ),
    )


# ----------------------------------------------------------------------------------------------
# Stage 2: clusters


def _all_groups(job: _Job, num_tasks: int) -> list[tuple[GroupKey, int]]:
    store, work = job.store, job.work
    missing, groups = [], {}
    for task in range(num_tasks):
        text = store.read_text(work + _task_marker(num_tasks, task))
        if text is None:
            missing.append(task)
            continue
        for source, group, n in json.loads(text)["groups"]:
            groups[GroupKey(source, group)] = n
    if missing:
        shown = ",".join(map(str, missing))
        raise DataPrepError(
            f"{store.url(work)}: the signatures of task(s) {shown} of {num_tasks} are missing "
            f"(not run, failed or killed): re-run them (submit_clean.sh --only {shown}), then "
            "the clusters stage"
        )
    return sorted(groups.items())


def _group_sig(job: _Job, key: GroupKey, *only: str) -> Signatures:
    """A group's facts; with ``only``, just those arrays (the others empty)."""
    d = _load_npz(job.store, job.work + _sig_name(key), only or None)
    empty = np.zeros(0)
    return Signatures(
        keys=d.get("keys", empty),
        exact=d.get("exact", empty),
        signatures=d.get("signatures", empty),
        words=d.get("words", empty),
        removed_by=d.get("removed_by", empty).astype(object),
    )


@contextlib.contextmanager
def _local_work(job: _Job):
    """A local folder holding the work files: the output folder's own, or a download of a bucket's
    (disk, not memory: the key files are mapped, not read)."""
    if job.store.local_dir is not None:
        yield job.store.local_dir / job.work
        return
    with tempfile.TemporaryDirectory(prefix="data_prep-clean-") as tmp:
        for name in job.store.list(job.work.rstrip("/")):
            if name.removeprefix(job.work).startswith("keys-"):
                job.store.download(name, Path(tmp) / name.removeprefix(job.work))
        yield Path(tmp)


@dataclass
class _Tally:
    """What was removed, by reason: documents, words and the first examples (global ids), counted
    the same way for the rules' removals and the duplicates'."""

    words_in: int = 0
    removed: dict = dataclasses.field(default_factory=dict)
    examples: dict = dataclasses.field(default_factory=dict)

    def count(self, why: str, words: int, gid: int) -> None:
        entry = self.removed.setdefault(why, {"documents": 0, "words": 0})
        entry["documents"] += 1
        entry["words"] += words
        if len(self.examples.setdefault(why, [])) < EXAMPLES:
            self.examples[why].append(gid)

    def documents(self) -> int:
        return sum(e["documents"] for e in self.removed.values())


def stage_clusters(job: _Job, num_tasks: int) -> None:
    """Decisions from the groups' signature and sorted key files, one group or one key range in memory
    at a time (``sorted_keys``): memory follows the duplicates and candidates, not the corpus."""
    groups = [(k, n) for k, n in _all_groups(job, num_tasks) if n]
    offsets = np.cumsum([0] + [n for _, n in groups])[:-1].astype(np.int64)
    n = int(sum(c for _, c in groups))
    if n == 0:
        raise DataPrepError(f"empty input: no documents in {', '.join(src.path for src in job.sources[:5])}")
    tally = _Tally()
    decont, filtered = _rules_and_contamination(job, groups, offsets, tally)
    exact_removed, exact_reps, pairs = _duplicate_candidates(job, groups, offsets, n - filtered, decont)
    near_removed, near_reps = _near_duplicates(job, groups, offsets, pairs)
    clusters_found = _biggest_clusters(exact_removed, exact_reps, near_removed, near_reps)
    names = ["", "decontamination", "exact_duplicate", "near_duplicate"]
    ids = np.concatenate([decont, exact_removed, near_removed])
    codes = np.concatenate(
        [np.full(len(decont), 1), np.full(len(exact_removed), 2), np.full(len(near_removed), 3)]
    ).astype(np.uint16)
    order = np.argsort(ids)
    ids, codes = ids[order], codes[order]
    group_of = np.searchsorted(offsets, ids, side="right") - 1
    for g in np.unique(group_of):
        words = _group_sig(job, groups[g][0], "words").words
        for gid, c in zip(ids[group_of == g].tolist(), codes[group_of == g].tolist()):
            tally.count(names[c], int(words[gid - offsets[g]]), gid)
    _save_npz(job.store, job.work + "decisions.npz", ids=ids, codes=codes)
    _write_decisions(job, groups, n, names, tally, clusters_found)


def _held_out_signatures(job: _Job) -> Signatures | None:
    s = job.s
    if not job.held:
        return None
    records = [
        analyse(r, s.text_field, _no_filters(s), None) for src in job.held for r in iter_source_records(src, job.opts)
    ]
    return Signatures.of(records, s.near.bands * s.near.rows)


def _rules_and_contamination(job: _Job, groups, offsets, tally: _Tally) -> tuple[np.ndarray, int]:
    """Per group, what language and quality removed (counted, never held), its words, and its copies
    of the held-out files: (the contaminated global ids, the documents the rules removed)."""
    s, held = job.s, _held_out_signatures(job)
    contaminated, filtered = [], 0
    for (key, _), offset in zip(groups, offsets):
        sig = _group_sig(job, key) if held is not None else _group_sig(job, key, "words", "removed_by")
        tally.words_in += int(sig.words.sum())
        for i in np.flatnonzero(sig.removed_by != ""):
            filtered += 1
            tally.count(sig.removed_by[i], int(sig.words[i]), int(offset + i))
        if held is not None:
            hit = clusters.contaminated(
                sig.signatures if s.near.enabled else None,
                sig.exact,
                sig.removed_by == "",
                held.signatures,
                held.exact,
                s.near.bands,
                s.near.rows,
                s.near.min_similarity,
            )
            contaminated.append(np.flatnonzero(hit) + offset)
    return (np.concatenate(contaminated) if contaminated else np.zeros(0, np.int64)), filtered


def _duplicate_candidates(job: _Job, groups, offsets, alive: int, decont: np.ndarray):
    """(exact duplicates removed, their representatives, near-duplicate candidate pairs) from the
    groups' sorted key files, one key range at a time."""
    s = job.s
    exact_removed = exact_reps = np.zeros(0, np.int64)
    with _local_work(job) as folder:
        maps: dict[tuple[int, str], np.ndarray] = {}

        def load(g: int) -> dict:
            out = {}
            for name in KEY_ARRAYS:
                if (g, name) not in maps:
                    path = folder / key_file(groups[g][0].tag, name)
                    maps[(g, name)] = np.load(path, mmap_mode="r") if path.is_file() else None
                if maps[(g, name)] is not None:
                    out[name] = maps[(g, name)]
            return out

        files = KeyFiles(load, offsets, maps.clear)
        ranges = max(1, -(-alive // s.slice_keys))
        if s.exact.enabled:
            exact_removed, exact_reps = exact_duplicates(files, ranges, decont)
        pairs = (
            band_candidates(files, s.near.bands, ranges, np.union1d(decont, exact_removed))
            if s.near.enabled
            else np.zeros((0, 2), np.int64)
        )
        maps.clear()
    return exact_removed, exact_reps, pairs


def _near_duplicates(job: _Job, groups, offsets, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(removed, representatives) of the near-duplicate clusters: the candidate pairs checked on
    their full signatures, then the confirmed pairs joined (the two halves that the candidates'
    work and the join split into)."""
    return _clusters_of_confirmed(job, groups, offsets, _confirmed_pairs(job, groups, offsets, pairs))


def _confirmed_pairs(job: _Job, groups, offsets, pairs: np.ndarray) -> np.ndarray:
    """The candidate pairs whose full signatures agree on ``near.min_similarity`` of their values
    (their members' signatures read group by group; copies: each group goes after)."""
    if not len(pairs) or job.s.near.min_similarity <= 0:
        return pairs
    members = np.unique(pairs)
    rows = np.empty((len(members), job.s.near.bands * job.s.near.rows), np.uint32)
    group_of = np.searchsorted(offsets, members, side="right") - 1
    for g in np.unique(group_of):
        at = np.flatnonzero(group_of == g)
        rows[at] = _group_sig(job, groups[g][0], "signatures").signatures[members[at] - offsets[g]]
    a, b = np.searchsorted(members, pairs[:, 0]), np.searchsorted(members, pairs[:, 1])
    return pairs[clusters.agreement(rows, a, b) >= job.s.near.min_similarity]


def _clusters_of_confirmed(job: _Job, groups, offsets, confirmed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of the confirmed pairs, each keeping its member with the smallest
    identity: memory follows the confirmed pairs (the duplicates), not the candidates."""
    if not len(confirmed):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    members = np.unique(confirmed)
    ident = np.empty(len(members), "S16")
    group_of = np.searchsorted(offsets, members, side="right") - 1
    for g in np.unique(group_of):
        at = np.flatnonzero(group_of == g)
        ident[at] = _group_sig(job, groups[g][0], "keys").keys[members[at] - offsets[g]]
    return clusters_of(confirmed, np.zeros((0, 0), np.uint32), ident, members, 0.0)


def _biggest_clusters(exact_removed, exact_reps, near_removed, near_reps) -> list[dict]:
    """The CLUSTERS largest clusters (an exact duplicate belongs to its representative's near
    cluster): size, the member kept, the smallest member removed."""
    final_exact = exact_reps.copy()
    if len(near_removed) and len(exact_reps):
        at = np.minimum(np.searchsorted(near_removed, exact_reps), len(near_removed) - 1)
        hit = near_removed[at] == exact_reps
        final_exact[hit] = near_reps[at[hit]]
    final = np.concatenate([final_exact, near_reps])
    dup_ids = np.concatenate([exact_removed, near_removed])
    reps, counts = np.unique(final, return_counts=True)
    top = np.lexsort((reps, -counts))[:CLUSTERS]
    return [
        {"size": int(counts[i]) + 1, "kept": int(reps[i]), "removed": int(dup_ids[final == reps[i]].min())} for i in top
    ]


def _write_decisions(job: _Job, groups, n: int, names: list[str], tally: _Tally, clusters_found: list) -> None:
    job.store.write_bytes(
        job.work + "decisions.json",
        json_bytes(
            {
                "settings_sha256": job.digest,
                "reasons": names,
                "groups": [[k.source, k.group, c] for k, c in groups],
                "totals": {
                    "in": {"documents": n, "words": tally.words_in},
                    "out": {
                        "documents": n - tally.documents(),
                        "words": tally.words_in - sum(e["words"] for e in tally.removed.values()),
                    },
                },
                "removed": dict(sorted(tally.removed.items())),
                "examples": dict(sorted(tally.examples.items())),
                "clusters": clusters_found,
            }
        ),
    )


# ----------------------------------------------------------------------------------------------
# Stage 3: filter


def _filter_marker(key: GroupKey) -> str:
    return f"filter-{key.tag}.json"


def _decisions(job: _Job) -> tuple[dict, dict[int, str]]:
    """decisions.json, and the step that removed each removed document by global id."""
    text = job.store.read_text(job.work + "decisions.json")
    if text is None:
        raise DataPrepError(f"{job.store.url(job.work)}: no decisions yet: run the clusters stage first")
    decisions = json.loads(text)
    arrays = _load_npz(job.store, job.work + "decisions.npz")
    names = decisions["reasons"]
    return decisions, {gid: names[c] for gid, c in zip(arrays["ids"].tolist(), arrays["codes"].tolist())}


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[:SNIPPET] + "..."


def _encode(records: list[dict], output_format: str) -> bytes:
    if output_format == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def _write_part(store: Store, name: str, records: list[dict], output_format: str) -> dict:
    data = _encode(records, output_format)
    store.write_bytes(name, data)
    return {"name": name, "documents": len(records), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def stage_filter(job: _Job, num_tasks: int, task: int) -> dict | None:
    """This task's groups written; returns the report when this task completed the set."""
    s, store, work = job.s, job.store, job.work
    decisions, removed_ids = _decisions(job)
    offsets, start = {}, 0
    for source, group, n in decisions["groups"]:
        offsets[GroupKey(source, group)] = start
        start += n
    wanted = {i for idxs in decisions["examples"].values() for i in idxs}
    wanted |= {c[k] for c in decisions["clusters"] for k in ("kept", "removed") if c[k] is not None}
    done = {n.removeprefix(work) for n in store.list(work.rstrip("/"))}

    key, local, kept, removed, snippets = None, 0, [], [], {}

    def close():
        if key is None or _filter_marker(key) in done:
            return
        fmt = s.output_format
        marker = {
            "file": _write_part(store, part_name(key.tag, fmt), kept, fmt) if kept else None,
            "removed_file": _write_part(store, part_name(key.tag, fmt, removed=True), removed, fmt)
            if removed
            else None,
            "snippets": snippets,
        }
        store.write_bytes(work + _filter_marker(key), json_bytes(marker))

    filtered = None
    for k, record in job.owned(num_tasks, task):
        if k != key:
            close()
            key, local, kept, removed, snippets = k, 0, [], [], {}
            if _filter_marker(key) not in done and key in offsets:  # language and quality removals
                filtered = _load_npz(store, work + _sig_name(key), only=("removed_by",))["removed_by"]
        if key not in offsets:
            raise DataPrepError(
                f"the inputs changed since the signatures stage (group {key.tag} is new): clean into a new --out"
            )
        i = offsets[key] + local
        local += 1
        if _filter_marker(key) in done:
            continue
        why = filtered[local - 1] or removed_ids.get(i, "")
        if why:
            if s.write_removed:
                removed.append({**record, REMOVED_FIELD: why})
        else:
            kept.append(record)
        if i in wanted:
            snippets[str(i)] = [str(record.get("id", f"#{i}")), _snippet(record[s.text_field])]
    close()
    return _finish(job, decisions)


def _finish(job: _Job, decisions: dict) -> dict | None:
    """``report.json`` once every group has its filter marker (by whichever task sees that first: the
    same bytes from any of them); part files and work folders of earlier runs removed."""
    store, work = job.store, job.work
    listing = store.list()
    keys = [GroupKey(src, grp) for src, grp, _ in decisions["groups"]]
    if any(work + _filter_marker(k) not in listing for k in keys):
        return None
    files, removed_files, snippets = [], [], {}
    for k in keys:
        marker = json.loads(store.read_text(work + _filter_marker(k)))
        files += [marker["file"]] if marker["file"] else []
        removed_files += [marker["removed_file"]] if marker["removed_file"] else []
        snippets.update({int(i): v for i, v in marker["snippets"].items()})
    blank = ["", ""]
    report = {
        "format": FORMAT,
        "version": VERSION,
        "settings": job.s.result_settings(),
        "settings_sha256": job.digest,
        "sources": job.identity["sources"],
        "decontaminated_against": job.identity["decontaminated_against"],
        "text_field": job.s.text_field,
        "files": files,
        "removed_files": removed_files,
        "totals": decisions["totals"],
        "removed": decisions["removed"],
        "clusters": [
            {
                "size": c["size"],
                "kept_id": snippets[c["kept"]][0],
                "kept_snippet": snippets[c["kept"]][1],
                "removed_id": snippets.get(c["removed"], blank)[0],
                "removed_snippet": snippets.get(c["removed"], blank)[1],
            }
            for c in decisions["clusters"]
        ],
        "examples": {
            why: [{"id": snippets[i][0], "snippet": snippets[i][1]} for i in idxs]
            for why, idxs in sorted(decisions["examples"].items())
        },
    }
    names = {f["name"] for f in files + removed_files}
    stale = [n for n in listing if is_part(n) and n not in names]
    stale += [n for n in listing if n.startswith(WORK + "/") and not n.startswith(work)]
    # what killed tasks left half-written (every group is done: nothing writes these names any more)
    stale += [n for n in listing if ".tmp" in n and (n.startswith(work) or is_part(n.split(".tmp")[0]))]
    if stale:
        store.delete(stale)
    store.write_bytes(REPORT, json_bytes(report))  # last: a folder without it is unfinished
    return report


# ----------------------------------------------------------------------------------------------


def _no_filters(s: CleanSettings) -> CleanSettings:
    """Held-out documents are compared, never filtered."""
    return dataclasses.replace(s, quality=dataclasses.replace(s.quality, enabled=False))


def run_clean(s: CleanSettings, stage: str | None = None, num_tasks: int = 1, task: int = 0) -> CleanResult:
    """One stage of task ``task`` of ``num_tasks``, or (``stage`` None) all three in this process.
    Raises ``DataPrepError`` on bad input or settings before anything is written."""
    t0 = time.perf_counter()
    new_folder = stage is None and "://" not in s.out and not os.path.exists(os.path.expanduser(s.out))
    job = _job(s, num_tasks)
    try:
        return _run_stages(job, stage, num_tasks, task, t0)
    except DataPrepError:
        # Bad input found while reading (an empty file, damage past the first MiB): a folder this run
        # made holds nothing of use, so nothing is left behind.
        if new_folder:
            shutil.rmtree(os.path.expanduser(s.out), ignore_errors=True)
        raise


def _run_stages(job: _Job, stage: str | None, num_tasks: int, task: int, t0: float) -> CleanResult:
    previous = _finished(job)
    if previous is not None:
        log.info("clean: %s exists with the same settings and inputs, nothing to do", job.store.url(REPORT))
        return CleanResult(previous, skipped=True, seconds=time.perf_counter() - t0)
    report = None
    if stage in (None, "signatures"):
        stage_signatures(job, num_tasks, task)
        log.info("clean: task %d/%d: signatures in %.1f s", task, num_tasks, time.perf_counter() - t0)
    if stage in (None, "clusters"):
        stage_clusters(job, num_tasks)
        log.info("clean: clusters decided in %.1f s", time.perf_counter() - t0)
    if stage in (None, "filter"):
        report = stage_filter(job, num_tasks, task)
        if report is None:
            log.info(
                "clean: task %d/%d: filtered in %.1f s; other tasks' groups still to come",
                task,
                num_tasks,
                time.perf_counter() - t0,
            )
    return CleanResult(report, skipped=False, seconds=time.perf_counter() - t0)


def print_summary(result: CleanResult, out: str) -> None:
    """The table, where the output is, then the one-line summary (last: ``tail -n 1`` shows it)."""
    if result.report is None:
        return
    print(format_table(result.report))
    print(
        f"{out}: {result.report['totals']['out']['documents']:,} documents in {len(result.report['files'])} "
        f"file(s), report in {REPORT} ({result.seconds:.1f} s"
        f"{', unchanged since the last run' if result.skipped else ''})"
    )
    print(one_line(result.report))
