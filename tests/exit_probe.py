"""Runs a module as ``python -m MODULE ARGS`` would, and writes down the native threads still alive if
the interpreter's final teardown runs (after atexit): the moment gloo's threads were torn down with
the process groups at the end of a ZeRO-3 run, which aborted now and then.

    python tests/exit_probe.py [--local_rank=N] MODULE ARGS...     (EXIT_PROBE_DIR=folder)

Writes ``EXIT_PROBE_DIR/teardown-rank<RANK>.txt`` with one thread name per line (the main thread's
included) when the teardown runs; nothing when the process ends before it.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def native_threads(listdir=os.listdir, open_=open) -> list[bytes]:
    """Bytes: text decoding no longer works that late in the teardown."""
    names = []
    for task in sorted(listdir("/proc/self/task")):
        try:
            with open_(f"/proc/self/task/{task}/comm", "rb") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


class TeardownProbe:
    """Freed when the interpreter clears this module at its final teardown; it holds what it needs,
    since the module's other names may be gone by then."""

    def __init__(self, path: Path):
        self.path, self.native_threads, self.open = str(path), native_threads, open

    def __del__(self):
        with self.open(self.path, "wb") as f:
            f.write(b"\n".join(self.native_threads()) + b"\n")


# Held by the sys module, whose namespace the teardown clears last: this module's own may never be
# cleared (a module that is gone while frozen functions still hold its globals is skipped).
sys.exit_probe = TeardownProbe(Path(os.environ["EXIT_PROBE_DIR"]) / f"teardown-rank{os.environ.get('RANK', '0')}.txt")

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launcher adds it
    sys.argv = [args[0], *args[1:]]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
