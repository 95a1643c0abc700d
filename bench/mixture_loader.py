"""The training loader's throughput on a 3-source mixture against one source, side by side in one run.

    python bench/mixture_loader.py [--steps 100] [--rounds 3] [--global-batch 256] [--micro-batch 32]

Data: the embedded Wikipedia sample (bert-base-uncased, 128 tokens) written by the real ``data_prep``
CLI twice: once as one folder of all 4 corpus files (the one source: ``pretrain.data.stream.TrainStream``,
what a run without ``data.sources`` reads) and once as three folders of its files 0-1, 2 and 3 (the
mixture: ``pretrain.data.mixture.MixtureStream``, weights 0.5/0.3/0.2). Same text, same sequences per
step; the mixture adds the apportionment, three block orders and three readers.

Each variant iterates rank 0 of a 1-rank job (the work one rank's loader does per step, all its
micro-batches) for ``--steps`` global steps after 5 of warm-up (about 3 epochs of the text), in the calling process (no workers:
the loader's own cost, not the DataLoader's process pool). Rounds alternate the variants; the best
round counts, in wall and in CPU time (the machine may be shared: CPU time says more there). Target: the mixture no more than 5% slower.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import ensure_sample_shards, format_table
from data_prep.common.manifest import load_manifest
from data_prep.sample_corpus import bert_uncased_dir
from pretrain.data.mixture import MixtureStream, Source
from pretrain.data.stream import TrainStream

SLICES = (("a", ["wiki-00.txt", "wiki-01.txt"], 0.5), ("b", ["wiki-02.txt"], 0.3), ("c", ["wiki-03.txt"], 0.2))


def three_sources(work: Path, seq_len: int) -> list[Source]:
    corpus = work / "corpus"  # written by ensure_sample_shards
    sources = []
    for name, files, weight in SLICES:
        out = work / f"mix-seq{seq_len}-{name}"
        if not (out / "manifest.json").is_file():
            for argv in (
                [
                    "shard",
                    "--input",
                    *[str(corpus / f) for f in files],
                    "--tokenizer",
                    str(bert_uncased_dir()),
                    "--out",
                    str(out),
                    "--seq-len",
                    str(seq_len),
                    "--validation-fraction",
                    "0",
                ],
                ["finalize", str(out)],
            ):
                subprocess.run([sys.executable, "-m", "data_prep", *argv], cwd=REPO, check=True, capture_output=True)
        sources.append(Source(name, str(out), weight))
    return sources


def time_stream(stream, steps: int, warmup: int = 5) -> tuple[float, float]:
    """(wall, CPU) seconds for ``steps`` global steps of rank 0's micro-batches, after ``warmup`` steps
    (a run's start-up: opening and indexing the shards, the first block orders)."""
    it = iter(stream)
    for _ in range(warmup * stream.grad_accum):
        next(it)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps * stream.grad_accum):
        next(it)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "mlm-bench-mixture"))
    args = p.parse_args(argv)
    work = Path(args.work)
    one = ensure_sample_shards(work, seq_len=args.seq_len)
    sources = three_sources(work, args.seq_len)
    g, mb = args.global_batch, args.micro_batch

    def single():
        return TrainStream(one, load_manifest(one), "train", 0, 1, mb, g, 1234)

    def mixed():
        return MixtureStream(sources, [load_manifest(s.dir) for s in sources], "train", 0, 1, mb, g, 1234)

    torch.set_num_threads(1)  # one rank's loader thread; the machine may be shared
    inf = (float("inf"), float("inf"))
    best = {"1 source (TrainStream)": inf, "3 sources (MixtureStream)": inf}
    for r in range(args.rounds):
        order = list(zip(best, (single, mixed)))
        for label, make in order if r % 2 == 0 else order[::-1]:
            wall, cpu = time_stream(make(), args.steps)
            best[label] = (min(best[label][0], wall), min(best[label][1], cpu))
    rows = [
        (label, f"{args.steps * g / wall:,.0f}", f"{wall / args.steps * 1e3:.1f}", f"{cpu / args.steps * 1e3:.1f}")
        for label, (wall, cpu) in best.items()
    ]
    print(format_table(["loader", "sequences/s (wall)", "ms per step (wall)", "CPU ms per step"], rows))
    (one_w, one_c), (mix_w, mix_c) = best.values()
    print(
        f"mixture / one source: wall {mix_w / one_w:.3f} ({(mix_w / one_w - 1) * 100:+.1f}%), CPU {mix_c / one_c:.3f} "
        f"({(mix_c / one_c - 1) * 100:+.1f}%); target <= +5%"
    )
    print(
        f"{args.steps} steps of {g} sequences of {args.seq_len} tokens, micro-batch {mb}, best of {args.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
