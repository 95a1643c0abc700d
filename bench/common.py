"""Helpers shared by the benchmarks in ``bench/``: sample shards, thread settings, load, tables."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]


def ensure_sample_shards(folder: str | os.PathLike, seq_len: int = 128, num_files: int = 4) -> Path:
    """Shards of the embedded Wikipedia sample (bert-base-uncased vocabulary) in ``folder``, written
    with the real ``data_prep`` CLI (``shard`` then ``finalize``) unless its manifest already exists
    with this ``seq_len``. Returns the shard folder."""
    import json

    from data_prep.sample_corpus import bert_uncased_dir, write_sample_corpus

    folder = Path(folder)
    shards = folder / f"shards-seq{seq_len}"
    manifest = shards / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("seq_len") == seq_len:
        return shards
    corpus = folder / "corpus"
    write_sample_corpus(corpus, "txt", num_files=num_files)
    for argv in (["shard", "--input", str(corpus), "--tokenizer", str(bert_uncased_dir()), "--out", str(shards),
                  "--seq-len", str(seq_len)],
                 ["finalize", str(shards)]):
        done = subprocess.run([sys.executable, "-m", "data_prep", *argv], cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"python -m data_prep {' '.join(argv)} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return shards


def thread_env(threads: int, base: dict | None = None) -> dict:
    """Environment for a child process limited to ``threads`` intra-op threads (OpenMP and MKL read
    these at start; torch takes its default thread count from OMP_NUM_THREADS)."""
    env = dict(os.environ if base is None else base)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table with columns padded to their widest cell (reads well in a terminal too)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# ---------------------------------------------------------------- the machine
# Until ``pretrain.hardware`` (cpu_info, resolve_precision, peak_tflops) is on main, these fall back
# to the same questions asked here; the benchmarks call only these three.
_RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_record() -> dict:
    """Model name, the flags that decide matmul speed, and whether bf16 is native."""
    try:
        from pretrain.hardware import cpu_info
        return cpu_info()
    except ImportError:
        pass
    import torch

    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return {"model": model, "flags": [f for f in _RELEVANT_FLAGS if f in flags],
            "native_bf16": bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())}


def auto_precision() -> tuple[str, str]:
    """What ``impl.precision=auto`` picks on this CPU, and why."""
    try:
        import torch

        from pretrain.hardware import resolve_precision
        return resolve_precision("auto", torch.device("cpu"))
    except ImportError:
        pass
    if cpu_record()["native_bf16"]:
        return "bf16", "the CPU has native bf16 (avx512_bf16 or AMX)"
    return "fp32", "no native bf16 on this CPU (bf16 would be emulated, ~50x slower)"


def matmul_peak(precision: str, threads: int, seconds: float) -> tuple[float, str]:
    """Dense-matmul TFLOP/s in ``precision`` with ``threads`` threads, measured now, and its source."""
    import torch

    from pretrain.flops import measure_matmul_peak_tflops

    torch.set_num_threads(threads)
    value = measure_matmul_peak_tflops("cpu", torch.bfloat16 if precision == "bf16" else torch.float32,
                                       seconds=seconds)
    return value, f"measured now: 1024^2 {precision} matmul, {threads} threads"
