"""``data_prep shard``: one array task's packing groups → tokenized, packed, shuffled shards + ``task-XXXXX.json``.

Pipeline: read documents and cut them into packing groups (main thread; ``data_prep.groups``) →
tokenize in batches (a prefetch thread running the Rust tokenizer, which releases the GIL and uses
every core; or ``workers`` processes) → route each document to train or validation → pack per group
and split (``packing.Packer``) → every ``shard_size`` sequences, shuffle them
(``packing.shard_permutation``) and write one shard in blocks of ``block_size``
(``group_writer``). A batch never spans two groups.

Groups, not tasks, decide the shards: their documents, packing, shuffle and file names depend only
on (input, tokenizer, settings), so any number of array tasks writes the same files. A task owns a
disjoint set of groups and touches only their files.

Splits: a document goes to validation iff a keyed hash of its text (key: the seed) falls below
``validation_fraction``, so the choice depends neither on the task count nor on the order.

Restarts (``group_writer``): a re-run of a killed task skips the groups it completed and resumes
the group it was in at its last finished shard. The task manifest is written last; a task whose
manifest exists with the same settings is not run again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from data_prep.common.atomic import json_bytes
from data_prep.common.manifest import FORMAT_VERSION
from data_prep.common.shards import ids_dtype
from data_prep.common.storage import Store, open_store

from .cleaned_folder import cleaning_of
from .errors import DataPrepError
from .group_writer import GroupWriter, SplitResume, files_by_group, finished_group, kept_shards, remove_group_leftovers
from .groups import GroupKey, ReadCount, iter_owned_documents, owned_bytes
from .progress import Progress
from .reader import (
    ReadOptions,
    Source,
    bundle_sources,
    bundled_files,
    resolve_inputs,
    resolve_partition,
    task_sources,
    txt_rule,
)
from .settings import SPLITS, ShardSettings, settings_sha256
from .tokenizer import Encoded, LoadedTokenizer, load_tokenizer, publish_tokenizer
from .txt_survey import log_txt_survey

log = logging.getLogger("data_prep")
TASK_MANIFEST_GLOB = "task-*.json"


def task_manifest_name(task: int) -> str:
    return f"task-{task:05d}.json"


def progress_dir_name(task: int) -> str:
    return f".progress-t{task:05d}"


def is_validation(text: str, fraction: float, seed: int) -> bool:
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


@dataclass
class TaskResult:
    task: int
    manifest: str  # the task manifest's path or URL
    skipped: bool  # the task manifest already existed with the same settings
    shards_written: int = 0
    shards_reused: int = 0  # complete, verified shards kept from a killed run
    groups: int = 0  # packing groups this task owns
    documents: dict = field(default_factory=dict)
    tokens: int = 0  # tokens tokenized in this run
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------------
# Tokenizing batches in order, overlapped with reading and writing


@dataclass
class _Batch:
    """What flows through the pipeline: a group's start (with what a killed run left), a batch of one
    split's documents, the group's end; or a group a killed run completed (``done``)."""

    kind: str  # start | docs | end | done
    group: GroupKey
    split: str = "train"
    doc_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    chars: int = 0
    first_offset: int = 0
    resume: dict[str, SplitResume] | None = None  # start: per split
    entries: list[dict] | None = None  # done: the group's shards


_worker_tokenizer: LoadedTokenizer | None = None


def _worker_init(folder: str, threads: int) -> None:
    global _worker_tokenizer
    # several processes each running a full-width Rust thread pool would oversubscribe the cores
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    _worker_tokenizer = load_tokenizer(folder)


def _worker_encode(texts: list[str]) -> Encoded:
    return _worker_tokenizer.encode(texts)


def _encode_in_order(tok: LoadedTokenizer, batches, workers: int):
    """(batch, Encoded or None) pairs in input order, with a bounded number of batches in flight."""
    if workers == 1:
        with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
            yield from _bounded(batches, lambda b: pool.submit(tok.encode, b.texts), lambda f: f.result(), 2)
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(str(tok.folder), threads)) as pool:
        yield from _bounded(
            batches, lambda b: pool.apply_async(_worker_encode, (b.texts,)), lambda r: r.get(), 2 * workers
        )


def _bounded(items, submit, result, ahead: int):
    pending: deque = deque()
    for item in items:
        pending.append((item, submit(item) if item.texts else None))
        if len(pending) > ahead:
            done, handle = pending.popleft()
            yield done, (result(handle) if handle is not None else None)
    while pending:
        done, handle = pending.popleft()
        yield done, (result(handle) if handle is not None else None)


class _Kept:
    """What a killed run of this task left in the output folder, looked up group by group."""

    def __init__(self, store: Store, progress: str, settings_hash: str):
        self.store, self.progress, self.settings_hash = store, progress, settings_hash
        self.files = files_by_group(store)

    def finished(self, key: GroupKey) -> list[dict] | None:
        entries = finished_group(self.store, self.progress, key, self.settings_hash)
        if entries is not None:
            remove_group_leftovers(self.store, self.files.get(key.tag, []), {e["name"] for e in entries})
        return entries

    def resume(self, key: GroupKey) -> dict[str, SplitResume]:
        resume = {split: kept_shards(self.store, self.progress, split, key, self.settings_hash) for split in SPLITS}
        remove_group_leftovers(
            self.store, self.files.get(key.tag, []), {e["name"] for r in resume.values() for e in r.entries}
        )
        return resume


def _group_batches(docs, s: ShardSettings, kept: _Kept, documents: dict):
    """Route each document to its split and group them into tokenizer batches that never span two groups,
    skipping what a killed run already wrote (counting every document, kept or not, in ``documents``)."""
    key, done, resume, pending, d = None, None, None, None, 0
    for group, text in docs:
        if group != key:
            if key is not None:
                yield from _close_group(key, done, pending)
            key, d = group, 0
            done = kept.finished(key)
            if done is not None:
                yield _Batch("done", key, entries=done)
            else:
                resume = kept.resume(key)
                yield _Batch("start", key, resume=resume)
            pending = {split: _Batch("docs", key, split) for split in SPLITS}
        else:
            d += 1
        split = "validation" if is_validation(text, s.validation_fraction, s.seed) else "train"
        documents[split] += 1
        if done is not None:
            continue
        r = resume[split]
        if d < r.doc:
            continue
        batch = pending[split]
        if d == r.doc and r.offset:
            batch.first_offset = r.offset  # always the batch's first document: all before it were skipped
        batch.doc_ids.append(d)
        batch.texts.append(text)
        batch.chars += len(text)
        if batch.chars >= s.batch_chars:
            yield batch
            pending[split] = _Batch("docs", key, split)
    if key is not None:
        yield from _close_group(key, done, pending)


def _close_group(key: GroupKey, done, pending: dict):
    if done is None:
        yield from (b for b in pending.values() if b.texts)
        yield _Batch("end", key)


# ----------------------------------------------------------------------------------------------
# One task


def _without_fingerprints(identity: dict) -> dict:
    """The identity as data prep computed it before inputs had content fingerprints."""
    return {
        **identity,
        "sources": [{k: v for k, v in src.items() if k != "fingerprint"} for src in identity["sources"]],
    }


def _earlier_forms(identity: dict):
    """(identity, why) as earlier versions computed it for the same shards: before content
    fingerprints; before ``--txt-mode auto`` was the default, when every .txt input is read by blank
    lines all the same (or there is none)."""
    forms = [(_without_fingerprints(identity), "written before inputs were identified by content")]
    txt = [Source(**src) for src in identity["sources"] if src["kind"] == "txt"]
    if identity.get("txt_mode") == "auto" and all(txt_rule(src, "auto") == "blocks" for src in txt):
        blocks = {**identity, "txt_mode": "blocks"}
        forms += [
            (blocks, "written when --txt-mode blocks was the default"),
            (_without_fingerprints(blocks), "written before --txt-mode auto and content fingerprints"),
        ]
    return forms


def _describe_difference(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    parts = []
    for k in keys[:5]:
        if k == "sources":
            parts.append(_sources_difference(old.get(k) or [], new.get(k) or []))
        else:
            parts.append(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now")
    return "; ".join(parts) or "unknown"


def _sources_difference(old: list, new: list) -> str:
    """Which inputs came, went or changed (size, or content where both runs recorded it)."""
    before, now = {s["path"]: s for s in old}, {s["path"]: s for s in new}
    changed = [
        p
        for p in sorted(set(before) & set(now))
        if before[p]["bytes"] != now[p]["bytes"]
        or (before[p].get("fingerprint") and before[p].get("fingerprint") != now[p].get("fingerprint"))
    ]
    said = [
        f"{label} {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}"
        for label, paths in (
            ("changed since:", changed),
            ("new:", sorted(set(now) - set(before))),
            ("gone:", sorted(set(before) - set(now))),
        )
        if paths
    ]
    return "inputs " + "; ".join(said) if said else "sources (the input files)"


def shard_order(entry: dict) -> tuple:
    """The dataset's order of shards: train before validation, then by group, then by index."""
    return SPLITS.index(entry["split"]), entry["source"], entry["group"], entry["index"]


def _write_task_manifest(
    store: Store,
    name: str,
    s: ShardSettings,
    identity: dict,
    settings_hash: str,
    tok: LoadedTokenizer,
    dtype: str,
    sources,
    entries: list[dict],
    groups: list[GroupKey],
    documents: dict,
) -> None:
    entries = sorted(entries, key=shard_order)
    totals = {
        split: {
            "shards": sum(1 for e in entries if e["split"] == split),
            "sequences": sum(e["sequences"] for e in entries if e["split"] == split),
            "tokens": sum(e["tokens"] for e in entries if e["split"] == split),
            "padding": sum(e["padding"] for e in entries if e["split"] == split),
            "documents": documents[split],
        }
        for split in SPLITS
    }
    store.write_bytes(
        name,
        json_bytes(
            {
                "format_version": FORMAT_VERSION,
                "task": s.task_index,
                "num_tasks": s.num_tasks,
                "settings_sha256": settings_hash,
                "settings": identity,
                "origin": {"inputs": list(s.inputs), "tokenizer": str(s.tokenizer)},
                "seq_len": s.seq_len,
                "block_size": s.block_size,
                "dtype": dtype,
                "tokenizer": tok.manifest_entry(),
                "sources": [src.path for src in sources],
                "groups": [list(g) for g in groups],
                "shards": entries,
                "totals": totals,
            }
        ),
    )


def _hold_task(store: Store, task: int):
    """One ``data_prep shard`` writes a task of a local ``--out`` at a time: a POSIX lock on ``lock``
    in the task's progress folder (the kernel drops it however the process ends); its descriptor. A
    second run of the task while the first writes (other settings would replace its shards) is refused,
    naming the holder; the lock goes with the task's end. A bucket has no locks: its task manifests say
    what was written."""
    if store.local_dir is None:
        return None
    path = store.local_dir / progress_dir_name(task) / "lock"  # removed with the progress at the end
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES):  # no POSIX locks on this filesystem: as before
            log.warning("task %d: cannot lock %s (%s): not guarded against a second run at once", task, path, exc)
            return None
        raise DataPrepError(
            f"{store.url()}: task {task} is being written by {holder} ({path}); wait for it to end, or use "
            "another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return fd


def run_shard(settings: ShardSettings) -> TaskResult:
    """Run one array task end to end. Raises ``DataPrepError`` on bad input or settings."""
    t0 = time.perf_counter()
    s = settings.resolved()
    task, num_tasks = s.task_index, s.num_tasks
    tok = load_tokenizer(s.tokenizer)
    sources = resolve_inputs(s.inputs)
    log_txt_survey(sources, ReadOptions(text_field=s.text_field, txt_mode=s.txt_mode), log)
    if s.validation_fraction == 0 and task == 0:
        log.warning(
            "WARNING: --validation-fraction 0: no validation split, so no held-out evaluation in training "
            "(--validation-fraction 0.01 holds 1% of the documents out)"
        )
    bundles = bundle_sources(sources, s.group_chars)
    partition = resolve_partition(s.partition, len(bundles), num_tasks)
    mine = task_sources(bundles, partition, num_tasks, task)
    store = open_store(s.out)
    store.check(write=True)  # access and bucket before any work
    lock = _hold_task(store, task)
    try:
        return _shard_task(s, tok, sources, partition, mine, store, t0)
    finally:
        store.discard_staging()  # also when the task failed or was stopped: a rerun writes them anew
        if lock is not None:
            os.close(lock)


def _shard_task(s: ShardSettings, tok: LoadedTokenizer, sources: list, partition: str, mine, store: Store, t0: float):
    """``run_shard``'s work, with the task's lock held."""
    task, num_tasks = s.task_index, s.num_tasks
    dtype = ids_dtype(tok.vocab_size)
    identity = _task_identity(s, tok, sources, partition, dtype.name)
    settings_hash = settings_sha256(identity)
    manifest_name = task_manifest_name(task)
    if _written_before(store, manifest_name, task, identity, settings_hash):
        return TaskResult(task, store.url(manifest_name), skipped=True, seconds=time.perf_counter() - t0)

    publish_tokenizer(tok, store)
    progress_prefix = progress_dir_name(task)
    documents = {split: 0 for split in SPLITS}
    read = ReadCount()
    docs = iter_owned_documents(
        sources,
        partition,
        num_tasks,
        task,
        ReadOptions(text_field=s.text_field, txt_mode=s.txt_mode, hf_split=s.hf_split),
        s.group_chars,
        read,
    )
    kept = _Kept(store, progress_prefix, settings_hash)
    total = owned_bytes(sources, partition, num_tasks, task, s.group_chars)
    progress = Progress(f"task {s.task_index}/{s.num_tasks}", s.log_every, total_bytes=total)
    batches = _group_batches(docs, s, kept, documents)
    out = _write_groups(store, s, tok, dtype, settings_hash, progress_prefix, batches, progress, read)
    _check_what_was_read(read, out.groups, mine, task, num_tasks)
    _write_task_manifest(
        store, manifest_name, s, identity, settings_hash, tok, dtype.name, mine, out.entries, out.groups, documents
    )
    store.delete_folder(progress_prefix)
    return TaskResult(
        task,
        store.url(manifest_name),
        skipped=False,
        shards_written=out.written,
        shards_reused=out.reused,
        groups=len(out.groups),
        documents=documents,
        tokens=out.tokens,
        seconds=time.perf_counter() - t0,
    )


def _task_identity(s: ShardSettings, tok: LoadedTokenizer, sources: list, partition: str, dtype: str) -> dict:
    """Everything that decides the task's shards: a re-run with the same identity has nothing to do."""
    identity = {
        **s.result_settings(),
        "partition": partition,
        "dtype": dtype,
        "tokenizer_sha256": tok.sha256,
        "sources": [src.to_dict() for src in sources],
    }
    cleaning = cleaning_of([src.path for src in sources])
    if cleaning:  # absent otherwise: earlier task manifests stay valid
        identity["cleaning"] = cleaning
    bundled = bundled_files(sources, s.group_chars)
    if bundled:  # absent otherwise: a task manifest from before bundles stays valid where they change nothing
        identity["bundled_files"] = bundled
    return identity


def _written_before(store: Store, manifest_name: str, task: int, identity: dict, settings_hash: str) -> bool:
    """True when the task manifest exists with these settings; refused when it has others."""
    manifest_path = store.url(manifest_name)
    previous_text = store.read_text(manifest_name)
    if previous_text is None:
        return False
    try:
        previous = json.loads(previous_text)
    except ValueError as exc:
        raise DataPrepError(f"{manifest_path}: not valid JSON ({exc}); delete it to re-run task {task}") from None
    if previous.get("settings_sha256") == settings_hash:
        log.info("task %d: %s exists with the same settings, nothing to do", task, manifest_path)
        return True
    for earlier, why in _earlier_forms(identity):
        if previous.get("settings_sha256") == settings_sha256(earlier):
            log.info("task %d: %s exists with the same settings, nothing to do (%s)", task, manifest_path, why)
            return True
    raise DataPrepError(
        f"{manifest_path}: task {task} was already written with different settings "
        f"({_describe_difference(previous.get('settings', {}), identity)}); use a new --out folder"
    )


@dataclass
class _Written:
    """What a task's groups came to: shard entries, the groups, tokens tokenized, shards reused and written."""

    entries: list[dict] = field(default_factory=list)
    groups: list[GroupKey] = field(default_factory=list)
    tokens: int = 0
    reused: int = 0
    written: int = 0


def _write_groups(
    store, s: ShardSettings, tok, dtype, settings_hash: str, progress_prefix: str, batches, progress, read: ReadCount
) -> _Written:
    """Tokenize the task's batches (in order, overlapped with reading) and write each group's shards,
    saying how far along it is (``progress``: the input bytes ``read`` has counted)."""
    out = _Written()
    group: GroupWriter | None = None
    try:
        for batch, enc in _encode_in_order(tok, batches, s.workers):
            if batch.kind == "docs":
                n = group.add(batch.split, enc, batch.doc_ids, batch.first_offset)
                out.written += n
                out.tokens += int(enc.lens.sum())
                progress.update(len(batch.texts), int(enc.lens.sum()), n, read.bytes_read)
            elif batch.kind == "start":
                group = GroupWriter(store, batch.group, s, tok, dtype, settings_hash, progress_prefix, batch.resume)
                out.reused += group.reused
                out.groups.append(batch.group)
            elif batch.kind == "end":
                group_entries, n = group.finish()
                out.entries += group_entries
                out.written += n
                progress.update(0, 0, n, read.bytes_read)
                group = None
            else:  # done: the group was complete before this run
                out.entries += batch.entries
                out.reused += len(batch.entries)
                out.groups.append(batch.group)
    finally:
        progress.close()
    return out


def _check_what_was_read(read: ReadCount, groups: list, mine: list, task: int, num_tasks: int) -> None:
    if read.documents_read == 0:
        names = ", ".join(src.path for src in mine[:5]) + (" ..." if len(mine) > 5 else "")
        raise DataPrepError(f"empty input: task {task} of {num_tasks} found no documents in {names}")
    if not groups:
        log.warning(
            "task %d of %d owns no packing group: the input makes fewer groups than there are tasks "
            "(use fewer tasks or a smaller --group-chars)",
            task,
            num_tasks,
        )
