"""``data_prep clean``: raw documents in, the documents worth training on out, and a report; in one
process or as five stages of Slurm jobs, with the same files either way.

The unit of work is the **group** of ``data_prep.groups`` (per input file, a run of documents that
closes at ``group_chars`` characters): which documents form a group depends only on the input, so
every file this command writes is named after a group, a task of a stage or is global, and its bytes
never depend on the number of tasks. ``K`` array tasks share the groups out as ``shard``'s tasks do.

1. ``--stage signatures`` (task I of K, the machine's cores in worker processes): per document of
   each owned group its identity, exact key, MinHash signature, word count, the language or quality
   rule that removes it and whether it copies a held-out document (``signature``), saved as
   ``sig-<group>.npz`` beside the group's sorted key files (``sorted_keys``); then the task's marker
   ``sig-kK-tI.json`` listing its groups.
2. ``--stage exact`` (task I of K): the exact duplicates of the task's exact-key ranges, from every
   group's sorted keys: ``exact-kK-tI.npz`` (removed ids and their representatives).
3. ``--stage pairs`` (task I of K): the near-duplicate candidates of the task's (band, hash range)
   units, less every exact duplicate, checked on their full signatures: ``pairs-kK-tI.npz``, the
   confirmed pairs only.
4. ``--stage clusters`` (one job, the join): refuses, naming them, while a task of a stage before it
   is missing; joins the confirmed pairs into clusters (each keeps the member with the smallest
   identity hash) and writes ``decisions.npz`` (the step that removed each document) and
   ``decisions.json``.
5. ``--stage filter`` (task I of K): per owned group, the kept records written whole as
   ``part-<group>.jsonl`` (or ``.parquet``) and a marker ``filter-<group>.json``; the task that
   finds every group's marker present writes ``report.json`` (the same bytes whoever writes it),
   removes part files no group wrote, and stale work folders.

Work files live in ``.clean/<settings hash>/`` beside the output, each written whole (atomic), so a
killed task re-run skips finished groups (or its finished result) and writes the same bytes. Without
``--stage`` the five run in one process (K = 1). A finished folder whose ``report.json`` has the same
settings hash is left alone.
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
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.common.atomic import json_bytes
from data_prep.common.shards import sha256_file
from data_prep.common.storage import StorageError, Store, open_store

from ..cleaned_folder import (
    FORMAT,
    REMOVED_FIELD,
    REPORT,
    VERSION,
    format_table,
    is_part,
    one_line,
    part_name,
    read_report,
)
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
from .settings import CleanSettings
from .signature import Signatures, analyse, worker_analyse, worker_init
from .sorted_keys import (
    BAND_ARRAYS,
    EXACT_ARRAYS,
    MINHASH,
    Components,
    Gone,
    KeyFiles,
    band_pairs_confirmed,
    band_units,
    clusters_of,
    exact_duplicates,
    group_keys,
    key_file,
    key_ranges,
    owned,
    range_bounds,
)

log = logging.getLogger("data_prep")
CHUNK = 256  # documents per message to a worker
SNIPPET = 240
EXAMPLES = 3
CLUSTERS = 5
STAGES = ("signatures", "exact", "pairs", "clusters", "filter")
WORK = ".clean"
IDENTITY = "identity.json"  # in a work folder: the settings (and inputs) it was made with


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
    if s.quality_model.path:
        identity["quality_model_sha256"] = sha256_file(os.path.expanduser(s.quality_model.path))
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


def _map_npz(store: Store, name: str) -> dict:
    """The arrays of a local work file, memory-mapped (``np.savez`` stores its members uncompressed:
    each is a ``.npy`` at an offset of the zip), so that a reader's memory is the pages it touches;
    a bucket's is read whole (``_load_npz``)."""
    if store.local_dir is None:
        return _load_npz(store, name)
    path, out = store.local_dir / name, {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                return _load_npz(store, name)
            f.seek(info.header_offset)
            local = f.read(30)  # the local header: its name and extra lengths can differ from the directory's
            names = int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
            f.seek(info.header_offset + 30 + names)
            fmt = np.lib.format
            read_header = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            order = "F" if fortran else "C"
            mapped = np.memmap(f, dtype, "r", f.tell(), shape, order) if np.prod(shape) else np.zeros(shape, dtype)
            out[info.filename[:-4]] = mapped
    return out


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
    # Not multiprocessing.Pool: it replaces a worker that dies (its initializer failing, a crash in
    # a model's native code) and waits for ever for the task it held. Here the run ends, saying so.
    pending = []
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=worker_init, initargs=(s,)) as pool:
        try:
            for key, chunk in chunks:
                pending.append((key, pool.submit(worker_analyse, chunk)))
                while len(pending) > 2 * workers:
                    k, result = pending.pop(0)
                    yield k, result.result()
            for k, result in pending:
                yield k, result.result()
        except BrokenProcessPool as exc:
            raise DataPrepError(f"a cleaning worker died ({exc}); its own error, if it printed one, is above") from None


def _held_out_signatures(job: _Job) -> Signatures | None:
    s = job.s
    if not job.held:
        return None
    records = [
        analyse(r, s.text_field, _no_filters(s), None) for src in job.held for r in iter_source_records(src, job.opts)
    ]
    return Signatures.of(records, s.near.bands * s.near.rows)


def _contaminated(job: _Job, sig: Signatures, held: Signatures | None) -> np.ndarray:
    """Mask of the documents (not removed by a rule) that copy a held-out one: decided per document,
    here, so that no later stage sees them."""
    s = job.s
    if held is None:
        return np.zeros(len(sig), bool)
    return clusters.contaminated(
        sig.signatures if s.near.enabled else None,
        sig.exact,
        sig.removed_by == "",
        held.signatures,
        held.exact,
        s.near.bands,
        s.near.rows,
        s.near.min_similarity,
    )


def stage_signatures(job: _Job, num_tasks: int, task: int) -> None:
    s, store, work = job.s, job.store, job.work
    num_perm = s.near.bands * s.near.rows
    done = {n.removeprefix(work) for n in store.list(work.rstrip("/"))}
    groups: dict[GroupKey, int] = {}
    count = ReadCount()
    parts: list[Signatures] = []
    current = None
    held = _held_out_signatures(job)

    def flush():
        if current is not None and parts:
            sig = Signatures.concat(parts, num_perm)
            contaminated = _contaminated(job, sig, held)
            alive = (sig.removed_by == "") & ~contaminated
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
                words=sig.words,
                removed_by=sig.removed_by.astype(str),
                contaminated=contaminated,
                **({"quality_scores": sig.quality_scores} if s.quality_model.path else {}),
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
    if IDENTITY not in done:  # what a later stage run with other settings is told differs
        store.write_bytes(work + IDENTITY, json_bytes(job.identity))
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
# Stages 2-4: exact duplicates and near-duplicate pairs (array tasks, by key range), clusters (the join)


def _missing(job: _Job, what: str, tasks: list[int], num_tasks: int, resubmit: str) -> DataPrepError:
    shown = ",".join(map(str, tasks))
    other = _other_settings(job)
    if other:
        return DataPrepError(other)
    return DataPrepError(
        f"{job.store.url(job.work)}: the {what} of task(s) {shown} of {num_tasks} are missing "
        f"(not run, failed or killed): re-run them (submit_clean.sh {resubmit}--only {shown}: the later "
        "stages follow)"
    )


def _other_settings(job: _Job) -> str | None:
    """When no task of this job's settings has run but tasks of other settings have (a stage run with
    another flag than the signatures stage before it): which settings differ, by name."""
    store = job.store
    if store.list(job.work.rstrip("/")):
        return None
    for name in sorted(store.list(WORK)):
        if not name.endswith("/" + IDENTITY) or name == job.work + IDENTITY:
            continue
        try:
            theirs = _flat(json.loads(store.read_text(name) or "{}"))
        except ValueError:
            continue
        ours = _flat(job.identity)
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            shown = "; ".join(
                f"{k}: {theirs.get(k, '(unset)')!r} there, {ours.get(k, '(unset)')!r} here" for k in differ[:6]
            )
            return (
                f"{store.url(job.work)}: no task has run with these settings, but the earlier stages in "
                f"{store.url(name.rsplit('/', 1)[0])} ran with other ones ({shown}"
                f"{f' and {len(differ) - 6} more' if len(differ) > 6 else ''}): give every stage the same "
                "settings, or run the signatures stage again with these"
            )
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _all_groups(job: _Job, num_tasks: int) -> list[tuple[GroupKey, int]]:
    """Every group with its document count (empty groups left out), from the signatures tasks'
    markers; refuses, naming them, while a task's is missing."""
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
        raise _missing(job, "signatures", missing, num_tasks, "")
    return sorted((k, n) for k, n in groups.items() if n)


def _corpus(job: _Job, num_tasks: int) -> tuple[list[tuple[GroupKey, int]], np.ndarray, int]:
    """(groups, each group's first global id, documents in all)."""
    groups = _all_groups(job, num_tasks)
    offsets = np.cumsum([0] + [n for _, n in groups])[:-1].astype(np.int64)
    n = int(sum(c for _, c in groups))
    if n == 0:
        raise DataPrepError(f"empty input: no documents in {', '.join(src.path for src in job.sources[:5])}")
    return groups, offsets, n


def _result_name(stage: str, num_tasks: int, task: int) -> str:
    return f"{stage}-k{num_tasks:05d}-t{task:05d}.npz"


def _result_names(job: _Job, stage: str, num_tasks: int) -> list[str]:
    """Every task's result file of ``stage`` (exact, pairs); refuses, naming them, while some are missing."""
    listing = set(job.store.list(job.work.rstrip("/")))
    names = [job.work + _result_name(stage, num_tasks, task) for task in range(num_tasks)]
    missing = [task for task, name in enumerate(names) if name not in listing]
    if missing:
        what = {"exact": "exact duplicates", "pairs": "near-duplicate pairs"}[stage]
        raise _missing(job, what, missing, num_tasks, f"--from {stage} ")
    return names


def _exact_removed(job: _Job, num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(removed, representatives) of every exact task, by removed id."""
    parts = [_load_npz(job.store, name) for name in _result_names(job, "exact", num_tasks)]
    removed = np.concatenate([np.zeros(0, np.int64)] + [p["removed"] for p in parts])
    reps = np.concatenate([np.zeros(0, np.int64)] + [p["reps"] for p in parts])
    order = np.argsort(removed)
    return removed[order], reps[order]


def _done(job: _Job, name: str) -> bool:
    """A task's result exists: it was written whole, from every signatures task's groups, so a re-run
    of the task has nothing to do."""
    return job.work + name in set(job.store.list(job.work.rstrip("/")))


def stage_exact(job: _Job, num_tasks: int, task: int) -> None:
    """Exact duplicates of this task's exact-key ranges (every document's key of a range from every
    group: memory is one range)."""
    groups, offsets, n = _corpus(job, num_tasks)
    name = _result_name("exact", num_tasks, task)
    if _done(job, name):
        return
    removed = reps = np.zeros(0, np.int64)
    if job.s.exact.enabled:
        bounds = owned(range_bounds(key_ranges(n, job.s.slice_keys)), num_tasks, task)
        with _key_files(job, groups, offsets, EXACT_ARRAYS) as (files, _):
            removed, reps = exact_duplicates(files, bounds)
    _save_npz(job.store, job.work + name, removed=removed, reps=reps)


def stage_pairs(job: _Job, num_tasks: int, task: int) -> None:
    """Near-duplicate candidates of this task's (band, band-hash range) units, less the exact
    duplicates, checked on their full signatures: only the confirmed pairs are written."""
    s = job.s
    groups, offsets, n = _corpus(job, num_tasks)
    name = _result_name("pairs", num_tasks, task)
    if _done(job, name):
        return
    gone = Gone(n)
    for exact in _result_names(job, "exact", num_tasks):  # one file at a time: the bits, never the ids
        gone.add(_load_npz(job.store, exact, ("removed",))["removed"])
    confirmed = np.zeros((0, 2), np.int64)
    if s.near.enabled:
        units = owned(band_units(s.near.bands, key_ranges(n, s.slice_keys)), num_tasks, task)
        with _key_files(job, groups, offsets, (*BAND_ARRAYS, MINHASH)) as (files, minhash):
            confirmed = band_pairs_confirmed(
                files, units, gone, lambda pairs: _confirmed_pairs(job, offsets, minhash, pairs)
            )
    _save_npz(job.store, job.work + name, pairs=confirmed)


def _group_sig(job: _Job, key: GroupKey, *only: str) -> Signatures:
    """A group's facts; with ``only``, just those arrays (the others empty)."""
    d = _load_npz(job.store, job.work + _sig_name(key), only or None)
    empty = np.zeros(0)
    return Signatures(
        keys=d.get("keys", empty),
        exact=d.get("exact", empty),
        signatures=empty,  # in the mapped key files (MINHASH)
        words=d.get("words", empty),
        removed_by=d.get("removed_by", empty).astype(object),
        quality_scores=d.get("quality_scores", empty),
    )


@contextlib.contextmanager
def _local_work(job: _Job, arrays: tuple[str, ...]):
    """A local folder holding the key files of ``arrays``: the output folder's own, or a download of
    a bucket's (disk, not memory: the key files are mapped, not read)."""
    if job.store.local_dir is not None:
        yield job.store.local_dir / job.work
        return
    with tempfile.TemporaryDirectory(prefix="data_prep-clean-") as tmp:
        for name in job.store.list(job.work.rstrip("/")):
            local = name.removeprefix(job.work)
            if local.startswith("keys-") and local.split(".")[-2] in arrays:
                job.store.download(name, Path(tmp) / local)
        yield Path(tmp)


@contextlib.contextmanager
def _key_files(job: _Job, groups, offsets, arrays: tuple[str, ...]):
    """(every group's sorted key ``arrays``, mapped, as ``KeyFiles``; a function of a group index
    that maps its full signatures), released at the end."""
    with _local_work(job, arrays) as folder:
        maps: dict[tuple[int, str], np.ndarray | None] = {}

        def load(g: int, names=arrays) -> dict:
            out = {}
            for name in names:
                if (g, name) not in maps:
                    path = folder / key_file(groups[g][0].tag, name)
                    maps[(g, name)] = np.load(path, mmap_mode="r") if path.is_file() else None
                if maps[(g, name)] is not None:
                    out[name] = maps[(g, name)]
            return out

        try:
            yield KeyFiles(load, offsets, maps.clear), lambda g: load(g, (MINHASH,))[MINHASH]
        finally:
            maps.clear()


@dataclass
class _Tally:
    """What was removed, by reason: documents, words and the first examples (global ids), counted
    the same way for the rules' removals and the duplicates'."""

    words_in: int = 0
    removed: dict = dataclasses.field(default_factory=dict)
    examples: dict = dataclasses.field(default_factory=dict)
    scores: dict = dataclasses.field(default_factory=dict)  # the quality model's score of each example

    def count(self, why: np.ndarray, words: np.ndarray, gids: np.ndarray, scores: np.ndarray | None = None) -> None:
        """Documents ``gids`` (ascending), removed for ``why`` (a reason each), of ``words`` words each;
        the first EXAMPLES of a reason are its examples, with their scores where finite."""
        for reason in sorted(set(why.tolist())):
            at = np.flatnonzero(why == reason)
            entry = self.removed.setdefault(reason, {"documents": 0, "words": 0})
            entry["documents"] += len(at)
            entry["words"] += int(words[at].sum())
            examples = self.examples.setdefault(reason, [])
            for i in at[: EXAMPLES - len(examples)].tolist():
                examples.append(int(gids[i]))
                if scores is not None and scores[i] == scores[i]:
                    self.scores[str(int(gids[i]))] = round(float(scores[i]), 4)

    def documents(self) -> int:
        return sum(e["documents"] for e in self.removed.values())


def stage_clusters(job: _Job, num_tasks: int) -> None:
    """The join: the removals of every stage before it (the rules' and decontamination's per group,
    the exact and pairs tasks' files) into the decisions; memory is 4 bytes a document and what the
    duplicates need, not the candidates or the confirmed pairs (read one task's file at a time)."""
    groups, offsets, n = _corpus(job, num_tasks)
    tally = _Tally()
    decont = _rules_and_contamination(job, groups, offsets, tally)
    exact_removed, exact_reps = _exact_removed(job, num_tasks)
    joined = Components(n)
    for name in _result_names(job, "pairs", num_tasks):  # one task's confirmed pairs at a time
        joined.add(_load_npz(job.store, name, ("pairs",))["pairs"])
    near_removed, near_reps = _near_clusters(job, groups, offsets, joined.labels())
    del joined  # here and below: what a document or a removal needs is freed once used
    clusters_found = _biggest_clusters(exact_removed, exact_reps, near_removed, near_reps)
    del exact_reps, near_reps
    gone = np.sort(np.concatenate([decont, exact_removed, near_removed]))
    model_removed, model_report = _quality_model_cut(job, groups, offsets, gone)
    del gone
    names = ["", "decontamination", "exact_duplicate", "near_duplicate"] + ["quality_model"] * bool(model_report)
    parts = [decont, exact_removed, near_removed, model_removed][: len(names) - 1]
    codes = np.concatenate([np.full(len(p), c + 1, np.uint16) for c, p in enumerate(parts)])
    ids = np.concatenate(parts)
    del parts, decont, exact_removed, near_removed, model_removed
    order = np.argsort(ids)
    ids, codes = ids[order], codes[order]
    del order
    for g, at in _by_group(offsets, ids):
        sig = _group_sig(job, groups[g][0], "words", "quality_scores")
        scores = sig.quality_scores if len(sig.quality_scores) else np.full(len(sig.words), np.nan)
        local = ids[at] - offsets[g]
        tally.count(np.array(names)[codes[at]], sig.words[local], ids[at], scores[local])
    _save_npz(job.store, job.work + "decisions.npz", ids=ids, codes=codes)
    _write_decisions(job, groups, n, names, tally, clusters_found, model_report)


QUALITY_BINS = 1 << 16  # --quality-keep-top cuts at a bin edge: a score resolution of 1.5e-5
REPORT_BINS = 20


def _quality_model_cut(job: _Job, groups, offsets, gone: np.ndarray) -> tuple[np.ndarray, dict]:
    """(the ids the quality model removes, what the report says of it): of the documents every other
    step kept (scored, not in ``gone``), those under the threshold, or under the score that keeps
    ``keep_top`` percent of them. Two passes over the groups' scores: memory is one group's."""
    m = job.s.quality_model
    if not m.path:
        return np.zeros(0, np.int64), {}

    def survivors(g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scores = _group_sig(job, groups[g][0], "quality_scores").quality_scores
        alive = ~np.isnan(scores)
        lo, hi = np.searchsorted(gone, [offsets[g], offsets[g] + len(scores)])
        alive[gone[lo:hi] - offsets[g]] = False
        bins = np.minimum((np.nan_to_num(scores) * QUALITY_BINS).astype(np.int64), QUALITY_BINS - 1)
        return alive, scores, bins

    hist = np.zeros(QUALITY_BINS, np.int64)
    for g in range(len(groups)):
        alive, _, bins = survivors(g)
        hist += np.bincount(bins[alive], minlength=QUALITY_BINS)
    scored = int(hist.sum())
    kept_from = np.concatenate([np.cumsum(hist[::-1])[::-1], [0]])  # kept_from[b]: documents in bins >= b
    cut_bin = int(np.argmax(kept_from <= int(scored * m.keep_top / 100)))
    removed = []
    for g in range(len(groups)):
        alive, scores, bins = survivors(g)
        low = bins < cut_bin if m.keep_top else scores < m.threshold
        removed.append(np.flatnonzero(alive & low) + offsets[g])
    report = {
        "label": m.label,
        "threshold": m.threshold,
        "keep_top": m.keep_top,
        "cut": round(cut_bin / QUALITY_BINS, 5) if m.keep_top else m.threshold,  # removed: scores below it
        "scored": scored,
        "histogram": np.bincount(
            np.arange(QUALITY_BINS) * REPORT_BINS // QUALITY_BINS, weights=hist, minlength=REPORT_BINS
        )
        .astype(np.int64)
        .tolist(),  # of the scored documents, by score in 20 bins of 0.05
    }
    if scored and sum(len(r) for r in removed) == scored:
        # A damaged model, one trained for another label, or a threshold above every score: loud.
        report["warning"] = (
            f"the quality model removed every one of the {scored:,} documents it scored (cut {report['cut']}, "
            f"highest score {max(b for b in range(QUALITY_BINS) if hist[b]) / QUALITY_BINS:.2f}): check the "
            f"model and quality_model.label ({m.label}), and lower the threshold or use keep_top"
        )
        log.warning("clean: %s", report["warning"])
    return np.concatenate(removed), report


def _rules_and_contamination(job: _Job, groups, offsets, tally: _Tally) -> np.ndarray:
    """Per group, what language and quality removed (counted, never held) and its words; returns
    the global ids of the copies of held-out files (marked by the signatures stage)."""
    contaminated = [np.zeros(0, np.int64)]
    for (key, _), offset in zip(groups, offsets):
        d = _load_npz(job.store, job.work + _sig_name(key), ("words", "removed_by", "contaminated"))
        words, removed_by = d["words"], d["removed_by"]
        tally.words_in += int(words.sum())
        gone = np.flatnonzero(removed_by != "")
        tally.count(removed_by[gone], words[gone], gone + offset)
        contaminated.append(np.flatnonzero(d["contaminated"]) + offset)
    return np.concatenate(contaminated)


def _by_group(offsets: np.ndarray, ids: np.ndarray):
    """(group, slice of ``ids``) for each group holding some of the sorted global ``ids``: a binary
    search per group, never a pass over the ids per group (10,000 groups at a billion documents)."""
    bounds = np.searchsorted(ids, offsets)
    ends = np.append(bounds[1:], len(ids))
    for g in np.flatnonzero(ends > bounds):
        yield int(g), slice(int(bounds[g]), int(ends[g]))


def _confirmed_pairs(job: _Job, offsets, minhash, pairs: np.ndarray) -> np.ndarray:
    """The candidate pairs whose full signatures agree on ``near.min_similarity`` of their values
    (each member's signature read from its group's mapped file: pages, not the group)."""
    if not len(pairs) or job.s.near.min_similarity <= 0:
        return pairs
    members = clusters.sorted_unique(pairs)
    rows = np.empty((len(members), job.s.near.bands * job.s.near.rows), np.uint32)
    for g, at in _by_group(offsets, members):
        rows[at] = minhash(g)[members[at] - offsets[g]]
    a, b = np.searchsorted(members, pairs[:, 0]), np.searchsorted(members, pairs[:, 1])
    return pairs[clusters.agreement(rows, a, b) >= job.s.near.min_similarity]


def _near_clusters(job: _Job, groups, offsets, label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(removed, representatives) of the components of the confirmed pairs, each keeping its member
    with the smallest identity (its key, read from its group's signatures)."""

    def ident_of(members: np.ndarray) -> np.ndarray:
        ident = np.empty(len(members), "S16")
        for g, at in _by_group(offsets, members):
            ident[at] = _group_sig(job, groups[g][0], "keys").keys[members[at] - offsets[g]]
        return ident

    return clusters_of(label, ident_of)


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


def _write_decisions(
    job: _Job, groups, n: int, names: list[str], tally: _Tally, clusters_found: list, model_report: dict
) -> None:
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
                **({"quality_model": model_report, "scores": tally.scores} if model_report else {}),
            }
        ),
    )


# ----------------------------------------------------------------------------------------------
# Stage 3: filter


def _filter_marker(key: GroupKey) -> str:
    return f"filter-{key.tag}.json"


class _Removed:
    """The step that removed each removed document, by global id: the sorted arrays of
    ``decisions.npz`` (10 bytes a removed document), read group by group (a dict of every removed
    document would cost each filter task ~100 bytes a removed document of the whole corpus)."""

    def __init__(self, ids: np.ndarray, codes: np.ndarray, names: list[str]):
        self.ids, self.codes, self.names = ids, codes, names

    def of_group(self, start: int, n: int) -> dict[int, str]:
        lo, hi = np.searchsorted(self.ids, [start, start + n])
        return {gid: self.names[c] for gid, c in zip(self.ids[lo:hi].tolist(), self.codes[lo:hi].tolist())}


def _decisions(job: _Job) -> tuple[dict, _Removed]:
    """decisions.json, and the step that removed each removed document."""
    text = job.store.read_text(job.work + "decisions.json")
    if text is None:
        raise DataPrepError(f"{job.store.url(job.work)}: no decisions yet: run the clusters stage first")
    decisions = json.loads(text)
    arrays = _map_npz(job.store, job.work + "decisions.npz")  # each task reads its groups' pages
    return decisions, _Removed(arrays["ids"], arrays["codes"], decisions["reasons"])


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
    decisions, decided = _decisions(job)
    offsets, sizes, start = {}, {}, 0
    for source, group, n in decisions["groups"]:
        offsets[GroupKey(source, group)] = start
        sizes[GroupKey(source, group)] = n
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

    filtered, group_removed = None, {}
    for k, record in job.owned(num_tasks, task):
        if k != key:
            close()
            key, local, kept, removed, snippets = k, 0, [], [], {}
            if _filter_marker(key) not in done and key in offsets:  # language and quality removals
                filtered = _load_npz(store, work + _sig_name(key), only=("removed_by",))["removed_by"]
                group_removed = decided.of_group(offsets[key], sizes[key])
        if key not in offsets:
            raise DataPrepError(
                f"the inputs changed since the signatures stage (group {key.tag} is new): clean into a new --out"
            )
        i = offsets[key] + local
        local += 1
        if _filter_marker(key) in done:
            continue
        why = filtered[local - 1] or group_removed.get(i, "")
        if why:
            if s.write_removed:
                removed.append({**record, REMOVED_FIELD: why})
        else:
            kept.append(record)
        if i in wanted:
            snippets[str(i)] = [str(record.get("id", f"#{i}")), _snippet(record[s.text_field])]
    close()
    return _finish(job, decisions)


def _example(snippet: list[str], score: float | None) -> dict:
    return {"id": snippet[0], "snippet": snippet[1], **({"score": score} if score is not None else {})}


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
            why: [_example(snippets[i], decisions.get("scores", {}).get(str(i))) for i in idxs]
            for why, idxs in sorted(decisions["examples"].items())
        },
    }
    if "quality_model" in decisions:
        report["quality_model"] = {**decisions["quality_model"], "sha256": job.identity["quality_model_sha256"]}
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
    """One stage of task ``task`` of ``num_tasks``, or (``stage`` None) all five in this process.
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
    if stage in (None, "exact"):
        stage_exact(job, num_tasks, task)
        log.info("clean: task %d/%d: exact duplicates in %.1f s", task, num_tasks, time.perf_counter() - t0)
    if stage in (None, "pairs"):
        stage_pairs(job, num_tasks, task)
        log.info("clean: task %d/%d: near-duplicate pairs in %.1f s", task, num_tasks, time.perf_counter() - t0)
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
    if warning := result.report.get("quality_model", {}).get("warning"):
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    print(
        f"{out}: {result.report['totals']['out']['documents']:,} documents in {len(result.report['files'])} "
        f"file(s), report in {REPORT} ({result.seconds:.1f} s"
        f"{', unchanged since the last run' if result.skipped else ''})"
    )
    print(one_line(result.report))
