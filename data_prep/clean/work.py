"""What every stage of ``data_prep clean`` shares: the job (settings, inputs, identity, the work
folder ``.clean/<settings hash>/``), the names of the work files, their npz reading (mapped where
local) and writing, the corpus of groups the signatures tasks saw, and the refusals that name a
missing task.

Documents are named by a global id: the group's offset (groups in input order) plus the position in
the group."""

from __future__ import annotations

import glob
import io
import json
import os
import zipfile
from dataclasses import dataclass

import numpy as np

from data_prep.common.shards import sha256_file
from data_prep.common.storage import StorageError, Store, open_store

from ..cleaned_folder import read_report
from ..errors import DataPrepError
from ..groups import GroupKey, ReadCount, iter_owned_documents, owned_bytes
from ..progress import Progress
from ..reader import (
    ReadOptions,
    Source,
    bundle_sources,
    bundled_files,
    encoding_problem,
    resolve_inputs,
    resolve_partition,
)
from ..settings import settings_sha256
from .document import Signatures
from .settings import CleanSettings

WORK = ".clean"
IDENTITY = "identity.json"  # in a work folder: the settings (and inputs) it was made with


@dataclass
class Job:
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

    def owned(self, num_tasks: int, task: int, count: ReadCount | None = None, stage: str = ""):
        """(group, record) of every document the task owns; with ``stage``, saying how far along it is
        (the task's input bytes read, the rate, the time left: a line every ``log_every`` seconds in
        a batch log, a bar on a terminal)."""
        count = count if count is not None else ReadCount()
        docs = iter_owned_documents(
            self.sources, self.partition, num_tasks, task, self.opts, self.s.group_chars, count, records=True
        )
        if not stage:
            return docs
        total = owned_bytes(self.sources, self.partition, num_tasks, task, self.s.group_chars)
        return _said(docs, count, f"clean {stage}: task {task}/{num_tasks}", self.s.log_every, total)


def _said(docs, count: ReadCount, label: str, log_every: float, total: int):
    progress = Progress(label, log_every, total_bytes=total)
    n = 0
    try:
        for n, item in enumerate(docs, 1):
            yield item
            if n % 64 == 0:
                progress.update(64, bytes_read=count.bytes_read)
        progress.update(n % 64, bytes_read=count.bytes_read)
    finally:
        progress.close()


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


def make_job(s: CleanSettings, num_tasks: int) -> Job:
    s = s.checked()
    sources = resolve_inputs(s.inputs)
    held = _resolve_heldout(s.decontaminate_against)
    partition = resolve_partition(s.partition, len(bundle_sources(sources, s.group_chars)), num_tasks)
    store = open_store(s.out)
    store.check(write=True)
    identity = {
        **s.result_settings(),
        "sources": [src.to_dict() for src in sources],
        "decontaminated_against": [src.to_dict() for src in held],
    }
    if bundled := bundled_files(sources, s.group_chars):  # absent where bundles change nothing
        identity["bundled_files"] = bundled
    if s.quality_model.path:
        identity["quality_model_sha256"] = sha256_file(os.path.expanduser(s.quality_model.path))
    return Job(s, sources, held, partition, store, identity, settings_sha256(identity))


def finished(job: Job) -> dict | None:
    previous = read_report(job.s.out)
    return previous if previous is not None and previous.get("settings_sha256") == job.digest else None


def sig_name(key: GroupKey) -> str:
    return f"sig-{key.tag}.npz"


def task_marker(num_tasks: int, task: int) -> str:
    return f"sig-k{num_tasks:05d}-t{task:05d}.json"


def save_npz(store: Store, name: str, **arrays) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    store.write_bytes(name, buf.getvalue())


def load_npz(store: Store, name: str, only: tuple[str, ...] | None = None) -> dict:
    """The arrays of a work file (``only`` those named: a local file's others are never read)."""
    source = store.local_dir / name if store.local_dir is not None else io.BytesIO(store.read_bytes(name))
    with np.load(source, allow_pickle=False) as data:
        return {k: data[k] for k in data.files if only is None or k in only}


def map_npz(store: Store, name: str) -> dict:
    """The arrays of a local work file, memory-mapped (``np.savez`` stores its members uncompressed:
    each is a ``.npy`` at an offset of the zip), so that a reader's memory is the pages it touches;
    a bucket's is read whole (``load_npz``)."""
    if store.local_dir is None:
        return load_npz(store, name)
    path, out = store.local_dir / name, {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                return load_npz(store, name)
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


def missing_tasks(job: Job, what: str, tasks: list[int], num_tasks: int, resubmit: str) -> DataPrepError:
    shown = ",".join(map(str, tasks))
    other = _other_settings(job)
    if other:
        return DataPrepError(other)
    return DataPrepError(
        f"{job.store.url(job.work)}: the {what} of task(s) {shown} of {num_tasks} are missing "
        f"(not run, failed or killed): re-run them (submit_clean.sh {resubmit}--only {shown}: the later "
        "stages follow)"
    )


def _other_settings(job: Job) -> str | None:
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


def _all_groups(job: Job, num_tasks: int) -> list[tuple[GroupKey, int]]:
    """Every group with its document count (empty groups left out), from the signatures tasks'
    markers; refuses, naming them, while a task's is missing."""
    store, work = job.store, job.work
    missing, groups = [], {}
    for task in range(num_tasks):
        text = store.read_text(work + task_marker(num_tasks, task))
        if text is None:
            missing.append(task)
            continue
        for source, group, n in json.loads(text)["groups"]:
            groups[GroupKey(source, group)] = n
    if missing:
        raise missing_tasks(job, "signatures", missing, num_tasks, "")
    return sorted((k, n) for k, n in groups.items() if n)


def corpus(job: Job, num_tasks: int) -> tuple[list[tuple[GroupKey, int]], np.ndarray, int]:
    """(groups, each group's first global id, documents in all)."""
    groups = _all_groups(job, num_tasks)
    offsets = np.cumsum([0] + [n for _, n in groups])[:-1].astype(np.int64)
    n = int(sum(c for _, c in groups))
    if n == 0:
        raise DataPrepError(f"empty input: no documents in {', '.join(src.path for src in job.sources[:5])}")
    return groups, offsets, n


def result_name(stage: str, num_tasks: int, task: int) -> str:
    return f"{stage}-k{num_tasks:05d}-t{task:05d}.npz"


def result_names(job: Job, stage: str, num_tasks: int) -> list[str]:
    """Every task's result file of ``stage`` (exact, pairs); refuses, naming them, while some are missing."""
    listing = set(job.store.list(job.work.rstrip("/")))
    names = [job.work + result_name(stage, num_tasks, task) for task in range(num_tasks)]
    missing = [task for task, name in enumerate(names) if name not in listing]
    if missing:
        what = {"exact": "exact duplicates", "pairs": "near-duplicate pairs"}[stage]
        raise missing_tasks(job, what, missing, num_tasks, f"--from {stage} ")
    return names


def task_done(job: Job, name: str) -> bool:
    """A task's result exists: it was written whole, from every signatures task's groups, so a re-run
    of the task has nothing to do."""
    return job.work + name in set(job.store.list(job.work.rstrip("/")))


def group_sig(job: Job, key: GroupKey, *only: str) -> Signatures:
    """A group's facts; with ``only``, just those arrays (the others empty)."""
    d = load_npz(job.store, job.work + sig_name(key), only or None)
    empty = np.zeros(0)
    return Signatures(
        keys=d.get("keys", empty),
        exact=d.get("exact", empty),
        signatures=empty,  # in the mapped key files (MINHASH)
        words=d.get("words", empty),
        removed_by=d.get("removed_by", empty).astype(object),
        quality_scores=d.get("quality_scores", empty),
    )


def by_group(offsets: np.ndarray, ids: np.ndarray):
    """(group, slice of ``ids``) for each group holding some of the sorted global ``ids``: a binary
    search per group, never a pass over the ids per group (10,000 groups at a billion documents)."""
    bounds = np.searchsorted(ids, offsets)
    ends = np.append(bounds[1:], len(ids))
    for g in np.flatnonzero(ends > bounds):
        yield int(g), slice(int(bounds[g]), int(ends[g]))
