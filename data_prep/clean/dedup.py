"""Stages 2 and 3, as array tasks over key ranges: ``--stage exact`` (the exact duplicates of the
task's exact-key ranges) and ``--stage pairs`` (the near-duplicate candidates of the task's (band,
hash range) units, less every exact duplicate, checked on their full signatures: only confirmed pairs
are written). Both read every group's sorted key files mapped (``sorted_keys``): memory is one range."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import numpy as np

from ..progress import Steps
from . import lsh
from .sorted_keys import (
    BAND_ARRAYS,
    EXACT_ARRAYS,
    MINHASH,
    Gone,
    KeyFiles,
    band_pairs_confirmed,
    band_units,
    exact_duplicates,
    key_file,
    key_ranges,
    owned,
    range_bounds,
)
from .work import Job, by_group, corpus, load_npz, result_name, result_names, save_npz, task_done


def stage_exact(job: Job, num_tasks: int, task: int) -> None:
    """Exact duplicates of this task's exact-key ranges (every document's key of a range from every
    group: memory is one range)."""
    groups, offsets, n = corpus(job, num_tasks)
    name = result_name("exact", num_tasks, task)
    if task_done(job, name):
        return
    removed = reps = np.zeros(0, np.int64)
    if job.s.exact.enabled:
        bounds = owned(range_bounds(key_ranges(n, job.s.slice_keys)), num_tasks, task)
        steps = Steps(f"clean exact: task {task}/{num_tasks}", len(bounds), "key ranges", job.s.log_every)
        with _key_files(job, groups, offsets, EXACT_ARRAYS) as (files, _):
            removed, reps = exact_duplicates(files, bounds, steps.advance)
        steps.close()
    save_npz(job.store, job.work + name, removed=removed, reps=reps)


def stage_pairs(job: Job, num_tasks: int, task: int) -> None:
    """Near-duplicate candidates of this task's (band, band-hash range) units, less the exact
    duplicates, checked on their full signatures: only the confirmed pairs are written."""
    s = job.s
    groups, offsets, n = corpus(job, num_tasks)
    name = result_name("pairs", num_tasks, task)
    if task_done(job, name):
        return
    gone = Gone(n)
    for exact in result_names(job, "exact", num_tasks):  # one file at a time: the bits, never the ids
        gone.add(load_npz(job.store, exact, ("removed",))["removed"])
    confirmed = np.zeros((0, 2), np.int64)
    if s.near.enabled:
        units = owned(band_units(s.near.bands, key_ranges(n, s.slice_keys)), num_tasks, task)
        steps = Steps(f"clean pairs: task {task}/{num_tasks}", len(units), "band units", s.log_every)
        with _key_files(job, groups, offsets, (*BAND_ARRAYS, MINHASH)) as (files, minhash):
            confirmed = band_pairs_confirmed(
                files, units, gone, lambda pairs: _confirmed_pairs(job, offsets, minhash, pairs), steps.advance
            )
        steps.close()
    save_npz(job.store, job.work + name, pairs=confirmed)


@contextlib.contextmanager
def _local_work(job: Job, arrays: tuple[str, ...]):
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
def _key_files(job: Job, groups, offsets, arrays: tuple[str, ...]):
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


def _confirmed_pairs(job: Job, offsets, minhash, pairs: np.ndarray) -> np.ndarray:
    """The candidate pairs whose full signatures agree on ``near.min_similarity`` of their values
    (each member's signature read from its group's mapped file: pages, not the group)."""
    if not len(pairs) or job.s.near.min_similarity <= 0:
        return pairs
    members = lsh.sorted_unique(pairs)
    rows = np.empty((len(members), job.s.near.bands * job.s.near.rows), np.uint32)
    for g, at in by_group(offsets, members):
        rows[at] = minhash(g)[members[at] - offsets[g]]
    a, b = np.searchsorted(members, pairs[:, 0]), np.searchsorted(members, pairs[:, 1])
    return pairs[lsh.agreement(rows, a, b) >= job.s.near.min_similarity]
