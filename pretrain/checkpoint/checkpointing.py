"""Checkpoints as this project defines them: tags, the COMPLETE marker, ``latest``, RNG state, and
the files beside DeepSpeed's own that make a checkpoint export and resume on its own.

A checkpoint counts only when complete: every rank writes its shards (DeepSpeed's ``save_checkpoint``), all
meet at a barrier, then rank 0 writes the side files, the COMPLETE marker and, last, the ``latest``
pointer. A kill anywhere before that leaves the previous checkpoint the one ``resume=auto`` finds.
Before COMPLETE, rank 0 lists every file's size and sha256 (``FILE_LIST``): a checkpoint damaged
since (a truncated file, a full disk, a bad copy) is named at resume and the previous complete one
taken instead.
Which checkpoint a run resumes from is decided here *before* any process group starts
(``resume_tag``), so a bad ``train.resume`` is an input error (exit 2), not a traceback on every rank.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import yaml

from data_prep.common.atomic import write_atomic
from data_prep.common.errors import ShardError
from data_prep.common.manifest import Manifest, load_manifest
from data_prep.common.paths import UnsafeName, inside, plain_files
from data_prep.common.shards import sha256_file
from data_prep.common.storage import StorageError
from pretrain.checkpoint import mirror, reshard, safe_load
from pretrain.checkpoint.files import (
    COMPLETE,
    CONFIG_FILE,
    FILE_LIST,
    LATEST,
    LAYOUT_FILE,
    LOCK_FILE,
    is_tag,
    tag_for_step,
)
from pretrain.checkpoint.nodes import NodeLayout, env_node_ranks
from pretrain.config.loader import ConfigError
from pretrain.config.schema import Config, upgrade_saved

log = logging.getLogger("pretrain")


class DiskFull(Exception):
    """The run's disk filled up while a checkpoint was written: the partial tag is never taken (it has
    no COMPLETE), the previous complete one is intact; the trainer stops with exit 7 (DISK_FULL)."""


# torch's stream writer reports a failed write without its errno, in these words
_TORCH_WRITE_FAILED = ("No space left on device", "file write failed", "iostream error", "unexpected pos")
_NEARLY_FULL = 64 << 20


def out_of_space(exc: BaseException, folder: Path) -> bool:
    """``exc``, raised while writing a checkpoint into ``folder``, means its disk is full: ENOSPC (or a
    quota) from Python, or torch's failed write on a disk with less than 64 MiB left."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not (isinstance(exc, RuntimeError) and any(words in str(exc) for words in _TORCH_WRITE_FAILED)):
        return False
    try:
        return shutil.disk_usage(folder).free < _NEARLY_FULL
    except OSError:
        return False


def disk_full(cfg: Config, step: int) -> DiskFull:
    """The named stop for a checkpoint at ``step`` that the disk could not hold."""
    root = checkpoint_root(cfg)
    previous = latest_complete_tag(root)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    try:
        free = f" ({shutil.disk_usage(root).free / 2**20:,.0f} MiB free)"
    except OSError:
        free = ""
    return DiskFull(f"no space left on {root}{free} while writing checkpoint step {step}; {kept}")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.train.out_dir) / "checkpoints"


def complete_tags(root: Path) -> list[str]:
    """Tags whose every file is on disk, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if is_tag(p.name) and not p.is_symlink() and p.is_dir() and (p / COMPLETE).is_file()
    )


def latest_complete_tag(root: Path) -> Optional[str]:
    """What ``latest`` names, when it names a complete tag of this folder; else the newest complete tag.
    A pointer that is not a tag name (``../../other-run/checkpoints/step00000040``, an absolute path)
    or names a symbolic link is damage, named: another run's checkpoint is never taken for this one's."""
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if not is_tag(tag) or (root / tag).is_symlink():
            log.warning(
                "%s names %r, not a checkpoint tag of this folder: damaged, passed over for the newest "
                "complete checkpoint",
                pointer,
                tag[:200],
            )
        elif (root / tag / COMPLETE).is_file():
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def resume_tag(cfg: Config) -> Optional[str]:
    """``train.resume``: auto (the latest complete and undamaged one, if any), none, or a tag that
    must be complete and undamaged. Only the first rank reads every byte for the checksums: its
    choice is the one every rank loads (the others check sizes, which costs nothing)."""
    root = checkpoint_root(cfg)
    checksums = os.environ.get("RANK", "0") == "0"
    if cfg.train.resume == "none":
        return None
    if cfg.train.checkpoint_mirror:  # a newer checkpoint there (or the one asked for) comes local first
        try:
            mirror.fetch_newer(
                cfg.train.checkpoint_mirror,
                root,
                None if cfg.train.resume == "auto" else cfg.train.resume,
                env_node_ranks(),
                running_layout(cfg),
            )
        except (StorageError, UnsafeName) as exc:
            raise ConfigError([f"train.checkpoint_mirror: {exc}"]) from None
    tag = (
        usable_latest_tag(root, checksums)
        if cfg.train.resume == "auto"
        else named_tag(root, cfg.train.resume, checksums)
    )
    problems = safe_load.code_problems(root / tag) if tag else []
    if problems:
        raise ConfigError(
            [f"train.resume: {p}" for p in problems]
            + [f"{root / tag} is refused whole: restore it from a copy you trust, or resume another tag"]
        )
    return tag


def named_tag(root: Path, tag: str, checksums: bool) -> str:
    """``train.resume=<tag>``: it must be complete and undamaged."""
    if not (root / tag / COMPLETE).is_file():
        raise ConfigError(
            [
                f"train.resume={tag!r}: {root / tag} is not a complete checkpoint (complete ones: "
                f"{', '.join(complete_tags(root)) or 'none'})"
            ]
        )
    problem = damage(root / tag, checksums)
    if problem:
        raise ConfigError([f"train.resume={tag!r}: the checkpoint {root / tag} is damaged: {problem}"])
    return tag


def running_layout(cfg: Config) -> dict:
    """What of the job's layout is known before it starts: a mirrored checkpoint of the same needs
    only each node's own ranks' files (another one is converted on every node, from all of them)."""
    known = {
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "zero_stage": cfg.impl.zero_stage,
        "offload_optimizer": cfg.impl.offload_optimizer,
    }
    return {**known, "precision": cfg.impl.precision} if cfg.impl.precision != "auto" else known


def ensure_on_every_node(cfg: Config, tag: str, layout: NodeLayout) -> None:
    """On node-local disks, the first rank's choice ``tag`` must be on every node: a node that lacks
    it (new to the job, or its disk behind) fetches it from ``train.checkpoint_mirror``. A collective."""
    if layout.shared:
        return
    problem = None
    if layout.writes_folder:
        root = checkpoint_root(cfg)
        if cfg.train.checkpoint_mirror:
            try:
                mirror.fetch_newer(cfg.train.checkpoint_mirror, root, tag, layout.node_ranks(), running_layout(cfg))
            except (StorageError, UnsafeName) as exc:
                problem = f"rank {layout.rank}: {exc}"
        if problem is None and not (root / tag / COMPLETE).is_file():
            problem = f"the node of rank {layout.rank} has no checkpoint {tag} in its train.out_dir ({root}) " + (
                "and the checkpoint mirror has none either"
                if cfg.train.checkpoint_mirror
                else "(node-local disks: set train.checkpoint_mirror to resume on other nodes)"
            )
    problems: list = [None] * layout.world
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise RuntimeError(f"cannot resume from {tag}: " + "; ".join(p for p in problems if p))


def usable_latest_tag(root: Path, checksums: bool = True) -> Optional[str]:
    """The latest complete checkpoint whose files are as written; a damaged one is named and the
    previous complete one taken instead. None without any; ConfigError if all are damaged."""
    latest = latest_complete_tag(root)
    if latest is None:
        return None
    damaged = []
    for tag in [latest] + [t for t in reversed(complete_tags(root)) if t < latest]:
        problem = damage(root / tag, checksums)
        if problem is None:
            if damaged:
                _say(f"falling back to the previous complete checkpoint {root / tag}")
            return tag
        damaged.append(f"{root / tag}: {problem}")
        _say(f"checkpoint {root / tag} is damaged: {problem}")
    raise ConfigError(
        damaged
        + [
            f"no usable checkpoint in {root}: restore the damaged files, or start afresh "
            f"with train.resume=none or another train.out_dir"
        ]
    )


def _say(message: str) -> None:
    """Before logging is set up on every rank: the first rank tells the user, once."""
    if os.environ.get("RANK", "0") == "0":
        print(f"resume: {message}", file=sys.stderr, flush=True)


def write_file_list(folder: Path) -> None:
    """Size and sha256 of every file in ``folder`` (but the list and COMPLETE), so that damage
    (a truncated or rewritten shard) is found before loading, not as a traceback on every rank."""
    paths = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.name != COMPLETE and p.relative_to(folder).as_posix() != FILE_LIST
    )
    with ThreadPoolExecutor(max_workers=4) as pool:  # hashlib releases the GIL on large reads
        digests = list(pool.map(sha256_file, paths))
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests)}
    write_atomic(folder / FILE_LIST, json.dumps({"files": files}, indent=1) + "\n")


_unlisted_said = False


def damage(folder: Path, checksums: bool = True) -> Optional[str]:
    """None if every listed file has its size (and, with ``checksums``, its sha256); else what differs.
    A checkpoint of an older version has no list: it is taken as it is (said once)."""
    global _unlisted_said
    try:
        listed = json.loads((folder / FILE_LIST).read_text())["files"]
    except FileNotFoundError:
        if not _unlisted_said:
            _say(f"{folder} has no {FILE_LIST} (written by an older version): its files are not checked")
            _unlisted_said = True
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{FILE_LIST} unreadable ({exc})"
    problems = []
    for name, want in listed.items():
        try:
            size = inside(folder, name, FILE_LIST).stat().st_size
        except UnsafeName as exc:
            problems.append(str(exc))
            continue
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} were written")
        elif checksums and sha256_file(folder / name) != want["sha256"]:
            problems.append(f"{name} has another sha256 than was written")
    return "; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "") or None


def saved_config(root: Path, tag: str) -> dict:
    """The resolved config the checkpoint was written with, in today's key names."""
    return upgrade_saved(yaml.safe_load((root / tag / CONFIG_FILE).read_text()))


def saved_manifest(root: Path, tag: str) -> Optional[Manifest]:
    """The copy of the data's manifest that the checkpoint was trained on (``MANIFEST_FILE``, the data
    folder's own name); None when it is missing or unreadable."""
    try:
        return load_manifest(root / tag)
    except ShardError:
        return None


def save(
    engine,
    cfg: Config,
    step: int,
    client_state: dict,
    side_files: dict[str, str],
    copy_dirs: dict[str, Path],
    nodes: NodeLayout,
) -> str:
    """Write checkpoint ``step`` on every rank; returns its tag once it is complete. On node-local
    disks every node's first rank completes its own folder, rank 0 last."""
    root = checkpoint_root(cfg)
    tag = tag_for_step(step)
    if nodes.writes_folder:
        # Re-saving a tag (after train.resume=<older tag>): it is incomplete until rewritten.
        (root / tag / COMPLETE).unlink(missing_ok=True)
    dist.barrier()
    safe_load.allow_deepspeed_types()  # what the files hold is what a weights-only load reads back
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    layout = reshard.checkpoint_layout(engine)  # lets another world size or ZeRO stage load it
    side_files = {**side_files, LAYOUT_FILE: json.dumps(layout)}
    if nodes.writes_folder and nodes.rank != 0:
        _complete(root, tag, step, side_files, copy_dirs, cfg.train.keep_checkpoints)
    if not nodes.shared:
        dist.barrier()
    if nodes.rank == 0:
        _complete(root, tag, step, side_files, copy_dirs, cfg.train.keep_checkpoints)
    dist.barrier()
    return tag


def _complete(
    root: Path, tag: str, step: int, side_files: dict[str, str], copy_dirs: dict[str, Path], keep: int
) -> None:
    """The side files beside DeepSpeed's, the file list, COMPLETE, ``latest``; then the oldest go."""
    folder = root / tag
    for name, text in side_files.items():
        write_atomic(folder / name, text)
    for name, src in copy_dirs.items():
        copy_plain(src, folder / name)
    write_file_list(folder)
    write_atomic(folder / COMPLETE, json.dumps({"step": step}) + "\n")
    write_atomic(root / LATEST, tag)
    if keep:
        for old in complete_tags(root)[:-keep]:
            shutil.rmtree(root / old, ignore_errors=True)


def copy_plain(src: Path, dst: Path) -> None:
    """``src``'s regular files into ``dst`` (the data's tokenizer into a checkpoint): a symbolic link
    there is not followed, so nothing it points to is written into the checkpoint or its mirror. The
    preflight refuses such a tokenizer folder before the run (``tokenizer_problems``); one linked
    since is left out and named."""
    files, others = plain_files(src)
    for path in files:
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    if others:
        log.warning(
            "checkpoint %s: left out %s: not regular files (symbolic links are not followed)",
            dst.parent.name,
            ", ".join(str(p) for p in others),
        )


def tokenizer_problems(folder: Path) -> list[str]:
    """The tokenizer folder every checkpoint copies holds regular files only (``copy_plain``)."""
    return [
        f"{path}: not a regular file (a symbolic link or a special file); every checkpoint copies the data's "
        f"tokenizer folder and follows no link: put the file itself there"
        for path in plain_files(folder)[1]
    ]


def load(engine, cfg: Config, tag: str, nodes: NodeLayout) -> dict:
    """Load ``tag`` into ``engine``; a checkpoint of another world size, ZeRO stage or precision is
    converted (``reshard``, once per folder, cached beside it) and the log says so. Returns its client
    state. Weights-only, DeepSpeed's own reads too (``safe_load``); a file that is not plain data is
    refused (UnsafeCheckpoint), here too, since another node may have fetched it since it was checked."""
    root = checkpoint_root(cfg)
    problems = safe_load.code_problems(root / tag)
    if problems:
        raise safe_load.UnsafeCheckpoint("; ".join(problems))
    saved = reshard.read_layout(root / tag)
    if saved is not None and reshard.needs_conversion(saved, reshard.checkpoint_layout(engine)):
        return reshard.load_resharded(engine, root, tag, saved, converts=nodes.writes_folder)
    with safe_load.weights_only():
        path, client_state = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    return client_state or {}


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RunLock:
    """One job writes a run folder at a time: rank 0 holds a POSIX lock on ``out_dir/.lock`` for
    its whole life (the kernel drops it when the process dies, however it dies). A relaunch that
    overlaps the previous job's ranks still writing their checkpoint waits for them, up to
    ``wait_s``, then gives up with a message naming the holder."""

    def __init__(self, out_dir: str, wait_s: float = 300.0):
        path = Path(out_dir) / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, announced = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):  # not "held": no POSIX locks here
                    os.close(self._fd)
                    raise ConfigError(
                        [
                            f"train.out_dir={out_dir}: cannot lock {path} ({exc}); this filesystem "
                            "may not support POSIX locks (some NFS and Lustre mounts): put "
                            "train.out_dir on one that does"
                        ]
                    ) from exc
                holder = path.read_text().strip() or "another process"
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    raise ConfigError(
                        [
                            f"train.out_dir={out_dir}: another job ({holder}) is writing this run; "
                            f"waited {wait_s:.0f}s for it to finish"
                        ]
                    )
                if not announced:
                    print(f"train.out_dir={out_dir} is locked by {holder}: waiting up to {wait_s:.0f}s", flush=True)
                    announced = True
                time.sleep(1.0)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
