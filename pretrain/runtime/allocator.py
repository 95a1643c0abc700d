"""The ranks' CPU memory allocator: tcmalloc, preloaded by the launchers, as PyTorch's own CPU
launcher (``torch.backends.xeon.run_cpu``) does by default.

Why: torch's CPU tensors come from ``malloc``. glibc's malloc either unmaps every large block on
free (page faults on every step's logits, 10-20% of the step on the CPU) or, kept
(``impl.keep_freed_cpu_memory``), fragments its heap as blocks of varying size come and go: a rank's
memory grew from 1.95 to 4.98 GB over 300 steps of the main job (``../shared/notes/cpu-memory.md``;
benchmarks/2026-11-25-cpu-rank-memory-1000-steps.md). tcmalloc keeps freed memory in size classes: no
page faults, no such growth, and the same speed or better.

GPU ranks are left with the C library's malloc unless ``MLM_ALLOCATOR`` names one: there the host
allocator serves little more than the data loader and pinned buffers, its effect was never measured,
and tcmalloc prints a warning for every allocation over 1 GiB (pinned optimiser offload buffers).
The start line says which allocator a rank has, and why.

``MLM_ALLOCATOR`` chooses: ``tcmalloc`` (the default on the CPU), ``jemalloc``, or ``system`` (the C library's).
The library comes from the system (Debian: ``apt-get install libtcmalloc-minimal4``;
``launchers/setup_env.sh`` installs it where it can); missing, the launcher says so in one line and
the ranks run with the C library's malloc. ``LD_PRELOAD`` must be set before a process starts, so the
launchers set it for the ranks: ``pretrain.launch`` (``launchers/local.sh``, ``demo.sh``) itself, the
Slurm script through ``eval "$(python -m pretrain.runtime.allocator)"`` on each node.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

ALLOCATOR_ENV = "MLM_ALLOCATOR"
LIBRARIES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "jemalloc": ("libjemalloc.so.2",)}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
_MULTIARCH = ("x86_64-linux-gnu", "aarch64-linux-gnu", "powerpc64le-linux-gnu")


def _search_dirs() -> list[Path]:
    dirs = [Path(os.environ["CONDA_PREFIX"]) / "lib"] if os.environ.get("CONDA_PREFIX") else []
    for base in ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib"):
        dirs += [Path(base) / arch for arch in _MULTIARCH] + [Path(base)]
    return dirs


def find(allocator: str) -> Optional[str]:
    """The shared library of ``allocator`` on this machine, or None."""
    for folder in _search_dirs():
        for name in LIBRARIES.get(allocator, ()):
            if (folder / name).is_file():
                return str(folder / name)
    return None


# Device nodes of GPU drivers (NVIDIA, AMD, Intel): present where the ranks may run on GPUs.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel", "/dev/dri")


def gpu_ranks(env: dict) -> bool:
    """The ranks started with ``env`` will run on GPUs: a GPU driver here, not turned off."""
    if env.get("DS_ACCELERATOR") == "cpu" or env.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return any(os.path.exists(n) for n in GPU_DEVICE_NODES)


def preload(env: dict) -> tuple[dict, Optional[str]]:
    """``env`` with the chosen allocator in ``LD_PRELOAD`` (first), and a line to tell the user when
    it could not be (None when all is as asked). An allocator already preloaded is left alone; GPU
    ranks get none unless ``MLM_ALLOCATOR`` asks."""
    if ALLOCATOR_ENV not in env and gpu_ranks(env):
        return env, None
    wanted = env.get(ALLOCATOR_ENV, "tcmalloc")
    if wanted == "system":
        return env, None
    if wanted not in LIBRARIES:
        return env, (
            f"{ALLOCATOR_ENV}={wanted!r} is not one of tcmalloc, jemalloc, system: using the C library's malloc"
        )
    present = env.get("LD_PRELOAD", "")
    if any(name in present for names in LIBRARIES.values() for name in names):
        return env, None
    library = find(wanted)
    if library is None:
        return env, (
            f"{wanted} not found (apt-get install {PACKAGES[wanted]}, or {ALLOCATOR_ENV}=system to "
            "silence this): the ranks use the C library's malloc, which holds more memory as a run goes"
        )
    return {**env, "LD_PRELOAD": f"{library} {present}".strip()}, None


def in_use() -> str:
    """Which allocator this process runs with: tcmalloc, jemalloc, or glibc (read from its mappings)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for allocator, names in LIBRARIES.items():
        if any(name.split(".so")[0] + ".so" in maps for name in names):
            return allocator
    return "glibc"


def describe(device_type: str) -> str:
    """The allocator this rank runs with, for the start line, and why when it was not preloaded."""
    name = in_use()
    if name == "glibc" and device_type == "cuda" and ALLOCATOR_ENV not in os.environ:
        return f"glibc (not preloaded on GPU ranks, unmeasured there; {ALLOCATOR_ENV}=tcmalloc preloads it)"
    return name


def main() -> int:
    """For shell launchers: ``eval "$(python -m pretrain.runtime.allocator)"`` exports LD_PRELOAD;
    a missing library is said on stderr (once per node)."""
    env, problem = preload(dict(os.environ))
    if problem:
        print(f"allocator: {problem}", file=sys.stderr)
    if env.get("LD_PRELOAD") and env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        print(f"export LD_PRELOAD='{env['LD_PRELOAD']}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
