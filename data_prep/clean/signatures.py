"""Stage 1, ``--stage signatures`` (task I of K): per document of each owned group its identity,
exact key, MinHash signature, word count, the language or quality rule that removes it and whether it
copies a held-out document (``document``), in worker processes; saved as ``sig-<group>.npz`` beside
the group's sorted key files (``sorted_keys``), then the task's marker listing its groups."""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from data_prep.common.atomic import json_bytes

from ..errors import DataPrepError
from ..groups import GroupKey, ReadCount
from ..reader import iter_source_records
from . import lsh
from .document import Signatures, analyse, worker_analyse, worker_init
from .settings import CleanSettings
from .sorted_keys import group_keys, key_file
from .work import IDENTITY, Job, save_npz, sig_name, task_marker

CHUNK = 256  # documents per message to a worker


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
        if sig_name(k) not in done:
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
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_start, initargs=(s, os.getpid())) as pool:
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


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _worker_start(s: CleanSettings, parent: int) -> None:
    """A worker dies with the ``clean`` that started it: a SIGTERM or kill of the parent had left its
    workers running a minute later (Linux's parent-death signal; elsewhere as before)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)
    worker_init(s)


def _held_out_signatures(job: Job) -> Signatures | None:
    s = job.s
    if not job.held:
        return None
    records = [
        analyse(r, s.text_field, _no_filters(s), None) for src in job.held for r in iter_source_records(src, job.opts)
    ]
    return Signatures.of(records, s.near.bands * s.near.rows)


def _contaminated(job: Job, sig: Signatures, held: Signatures | None) -> np.ndarray:
    """Mask of the documents (not removed by a rule) that copy a held-out one: decided per document,
    here, so that no later stage sees them."""
    s = job.s
    if held is None:
        return np.zeros(len(sig), bool)
    return lsh.contaminated(
        sig.signatures if s.near.enabled else None,
        sig.exact,
        sig.removed_by == "",
        held.signatures,
        held.exact,
        s.near.bands,
        s.near.rows,
        s.near.min_similarity,
    )


def stage_signatures(job: Job, num_tasks: int, task: int) -> None:
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
            save_npz(
                store,
                work + sig_name(current),
                keys=sig.keys,
                exact=sig.exact,
                words=sig.words,
                removed_by=sig.removed_by.astype(str),
                contaminated=contaminated,
                **({"quality_scores": sig.quality_scores} if s.quality_model.path else {}),
            )

    for key, sig in _analysed(_chunks(job.owned(num_tasks, task, count, stage="signatures"), done, groups), s):
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
        work + task_marker(num_tasks, task),
        json_bytes(
            {
                "settings_sha256": job.digest,
                "num_tasks": num_tasks,
                "task": task,
                "groups": [[k.source, k.group, n] for k, n in sorted(groups.items())],
            }
        ),
    )


def _no_filters(s: CleanSettings) -> CleanSettings:
    """Held-out documents are compared, never filtered."""
    return dataclasses.replace(s, quality=dataclasses.replace(s.quality, enabled=False))
