"""Names that others can write, joined to a local folder: each is a plain relative path inside it.

A manifest's shard and tokenizer names, a checkpoint's ``file_list.json``, a mirror's listings and a
bucket's keys come from files whoever can write a data folder, a run folder or a bucket controls.
Joined as given, ``../../x`` or ``/etc/x`` would read or write outside the folder: ``inside`` refuses
such a name (``UnsafeName``, naming it), and a path that a symbolic link leads out of. A folder the
project copies or uploads whole (the tokenizer into a checkpoint, an export to a mirror) is walked by
``plain_files``, which follows no link: a link there is named, never read through."""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Optional


class UnsafeName(ValueError):
    """A name read from a file or a listing that would lead outside its folder."""


def name_problem(name: object) -> Optional[str]:
    """Why ``name`` is not a plain relative path (``a/b.tar``), or None: empty, absolute, ``..`` or
    ``.`` parts, empty parts (``a//b``), a backslash or a NUL."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\0" in name or "\\" in name:
        return "a name with a NUL or a backslash"
    if PurePosixPath(name).is_absolute():
        return "an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "a path with '..', '.' or empty parts"
    return None


def check_name(name: object, what: str) -> str:
    """``name`` itself when it is a plain relative path; else UnsafeName saying ``what`` it came from."""
    problem = name_problem(name)
    if problem:
        raise UnsafeName(f"{what}: {name!r} is {problem}, not a name inside its folder")
    return name  # type: ignore[return-value]


def inside(folder: Path, name: object, what: str) -> Path:
    """``folder / name``, refused (UnsafeName) unless ``name`` is a plain relative path and no
    symbolic link on the way leads out of ``folder``."""
    target = Path(folder) / check_name(name, what)
    if not target.resolve().is_relative_to(Path(folder).resolve()):
        raise UnsafeName(f"{what}: {name!r} leads out of {folder} through a symbolic link")
    return target


def plain_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(the regular files under ``folder``, sorted; everything else under it, sorted: symbolic links to
    files or folders, which are not followed, and FIFOs, sockets and devices, which are not read).
    What ``folder`` holds is copied or uploaded from the first list only, so nothing a link points
    to (``~/.aws/credentials``, another run) leaves with it."""
    if Path(folder).is_symlink():
        return [], [Path(folder)]
    files: list[Path] = []
    others: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):  # does not descend into linked folders
        base = Path(dirpath)
        others += [base / d for d in dirnames if (base / d).is_symlink()]
        for name in filenames:
            path = base / name
            (files if stat.S_ISREG(path.lstat().st_mode) else others).append(path)
    return sorted(files), sorted(others)
