"""Checkpoints mirrored to a bucket (``train.checkpoint_mirror``), as Composer's ``save_folder``.

Each complete checkpoint is uploaded in the background by the first rank, through the storage layer
(``data_prep.common.storage``: an ``s3://`` URL or a folder on another filesystem), while training goes on.
The order makes a mirrored checkpoint count only when whole, as a local one does: every file of the
tag folder, then ``file_list.json``, then ``COMPLETE``, then the ``latest`` pointer; a kill part-way
leaves a tag without ``COMPLETE``, which nothing takes (and which goes once a newer tag is complete).
``train.keep_checkpoints`` applies in the mirror too (the oldest complete tags go once a newer one is
there). The conversion cache
(``universal/``) is not mirrored: it is made again where it is needed. On node-local disks
(``pretrain.checkpoint.nodes``) each other node's first rank uploads its own ranks' shards, then a
listing of them (``<tag>/.nodes/rank<r>.json``, or why it failed); the first rank merges every node's
listing into the mirrored file list before ``COMPLETE``.

A run resumes from the mirror (``fetch_newer``, before any process group starts) when the mirror holds
a newer complete checkpoint than its ``train.out_dir`` (none there at all, on a node-local disk of a
requeued job): the first process of each node downloads what its ranks load (everything when the
layout changes) under a file lock, checking every file against the mirrored ``file_list.json``, and
writes ``COMPLETE`` last; the others wait and find it
local. A mirrored checkpoint with a damaged or missing file is named and the previous one tried.

An upload that fails after the storage layer's retries (transient errors, for ``data.remote_timeout_s``)
is logged and the run goes on; the next checkpoint is uploaded as usual. A run that ends waits for
its uploads; if the newest local checkpoint is then not in the mirror, it says so and exits with
``MIRROR_BEHIND`` (pretrain.runtime.exit_codes).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Optional

from data_prep.common.atomic import write_atomic
from data_prep.common.paths import UnsafeName, inside, name_problem, plain_files
from data_prep.common.shards import sha256_file
from data_prep.common.storage import StorageError, Store, open_store
from data_prep.progress import MIB
from pretrain.checkpoint.files import (
    COMPLETE,
    EXPORT_SOURCE,
    FILE_LIST,
    LATEST,
    LAYOUT_FILE,
    NODE_LISTINGS,
    is_tag,
    rank_of_file,
)
from pretrain.checkpoint.nodes import NodeLayout, needed_by
from pretrain.runtime import faults
from pretrain.runtime.exit_codes import MIRROR_BEHIND
from pretrain.tracking.console import ByteMeter, duration

log = logging.getLogger("pretrain")
NODE_WAIT_S = 1800.0  # the other nodes upload as much as the first, at the same time: a node gone quiet
NODE_POLL_S = 0.5  # that long is dead (and so is the job), or its failure was not even writable
PROGRESS_S = 30.0  # a wait for uploads or a download says how far along it is this often


def mirror_problems(url: str) -> list[str]:
    """Why ``train.checkpoint_mirror`` cannot be written (none when empty): a scheme that is not
    supported or is read-only, missing credentials, a denied key, an unknown bucket."""
    if not url:
        return []
    try:
        store = open_store(url)
        if url.startswith(("http://", "https://")):
            return [
                f"train.checkpoint_mirror={url}: an http(s) location is read-only; use s3://bucket/prefix or a folder"
            ]
        store.check(write=True)
    except StorageError as exc:
        return [f"train.checkpoint_mirror: {exc}"]
    return []


def mirrored_tags(store: Store) -> list[str]:
    """Tags with ``COMPLETE`` in the mirror, oldest first."""
    return sorted(
        name.split("/")[0]
        for name in store.list()
        if name.count("/") == 1 and name.endswith("/" + COMPLETE) and is_tag(name.split("/")[0])
    )


class CheckpointMirror:
    """A folder writer's uploader: ``upload(folder)`` returns at once; ``wait()`` at the end. The first
    rank's commits each tag; on node-local disks each other node's first rank uploads its own ranks'
    shards and then a listing of them, which the first rank waits for and merges into the file list."""

    def __init__(self, url: str, keep: int, nodes: NodeLayout):
        self.url, self.keep, self.nodes = url, keep, nodes
        self.store = open_store(url)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-mirror")
        self._pending: list[Future] = []
        self._queued: list[str] = []
        self._lock = threading.Lock()
        self.newest_mirrored: Optional[str] = None
        self.failed: list[str] = []
        self.behind: dict[str, str] = {}  # folders (the export, the report) whose upload failed
        # each upload queued or running: [its folder's name, bytes to send, bytes sent] (for ``wait``'s lines)
        self._transfers: dict[int, list] = {}
        self._jobs = itertools.count()
        self._sent_total = 0  # bytes every upload of this run sent

    def catch_up(self, root: Path, export: Path) -> None:
        """At start: what an earlier job of this run left on local disk only (stopped during an upload)
        goes up now, so that a relaunch with nothing left to train does not end with the mirror one
        checkpoint back and without the export: the newest complete checkpoint under ``root`` and the
        export ``export`` (whose marker, written last, names its checkpoint). They then count in
        ``wait``'s "behind" line like this job's own uploads."""
        try:
            local = (
                sorted(p.name for p in root.iterdir() if is_tag(p.name) and (p / COMPLETE).is_file())
                if root.is_dir()
                else []
            )
            if local and local[-1] not in mirrored_tags(self.store):
                log.warning(
                    "checkpoint mirror: %s is complete here but not in %s (a job stopped during its "
                    "upload): uploading it",
                    local[-1],
                    self.url,
                )
                self.upload(root / local[-1])
            marker = export / EXPORT_SOURCE
            if (
                self.nodes.rank == 0
                and marker.is_file()
                and self.store.read_text(f"{export.name}/{EXPORT_SOURCE}") != marker.read_text()
            ):
                log.warning("checkpoint mirror: %s is not in %s as it is here: uploading it", export.name, self.url)
                self.upload_folder(export, last=EXPORT_SOURCE)
        except (StorageError, OSError) as exc:
            self.behind["catch-up"] = f"what an earlier job left unmirrored ({exc})"
            log.warning("checkpoint mirror: comparing %s with %s failed (%s)", root, self.url, exc)

    def upload(self, folder: Path) -> None:
        """Start uploading the complete checkpoint ``folder`` (its tag folder)."""
        with self._lock:
            self._queued.append(folder.name)
        try:
            size = sum(want["size"] for want in self._files_to_put(Path(folder)).values())
        except (OSError, ValueError, KeyError, TypeError):  # the upload itself says what is wrong
            size = 0
        self._submit(folder.name, size, self._upload, Path(folder))

    def _submit(self, name: str, size: int, work, *args) -> None:
        """``work(*args, job)`` in the uploader's thread, its ``size`` bytes counted as a transfer (for
        ``wait``'s lines) until it ends, whatever the outcome."""
        with self._lock:
            job = next(self._jobs)
            self._transfers[job] = [name, size, 0]

        def run() -> None:
            try:
                work(*args, job)
            finally:
                with self._lock:
                    self._transfers.pop(job, None)

        self._pending.append(self._pool.submit(run))

    def _sent(self, job: int, path: Path) -> None:
        size = path.stat().st_size
        with self._lock:
            self._sent_total += size
            if job in self._transfers:
                self._transfers[job][2] += size

    def _upload(self, folder: Path, job: int) -> None:
        tag = folder.name
        try:
            self._put_folder(folder, tag, job)
        except (StorageError, OSError, UnsafeName) as exc:
            if not folder.is_dir() and self._superseded(tag):  # keep_checkpoints removed it; a newer one follows
                log.info("checkpoint mirror: %s was replaced locally before its upload ended; skipped", tag)
            else:
                self._failed(tag, str(exc))
            return
        self.newest_mirrored = max(tag, self.newest_mirrored or "")
        if self.nodes.rank != 0:
            return  # the first rank completes the tag and prunes
        log.info("checkpoint mirror: %s is complete in %s", tag, self.store.url(tag))
        try:
            self._prune()
        except (StorageError, OSError) as exc:
            log.warning("checkpoint mirror: removing old checkpoints from %s failed (%s)", self.url, exc)

    def _files_to_put(self, folder: Path) -> dict:
        """The checkpoint's files this rank uploads, as its file list names them: all on the first rank,
        on another node's first rank its own ranks' shards."""
        listed = json.loads((folder / FILE_LIST).read_text())["files"]
        if self.nodes.rank == 0:
            return listed
        return {name: want for name, want in listed.items() if rank_of_file(name) is not None}

    def _put_folder(self, folder: Path, tag: str, job: int) -> None:
        """Every file, then the file list, COMPLETE and ``latest``: the mirror's own commit order. On
        another node: its ranks' shards, then its listing."""
        if self.nodes.rank != 0:
            self._put_node_files(folder, tag, job)
            return
        listed = self._files_to_put(folder)
        for done, name in enumerate(sorted(listed), 1):
            path = inside(folder, name, str(folder / FILE_LIST))
            self.store.put_file(path, f"{tag}/{name}", listed[name]["sha256"], keep_local=True)
            self._sent(job, path)
            faults.mirror_upload(tag, done)  # test-only
        if not self.nodes.shared:
            listed = {**listed, **self._other_nodes_files(tag)}
        self.store.write_bytes(f"{tag}/{FILE_LIST}", (json.dumps({"files": listed}, indent=1) + "\n").encode())
        self.store.put_file(folder / COMPLETE, f"{tag}/{COMPLETE}", sha256_file(folder / COMPLETE), keep_local=True)
        self.store.write_bytes(LATEST, tag.encode())

    def _put_node_files(self, folder: Path, tag: str, job: int) -> None:
        """This node's ranks' shards, then their listing (or why they are not there: the first rank
        stops waiting for them)."""
        listing = f"{tag}/{NODE_LISTINGS}/rank{self.nodes.rank:05d}.json"
        try:
            listed = self._files_to_put(folder)
            for name in sorted(listed):
                path = inside(folder, name, str(folder / FILE_LIST))
                self.store.put_file(path, f"{tag}/{name}", listed[name]["sha256"], keep_local=True)
                self._sent(job, path)
        except (StorageError, OSError, UnsafeName) as exc:
            with contextlib.suppress(StorageError):
                self.store.write_bytes(listing, json.dumps({"failed": str(exc)}).encode())
            raise
        self.store.write_bytes(listing, json.dumps({"files": listed}, indent=1).encode())

    def _other_nodes_files(self, tag: str) -> dict:
        """The other nodes' uploaded shards of ``tag``, once every node has listed them."""
        files: dict = {}
        deadline = time.monotonic() + NODE_WAIT_S
        for leader in (r for r in self.nodes.leaders if r != 0):
            name = f"{tag}/{NODE_LISTINGS}/rank{leader:05d}.json"
            while (text := self.store.read_text(name)) is None:
                if time.monotonic() > deadline:
                    raise StorageError(
                        f"the node of rank {leader} did not upload its shards of {tag} within {NODE_WAIT_S:.0f}s"
                    )
                time.sleep(NODE_POLL_S)
            listing = json.loads(text)
            if "failed" in listing:
                raise StorageError(f"the node of rank {leader} could not upload its shards: {listing['failed']}")
            if bad := [n for n in listing["files"] if name_problem(n)]:
                raise StorageError(f"{self.store.url(name)} lists {bad[0]!r}, not a name inside a checkpoint")
            files.update(listing["files"])
        return files

    def upload_folder(self, folder: Path, last: Optional[str] = None) -> None:
        """Start uploading a folder of the run as ``<its name>/`` (the final export ``hf_final``, the
        report): its files, then ``last`` (the export's marker naming its checkpoint, so that a mirrored
        export without it is unfinished). The first rank's."""
        if self.nodes.rank != 0:
            return
        try:
            size = sum(p.stat().st_size for p in plain_files(Path(folder))[0])
        except OSError:  # the upload itself says what is wrong
            size = 0
        self._submit(Path(folder).name, size, self._upload_folder, Path(folder), last)

    def _upload_folder(self, folder: Path, last: Optional[str], job: int) -> None:
        found, others = plain_files(folder)
        if others:  # nothing a link points to leaves the run folder
            log.warning(
                "checkpoint mirror: not uploading %s: not regular files of the run (symbolic links are not followed)",
                ", ".join(str(p) for p in others),
            )
        files = [p for p in found if p != folder / last] if last else found
        if last and folder / last in others:
            last = None  # a linked marker: the mirrored folder stays unfinished
        try:
            for path in files + ([folder / last] if last else []):
                name = f"{folder.name}/{path.relative_to(folder).as_posix()}"
                self.store.put_file(path, name, sha256_file(path), keep_local=True)
                self._sent(job, path)
        except (StorageError, OSError) as exc:
            self.behind[folder.name] = f"{folder.name}/ ({exc})"
            log.warning("checkpoint mirror: uploading %s failed (%s)", folder, exc)
            return
        self.behind.pop(folder.name, None)
        log.info("checkpoint mirror: %s is in %s", folder.name, self.store.url(folder.name))

    def _waiting_line(self, waited: float, sent: int) -> str:
        """How far along the uploads a run's end waits for are: what is left, the rate since the wait
        began and the time left at it."""
        with self._lock:
            names = sorted({name for name, _, _ in self._transfers.values()})
            left = sum(max(0, size - done) for _, size, done in self._transfers.values())
        rate = max(sent, 0) / max(waited, 1e-9)
        eta = f"about {duration(left / rate)} left" if sent >= MIB else "under 1 MiB sent in the wait: no rate yet"
        return (
            f"checkpoint mirror: waiting for the uploads to {self.url} ({', '.join(names) or 'their last files'}): "
            f"{left / MIB:,.1f} MiB left, {sent / MIB:,.1f} MiB sent in {waited:.0f} s ({rate / MIB:,.1f} MiB/s), {eta}"
        )

    def _superseded(self, tag: str) -> bool:
        with self._lock:
            return any(t > tag for t in self._queued)

    def _failed(self, tag: str, why: str) -> None:
        self.failed.append(tag)
        log.warning(
            "checkpoint mirror: uploading %s to %s failed (%s); training goes on, the mirror is "
            "behind until a later checkpoint uploads",
            tag,
            self.store.url(tag),
            why,
        )

    def _prune(self) -> None:
        """Complete tags past ``keep``, and unfinished ones older than the newest complete tag (an
        upload skipped or cut short: they never complete). Checkpoint tags only: the exports and the
        report beside them are not checkpoints."""
        names = self.store.list()
        tags = {name.split("/")[0] for name in names if "/" in name and is_tag(name.split("/")[0])}
        complete = sorted(t for t in tags if f"{t}/{COMPLETE}" in names)
        drop = [t for t in sorted(tags) if t not in complete and complete and t < complete[-1]]
        drop += complete[: -self.keep] if self.keep else []
        for tag in drop:
            self.store.delete_folder(tag)

    def wait(self) -> Optional[str]:
        """Wait for every upload, saying every ``PROGRESS_S`` how far along they are; None when the newest
        queued checkpoint is in the mirror, else a line that says what is behind."""
        started, sent_before = time.monotonic(), self._sent_total
        for future in self._pending:
            while True:
                try:
                    future.result(timeout=PROGRESS_S)
                    break
                except FutureTimeout:
                    log.info("%s", self._waiting_line(time.monotonic() - started, self._sent_total - sent_before))
        self._pool.shutdown(wait=True)
        newest = max(self._queued, default=None)
        if newest is not None and newest != self.newest_mirrored:
            there = self.newest_mirrored or "no checkpoint of this run's jobs"
            return (
                f"the checkpoint mirror {self.url} is behind: the newest checkpoint, {newest}, is only on "
                f"local disk ({there} is the newest uploaded)"
            )
        if self.behind:
            return f"the checkpoint mirror {self.url} is behind: {', '.join(self.behind.values())} only on local disk"
        return None


def wait_for_mirror(mirror: Optional[CheckpointMirror], exit_code: int) -> int:
    """A run that ends waits for its checkpoints' uploads; if the newest did not reach the mirror, its
    last line says so and a clean exit becomes MIRROR_BEHIND."""
    behind = mirror.wait() if mirror is not None else None
    if behind is None:
        return exit_code
    log.error("%s; exit %d", behind, exit_code or MIRROR_BEHIND)
    return exit_code or MIRROR_BEHIND


def fetch_newer(
    url: str, root: Path, tag: Optional[str] = None, ranks: Optional[range] = None, running: Optional[dict] = None
) -> Optional[str]:
    """Download into ``root`` the newest complete mirrored checkpoint (or ``tag``) unless ``root``
    already holds it (as far as this node's ``ranks`` need) or a newer one; returns the tag downloaded,
    or None. Once per node: the first process to take the lock downloads, the others then find the
    files local. ``running``: the job's world size and ZeRO stage; a checkpoint of another layout is
    converted on every node, which needs every rank's shards."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".mirror-download.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        local = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / COMPLETE).is_file())
        store = open_store(url)
        candidates = [t for t in reversed(mirrored_tags(store)) if (tag is None or t == tag)]
        for candidate in candidates:
            if tag is None and local and local[-1] > candidate:
                return None  # the local copy is newer
            try:
                listed = json.loads(store.read_bytes(f"{candidate}/{FILE_LIST}"))["files"]
                layout = json.loads(store.read_bytes(f"{candidate}/{LAYOUT_FILE}"))
                same = running is not None and all(layout.get(k) == v for k, v in running.items())
            except (StorageError, ValueError, KeyError, TypeError) as exc:
                _say(f"mirrored checkpoint {store.url(candidate)} is damaged: {exc}; trying the previous one")
                continue
            for name in listed:  # not damage: somebody wrote names that lead out of the run folder
                inside(root / candidate, name, store.url(f"{candidate}/{FILE_LIST}"))
            needed = needed_by(listed, ranks if same else None)
            if _holds(root / candidate, needed):
                return None
            problem = _download(store, candidate, root / candidate, {n: listed[n] for n in needed})
            if problem is None:
                write_atomic(root / LATEST, max(candidate, local[-1] if local else ""))
                _say(
                    f"resuming from the checkpoint mirror: {store.url(candidate)} downloaded into "
                    f"{root / candidate}"
                    + (f" (the files of ranks {ranks.start}-{ranks.stop - 1})" if same and ranks else "")
                )
                return candidate
            _say(f"mirrored checkpoint {store.url(candidate)} is damaged: {problem}; trying the previous one")
        return None


def _holds(folder: Path, names: list[str]) -> bool:
    """``folder`` is a complete local checkpoint with each of ``names`` (written or downloaded whole)."""
    return (folder / COMPLETE).is_file() and all((folder / name).is_file() for name in names)


def _download(store: Store, tag: str, folder: Path, wanted: dict) -> Optional[str]:
    """The mirrored tag's ``wanted`` files into ``folder``, each checked against the mirrored file
    list, added to what another node's download put there (one shared out_dir); the local file list
    names what is there, and COMPLETE comes last. None when whole, else what is wrong (the files
    this call wrote are removed)."""
    complete = (folder / COMPLETE).is_file()
    written: list[Path] = []
    total = sum(want["size"] for want in wanted.values())
    meter = ByteMeter(f"downloading {store.url(tag)}", total, _say, every_s=PROGRESS_S)  # by whole files
    try:
        for name, want in sorted(wanted.items()):
            meter.starting(want["size"])
            target = inside(folder, name, FILE_LIST)
            if target.is_file() and target.stat().st_size == want["size"] and sha256_file(target) == want["sha256"]:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            part = target.with_name(target.name + ".part")
            written.append(part)
            store.download(f"{tag}/{name}", part)
            if part.stat().st_size != want["size"] or sha256_file(part) != want["sha256"]:
                raise ValueError(
                    f"{store.url(f'{tag}/{name}')} is not the file that was written (size or sha256 differs)"
                )
            os.replace(part, target)
            written[-1] = target
        present = json.loads((folder / FILE_LIST).read_text())["files"] if complete else {}
        write_atomic(folder / FILE_LIST, json.dumps({"files": {**present, **wanted}}, indent=1) + "\n")
        if not complete:
            store.download(f"{tag}/{COMPLETE}", folder / COMPLETE)
    except (StorageError, OSError, ValueError, KeyError, TypeError) as exc:
        for path in written:
            path.unlink(missing_ok=True)
        if not complete:
            shutil.rmtree(folder, ignore_errors=True)
        return str(exc)
    return None


def _say(message: str) -> None:
    """Before logging is set up, by the process that downloads (one per node, whichever rank it is)."""
    print(f"resume: {message}", file=sys.stderr, flush=True)
