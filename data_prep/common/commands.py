"""Commands printed for a user to copy: each is quoted for a POSIX shell and names the interpreter
(or the console script beside it) that is running now, so that it works when pasted into the same
shell whether or not the virtual environment is activated and whether paths are relative or absolute."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def _program(path: str, name: str) -> str:
    """``name`` when the shell's PATH finds this very file, else its absolute path: a script may have
    changed directory (``demo.sh`` runs from the repository root) and the user's shell has not."""
    found = shutil.which(name)
    if found and os.path.abspath(found) == os.path.abspath(path):
        return name
    return os.path.abspath(path)


def shown(*argv: str) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def location(where: str | os.PathLike) -> str:
    """A URL as it is; a local path made absolute, so that a pasted command finds it from anywhere."""
    where = str(where)
    return where if "://" in where else os.path.abspath(where)


def python_command(module: str, *args: str | os.PathLike) -> str:
    """``python -m MODULE ARGS...`` with this process's interpreter."""
    return shown(_program(sys.executable, "python"), "-m", module, *map(str, args))


def script_command(script: str, *args: str | os.PathLike) -> str:
    """A console script installed beside this interpreter (``mlflow``), or by name when there is none."""
    beside = Path(sys.executable).parent / script
    program = _program(str(beside), script) if beside.exists() else script
    return shown(program, *map(str, args))
