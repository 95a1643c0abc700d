"""Checkpoints as this project defines them: tags, the COMPLETE marker, ``latest``, RNG state, and
the files beside DeepSpeed's own that make a checkpoint export and resume on its own.

A checkpoint counts only when complete: every rank writes its shards (DeepSpeed's ``save_checkpoint``), all
meet at a barrier, then rank 0 writes the side files, the COMPLETE marker and, last, the ``latest``
pointer. A kill anywhere before that leaves the previous checkpoint the one ``resume=auto`` finds.
Which checkpoint a run resumes from is decided here *before* any process group starts
(``resume_tag``), so a bad ``train.resume`` is an input error (exit 2), not a traceback on every rank.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import yaml

from data_prep.atomic import write_atomic
from pretrain.checkpoint import reshard
from pretrain.checkpoint.files import COMPLETE, CONFIG_FILE, LATEST, LAYOUT_FILE, LOCK_FILE
from pretrain.config.schema import Config
from pretrain.config.loader import ConfigError



def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.train.out_dir) / "checkpoints"


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(root: Path) -> list[str]:
    """Tags whose every file is on disk, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / COMPLETE).is_file())


def latest_complete_tag(root: Path) -> Optional[str]:
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if (root / tag / COMPLETE).is_file():
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def resume_tag(cfg: Config) -> Optional[str]:
    """``train.resume``: auto (latest complete, if any), none, or a tag that must be complete."""
    root = checkpoint_root(cfg)
    if cfg.train.resume == "none":
        return None
    if cfg.train.resume == "auto":
        return latest_complete_tag(root)
    tag = cfg.train.resume
    if not (root / tag / COMPLETE).is_file():
        raise ConfigError([f"train.resume={tag!r}: {root / tag} is not a complete checkpoint (complete ones: "
                           f"{', '.join(complete_tags(root)) or 'none'})"])
    return tag


def saved_config(root: Path, tag: str) -> dict:
    return yaml.safe_load((root / tag / CONFIG_FILE).read_text())


def save(engine, cfg: Config, step: int, client_state: dict, side_files: dict[str, str],
         copy_dirs: dict[str, Path]) -> str:
    """Write checkpoint ``step`` on every rank; returns its tag once it is complete."""
    root = checkpoint_root(cfg)
    tag = tag_for_step(step)
    if dist.get_rank() == 0:
        # Re-saving a tag (after train.resume=<older tag>): it is incomplete until rewritten.
        (root / tag / COMPLETE).unlink(missing_ok=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    layout = reshard.checkpoint_layout(engine)      # lets another world size or ZeRO stage load it
    if dist.get_rank() == 0:
        folder = root / tag
        for name, text in {**side_files, LAYOUT_FILE: json.dumps(layout)}.items():
            write_atomic(folder / name, text)
        for name, src in copy_dirs.items():
            shutil.copytree(src, folder / name, dirs_exist_ok=True)
        write_atomic(folder / COMPLETE, json.dumps({"step": step}) + "\n")
        write_atomic(root / LATEST, tag)
        keep = cfg.train.keep_checkpoints
        if keep:
            for old in complete_tags(root)[:-keep]:
                shutil.rmtree(root / old, ignore_errors=True)
    dist.barrier()
    return tag


def load(engine, cfg: Config, tag: str) -> dict:
    """Load ``tag`` into ``engine``; a checkpoint of another world size, ZeRO stage or precision is
    converted (``reshard``, once, cached beside it) and the log says so. Returns its client state."""
    root = checkpoint_root(cfg)
    saved = reshard.read_layout(root / tag)
    if saved is not None and reshard.needs_conversion(saved, reshard.checkpoint_layout(engine)):
        return reshard.load_resharded(engine, root, tag, saved)
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
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
        import fcntl
        import os
        import socket
        import time

        path = Path(out_dir) / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, announced = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                holder = path.read_text().strip() or "another process"
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    raise ConfigError([f"train.out_dir={out_dir}: another job ({holder}) is writing this run; "
                                       f"waited {wait_s:.0f}s for it to finish"])
                if not announced:
                    print(f"train.out_dir={out_dir} is locked by {holder}: waiting up to {wait_s:.0f}s",
                          flush=True)
                    announced = True
                time.sleep(1.0)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
