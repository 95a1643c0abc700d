"""``data_prep shard``: one array task's documents → tokenized, packed, shuffled shards + ``task-XXXXX.json``.

Pipeline: read documents (main thread) → tokenize in batches (a prefetch thread running the Rust
tokenizer, which releases the GIL and uses every core; or ``workers`` processes) → route each
document to train or validation → pack per split (``packing.Packer``) → every ``shard_size``
sequences, shuffle them (``packing.shard_permutation``) and write one shard in blocks of ``block_size``.

Splits: a document goes to validation iff a keyed hash of its text (key: the seed) falls below
``validation_fraction``, so the choice depends neither on the task count nor on the order.

Restarts: after each shard is renamed into place, a sidecar ``.progress-tXXXXX/<shard>.json`` records
its manifest entry, the settings hash and where the split's stream stands. A re-run of a killed task
keeps the longest run of shards whose sidecar and sha256 check out, skips (without tokenizing) the
documents they hold, and writes the rest: the same bytes as a run that was never killed. The task
manifest is written last; a task whose manifest exists with the same settings is not run again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import DataPrepError
from .packing import Packed, Packer, shard_permutation
from .progress import Progress
from .reader import ReadOptions, iter_task_documents, resolve_inputs, resolve_partition, task_sources
from .settings import SPLITS, ShardSettings, settings_sha256
from .shard_format import FORMAT_VERSION, ShardWriter, ids_dtype, sha256_file, shard_name, write_json_atomic
from .tokenizer import Encoded, LoadedTokenizer, install_tokenizer_copy, load_tokenizer

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
    return int.from_bytes(digest, "little") < fraction * 2.0 ** 64


@dataclass
class TaskResult:
    task: int
    manifest: Path
    skipped: bool                 # the task manifest already existed with the same settings
    shards_written: int = 0
    shards_reused: int = 0        # complete, verified shards kept from a killed run
    documents: dict = field(default_factory=dict)
    tokens: int = 0               # tokens tokenized in this run
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------------
# Tokenizing batches in order, overlapped with reading and writing


@dataclass
class _Batch:
    split: str
    doc_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    chars: int = 0
    first_offset: int = 0


_worker_tokenizer: LoadedTokenizer | None = None


def _worker_init(folder: str, threads: int) -> None:
    global _worker_tokenizer
    # several processes each running a full-width Rust thread pool would oversubscribe the cores
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    _worker_tokenizer = load_tokenizer(folder)


def _worker_encode(texts: list[str]) -> Encoded:
    return _worker_tokenizer.encode(texts)


def _encode_in_order(tok: LoadedTokenizer, batches, workers: int):
    """(batch, Encoded) pairs in input order, with a bounded number of batches in flight."""
    if workers == 1:
        with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
            yield from _bounded(batches, lambda b: pool.submit(tok.encode, b.texts), lambda f: f.result(), 2)
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(str(tok.folder), threads)) as pool:
        yield from _bounded(batches, lambda b: pool.apply_async(_worker_encode, (b.texts,)),
                            lambda r: r.get(), 2 * workers)


def _bounded(items, submit, result, ahead: int):
    pending: deque = deque()
    for item in items:
        pending.append((item, submit(item)))
        if len(pending) > ahead:
            done, handle = pending.popleft()
            yield done, result(handle)
    while pending:
        done, handle = pending.popleft()
        yield done, result(handle)


def _document_batches(docs, s: ShardSettings, resume: dict, documents: dict):
    """Route each document to its split and group them into tokenizer batches, skipping what the kept
    shards of a killed run already hold (counting every document, kept or not, in ``documents``)."""
    pending = {split: _Batch(split) for split in SPLITS}
    for d, text in enumerate(docs):
        split = "validation" if is_validation(text, s.validation_fraction, s.seed) else "train"
        documents[split] += 1
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
            pending[split] = _Batch(split)
    yield from (b for b in pending.values() if b.texts)


# ----------------------------------------------------------------------------------------------
# Shards of one split


@dataclass
class _Resume:
    entries: list[dict] = field(default_factory=list)   # manifest entries of shards kept from a killed run
    doc: int = 0                                        # the split's stream restarts in this document
    offset: int = 0                                     # after this many of its tokens


class SplitWriter:
    """Collects one split's packed sequences and writes a shard per ``shard_size`` of them."""

    def __init__(self, out: Path, split: str, task: int, s: ShardSettings, vocab_size: int, pad_id: int,
                 settings_hash: str, progress_dir: Path, resume: _Resume):
        self.out, self.split, self.task, self.s = out, split, task, s
        self.vocab_size, self.pad_id, self.settings_hash = vocab_size, pad_id, settings_hash
        self.progress_dir = progress_dir
        self.entries = list(resume.entries)
        self.reused = len(resume.entries)
        self._chunks: list[Packed] = []
        self._rows = 0

    def add(self, packed: Packed) -> int:
        """Returns the number of shards written."""
        if len(packed) == 0:
            return 0
        self._chunks.append(packed)
        self._rows += len(packed)
        written = 0
        while self._rows >= self.s.shard_size:
            self._write(self._take(self.s.shard_size))
            written += 1
        return written

    def close(self) -> int:
        if self._rows == 0:
            return 0
        self._write(self._take(self._rows))
        return 1

    def _take(self, n: int) -> Packed:
        ids = np.concatenate([c.ids for c in self._chunks])
        starts = np.concatenate([c.starts for c in self._chunks])
        end_doc = np.concatenate([c.end_doc for c in self._chunks])
        end_offset = np.concatenate([c.end_offset for c in self._chunks])
        taken = Packed(ids[:n], starts[:n], end_doc[:n], end_offset[:n])
        self._rows -= n
        self._chunks = [Packed(ids[n:], starts[n:], end_doc[n:], end_offset[n:])] if self._rows else []
        return taken

    def _write(self, packed: Packed) -> None:
        index = len(self.entries)
        name = shard_name(self.split, self.task, index)
        n = len(packed)
        order = shard_permutation(self.s.seed, self.split, self.task, index, n)
        ids, starts = packed.ids[order], packed.starts[order]
        writer = ShardWriter(self.out / name, self.vocab_size)
        try:
            for b in range(0, n, self.s.block_size):
                writer.write_block(ids[b:b + self.s.block_size], starts[b:b + self.s.block_size])
            digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        padding = int(np.count_nonzero(ids == self.pad_id))
        entry = {"name": name, "split": self.split, "task": self.task, "index": index, "sequences": n,
                 "blocks": writer.blocks, "tokens": n * self.s.seq_len - padding, "padding": padding,
                 "bytes": (self.out / name).stat().st_size, "sha256": digest}
        write_json_atomic(self.progress_dir / f"{name}.json", {
            "settings_sha256": self.settings_hash, "entry": entry,
            "resume": {"doc": int(packed.end_doc[-1]), "offset": int(packed.end_offset[-1])}})
        self.entries.append(entry)


def _kept_shards(out: Path, progress_dir: Path, split: str, task: int, settings_hash: str) -> _Resume:
    """The longest run of shards 0, 1, ... of a killed run that are complete and verified."""
    resume = _Resume()
    while True:
        name = shard_name(split, task, len(resume.entries))
        try:
            record = json.loads((progress_dir / f"{name}.json").read_text())
            entry = record["entry"]
            ok = (record["settings_sha256"] == settings_hash and (out / name).is_file()
                  and (out / name).stat().st_size == entry["bytes"] and sha256_file(out / name) == entry["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return resume
        resume.entries.append(entry)
        resume.doc, resume.offset = record["resume"]["doc"], record["resume"]["offset"]


def _remove_own_leftovers(out: Path, task: int, keep: set[str]) -> None:
    """Half-written ``*.tmp`` shards and shards of an older, different run of this task."""
    for path in out.glob(f"*-t{task:05d}-*.tar*"):
        if path.name.endswith(".tmp") or (path.suffix == ".tar" and path.name not in keep):
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# One task


def _describe_difference(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    parts = []
    for k in keys[:5]:
        if k == "sources":
            parts.append("sources (the input files or their sizes)")
        else:
            parts.append(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now")
    return "; ".join(parts) or "unknown"


def _write_task_manifest(path: Path, s: ShardSettings, identity: dict, settings_hash: str, tok: LoadedTokenizer,
                         dtype: str, sources, writers: dict, documents: dict) -> None:
    totals = {split: {"shards": len(w.entries),
                      "sequences": sum(e["sequences"] for e in w.entries),
                      "tokens": sum(e["tokens"] for e in w.entries),
                      "padding": sum(e["padding"] for e in w.entries),
                      "documents": documents[split]} for split, w in writers.items()}
    write_json_atomic(path, {
        "format_version": FORMAT_VERSION, "task": s.task_index, "num_tasks": s.num_tasks,
        "settings_sha256": settings_hash, "settings": identity,
        "origin": {"inputs": list(s.inputs), "tokenizer": str(s.tokenizer)},
        "seq_len": s.seq_len, "block_size": s.block_size, "dtype": dtype,
        "tokenizer": tok.manifest_entry(), "sources": [src.path for src in sources],
        "shards": [e for split in SPLITS for e in writers[split].entries], "totals": totals})


def run_shard(settings: ShardSettings) -> TaskResult:
    """Run one array task end to end. Raises ``DataPrepError`` on bad input or settings."""
    t0 = time.perf_counter()
    s = settings.resolved()
    task, num_tasks = s.task_index, s.num_tasks
    tok = load_tokenizer(s.tokenizer)
    sources = resolve_inputs(s.inputs)
    partition = resolve_partition(s.partition, len(sources), num_tasks)
    mine = task_sources(sources, partition, num_tasks, task)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = ids_dtype(tok.vocab_size)

    identity = {**s.result_settings(), "partition": partition, "dtype": dtype.name,
                "tokenizer_sha256": tok.sha256, "sources": [src.to_dict() for src in sources]}
    settings_hash = settings_sha256(identity)
    manifest_path = out / task_manifest_name(task)
    if manifest_path.exists():
        try:
            previous = json.loads(manifest_path.read_text())
        except ValueError as exc:
            raise DataPrepError(f"{manifest_path}: not valid JSON ({exc}); delete it to re-run task {task}") from None
        if previous.get("settings_sha256") == settings_hash:
            log.info("task %d: %s exists with the same settings, nothing to do", task, manifest_path)
            return TaskResult(task, manifest_path, skipped=True, seconds=time.perf_counter() - t0)
        raise DataPrepError(
            f"{manifest_path}: task {task} was already written with different settings "
            f"({_describe_difference(previous.get('settings', {}), identity)}); use a new --out folder")

    install_tokenizer_copy(tok, out)
    progress_dir = out / progress_dir_name(task)
    progress_dir.mkdir(exist_ok=True)
    resume = {split: _kept_shards(out, progress_dir, split, task, settings_hash) for split in SPLITS}
    _remove_own_leftovers(out, task, {e["name"] for r in resume.values() for e in r.entries})
    for split in SPLITS:
        if resume[split].entries:
            log.info("task %d: keeping %d finished %s shard(s) of an earlier run", task,
                     len(resume[split].entries), split)

    ids = tok.special_ids
    packers = {split: Packer(s.seq_len, ids["cls"], ids["sep"], ids["pad"], dtype) for split in SPLITS}
    writers = {split: SplitWriter(out, split, task, s, tok.vocab_size, ids["pad"], settings_hash,
                                  progress_dir, resume[split]) for split in SPLITS}
    documents = {split: 0 for split in SPLITS}
    docs = iter_task_documents(sources, partition, num_tasks, task,
                               ReadOptions(text_field=s.text_field, txt_mode=s.txt_mode, hf_split=s.hf_split))
    progress = Progress(f"task {task}/{num_tasks}", s.log_every)
    tokens = 0
    try:
        for batch, enc in _encode_in_order(tok, _document_batches(docs, s, resume, documents), s.workers):
            packed = packers[batch.split].add(enc, np.asarray(batch.doc_ids), batch.first_offset)
            written = writers[batch.split].add(packed)
            tokens += int(enc.lens.sum())
            progress.update(len(batch.texts), int(enc.lens.sum()), written)
        for split in SPLITS:
            progress.update(0, 0, writers[split].add(packers[split].finish()) + writers[split].close())
    finally:
        progress.close()

    if sum(documents.values()) == 0:
        names = ", ".join(src.path for src in mine[:5]) + (" ..." if len(mine) > 5 else "")
        raise DataPrepError(f"empty input: task {task} of {num_tasks} found no documents in {names}")

    _write_task_manifest(manifest_path, s, identity, settings_hash, tok, dtype.name,
                         mine, writers, documents)
    shutil.rmtree(progress_dir, ignore_errors=True)
    reused = sum(w.reused for w in writers.values())
    written = sum(len(w.entries) for w in writers.values()) - reused
    return TaskResult(task, manifest_path, skipped=False, shards_written=written,
                      shards_reused=reused, documents=documents, tokens=tokens,
                      seconds=time.perf_counter() - t0)
