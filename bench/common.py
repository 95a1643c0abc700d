"""Helpers shared by the benchmarks in ``bench/``: sample shards, thread settings, load, tables."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]


def ensure_sample_shards(
    folder: str | os.PathLike, seq_len: int = 128, num_files: int = 4, validation_fraction: float = 0.0
) -> Path:
    """Shards of the embedded Wikipedia sample (bert-base-uncased vocabulary) in ``folder``, written
    with the real ``data_prep`` CLI (``shard`` then ``finalize``) unless its manifest already exists
    with this ``seq_len``; ``validation_fraction`` of the documents held out for evaluations.
    Returns the shard folder."""
    from data_prep.common.manifest import load_manifest
    from data_prep.sample_corpus import bert_uncased_dir, write_sample_corpus

    folder = Path(folder)
    shards = folder / (f"shards-seq{seq_len}" + (f"-val{validation_fraction}" if validation_fraction else ""))
    if (shards / "manifest.json").is_file() and load_manifest(shards).seq_len == seq_len:
        return shards
    corpus = folder / "corpus"
    if not corpus.is_dir():
        # Written beside and renamed when complete: a failure (the sample package missing, a kill)
        # leaves no half corpus for the next run to shard and fail on with another message.
        folder.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix="corpus.partial-", dir=folder))
        try:
            write_sample_corpus(partial, "txt", num_files=num_files)
            partial.rename(corpus)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    for argv in (
        [
            "shard",
            "--input",
            str(corpus),
            "--tokenizer",
            str(bert_uncased_dir()),
            "--out",
            str(shards),
            "--seq-len",
            str(seq_len),
            "--validation-fraction",
            str(validation_fraction),
        ],
        ["finalize", str(shards)],
    ):
        done = subprocess.run([sys.executable, "-m", "data_prep", *argv], cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(
                f"python -m data_prep {' '.join(argv)} failed ({done.returncode}):\n"
                f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
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


def cpu_record() -> dict:
    """Model name, the flags that decide matmul speed, whether bf16 is native (pretrain.runtime.hardware)."""
    from pretrain.runtime.hardware import cpu_info

    return cpu_info()


def auto_precision(config: str | os.PathLike, seq_len: int = 128, micro_batch: int = 32) -> tuple[str, str]:
    """What ``impl.precision=auto`` picks on this CPU for ``config``'s model, and why: the trainer's
    own decision, its step timing read from (or written to) the trainer's cache."""
    import torch

    from bench.precision_auto import build_probe
    from pretrain.runtime.hardware import resolve_precision

    return resolve_precision("auto", torch.device("cpu"), build_probe(str(config), seq_len, micro_batch))


def matmul_peak(precision: str, threads: int, seconds: float) -> tuple[float, str]:
    """Dense-matmul TFLOP/s in ``precision`` with ``threads`` threads, measured now, and its source."""
    import torch

    from pretrain.model.flops import measure_matmul_peak_tflops

    torch.set_num_threads(threads)
    value = measure_matmul_peak_tflops(
        "cpu", torch.bfloat16 if precision == "bf16" else torch.float32, seconds=seconds, clock="wall"
    )
    return value, f"measured now: 1024^2 {precision} matmul, {threads} threads, wall clock"


def matmul_peak_cpu_time(precision: str, threads: int, seconds: float, n: int = 1024) -> float:
    """The matmul peak timed by the process's CPU seconds / threads (the trainer's own way): what the
    process would reach with its threads to itself, however busy the machine is. The yardstick for
    MFU computed from tokens per CPU-second."""
    import torch

    from pretrain.model.flops import measure_matmul_peak_tflops

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measure_matmul_peak_tflops("cpu", dtype, seconds=seconds, size=n, clock="cpu")


def trainer_peak(precision: str, threads: int, scratch: str | os.PathLike) -> tuple[float, str]:
    """The peak our trainer divides by (``pretrain.runtime.hardware.peak_tflops``: measured once per machine
    and thread count, then cached), and its source. Asked against a copy of the trainer's cache in
    ``scratch``, so that a measurement taken here, on a machine that may be busy, never becomes
    the trainer's cached value."""
    import shutil

    import torch

    from pretrain.runtime.hardware import default_cache_path, peak_tflops

    torch.set_num_threads(threads)
    copy = Path(scratch) / "peak_tflops.json"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.unlink(missing_ok=True)
    if default_cache_path().is_file():
        shutil.copyfile(default_cache_path(), copy)
    value, source = peak_tflops(torch.device("cpu"), precision, cache_path=copy)
    return value, source.replace(str(copy), f"a scratch copy of {default_cache_path()}")
