"""The one way this project writes a file that must never be seen half-written.

Write to a temporary name unique to this process and thread in the same folder, fsync, then
``os.replace`` (atomic on POSIX). Readers see the old file or the new one; a kill at any moment
leaves at worst a stray ``*.tmp*`` file, never a truncated target. Both ``data_prep`` (shards'
manifests, progress records) and ``pretrain`` (checkpoint markers, run ids, caches) use it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def json_bytes(obj) -> bytes:
    """How this project writes a JSON file: indented, one trailing newline."""
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_atomic(path, json_bytes(obj))
