"""``data_prep clean`` as Slurm would run it, at growing corpus sizes and near-copy shares: time and
peak memory per task of every stage, with the number of array tasks growing with the corpus.

    python bench/clean_scale.py [--sizes 1000000,3000000,10000000] [--near 0.1,0.4] \
        [--docs-per-task 500000] [--parallel 2] [--work-dir /tmp/clean-scale]

The corpus: the embedded sample's articles repeated with 30% of their words replaced (distinct
documents: no two share an LSH band more than by chance); in every 100 documents 5 exact copies
and ``100 * near`` copies with 2% of their words changed, each of one of the last 50,000 distinct
documents (a crawl's near copies are of many pages, not of a few). K = ceil(documents /
docs-per-task) tasks in every array stage, ``--parallel`` of them at a time (this machine's cores);
each task is its own ``python -m data_prep clean --stage ...`` process, one worker. Signatures run
with the language and quality steps off (they cost the same per document at any size), slices of
65,536 keys (a billion documents at the default 4 Mi keys take ~250 slices; these take 16-150) and
groups of 8 Mi characters (~17,000 documents).

``--one-job-tree DIR`` (the tree from before the split: ``mkdir DIR && git archive ab09f23 | tar -x -C DIR``) also
runs that tree's stages on the same corpus (signatures, the one clusters job, filter): the
one-job clusters stage side by side with the exact, pairs and join stages that replace it.
``--join-tree DIR`` (an older tree, e.g. bb53f38's, unpacked into DIR the same way) runs that tree's
join on the same work files just before ours: its time and memory beside ours, and whether the two
wrote the same decisions, byte for byte.

Memory per task: the peak of its resident anonymous memory (``RssAnon``, sampled every 20 ms: the
heap, what a task must be given) and its peak resident set (``ru_maxrss``, which also counts pages of
the memory-mapped key files: reclaimable cache). The join (clusters) is also given per near copy
removed and per confirmed pair: its peak anonymous memory over each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SLICE_KEYS = 1 << 16  # small, so that these corpora take many slices, as a billion documents would
GROUP_CHARS = 1 << 23  # groups of ~17,000 documents whatever the corpus size (the default's are 8x)
RECENT = 50_000  # near copies are of one of the last RECENT distinct documents
ARRAYS = ("signatures", "exact", "pairs")


def write_corpus(folder: Path, n: int, near: float, files: int = 8) -> None:
    from data_prep.sample_corpus import wiki_articles

    texts = [x.split(" ") for _, x in wiki_articles()]
    pool = sorted({w for x in texts[:2000] for w in x if w.isalpha()})
    rng = random.Random(n)
    partial = folder.with_name(folder.name + ".partial")  # renamed when complete: a kill leaves no half corpus
    subprocess.run(["rm", "-rf", str(partial)])
    partial.mkdir(parents=True)
    handles = [open(partial / f"c{i:02d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    recent: deque[list[str]] = deque(maxlen=RECENT)
    near_slots = 5 + round(100 * near)
    for i in range(n):
        slot = i % 100
        if slot < 5 and recent:
            words = rng.choice(recent)
        elif slot < near_slots and recent:
            words = list(rng.choice(recent))
            for j in rng.sample(range(len(words)), max(1, len(words) // 50)):
                words[j] = rng.choice(pool)
        else:
            words = list(texts[i % len(texts)])
            for j in rng.sample(range(len(words)), max(1, 3 * len(words) // 10)):
                words[j] = rng.choice(pool)
            recent.append(words)
        handles[i % files].write(json.dumps({"id": i, "text": " ".join(words)}) + "\n")
    for h in handles:
        h.close()
    partial.rename(folder)


def command(folder: Path, out: Path, name: str, tasks: int, task: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "data_prep", "clean", "--input", str(folder), "--out", str(out)]
    cmd += ["--stage", name, "--num-tasks", str(tasks), "--workers", "1", "--languages", "any"]
    cmd += ["--set", "quality.enabled=false", "--set", f"slice_keys={SLICE_KEYS}", "--group-chars", str(GROUP_CHARS)]
    return cmd + ([] if task is None else ["--task-index", str(task)])


def run_task(cmd: list[str], cwd: Path = REPO) -> tuple[float, int, int]:
    """(seconds, peak anonymous MiB sampled, peak resident MiB) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon = [0]
    done = threading.Event()

    def sample():
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak_anon[0] = max(peak_anon[0], int(line.split()[1]))
            except (FileNotFoundError, ProcessLookupError):
                return
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    sampler.join()
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read()[-3000:]}")
    return time.perf_counter() - t0, peak_anon[0] // 1024, usage.ru_maxrss // 1024


def run_stage(cmds: list[list[str]], parallel: int, cwd: Path = REPO) -> dict:
    """Every task of a stage, ``parallel`` at a time: wall seconds, and the slowest task's seconds and
    the largest peaks over the tasks."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(lambda c: run_task(c, cwd), cmds))
    return {
        "wall": time.perf_counter() - t0,
        "task_s": max(r[0] for r in results),
        "anon": max(r[1] for r in results),
        "rss": max(r[2] for r in results),
    }


def confirmed_pairs(out: Path) -> int:
    return sum(len(np.load(p)["pairs"]) for p in out.glob(".clean/*/pairs-*.npz"))


def decisions(out: Path) -> dict[str, bytes]:
    """The join's files (decisions.json and .npz), by name."""
    return {p.name: p.read_bytes() for p in sorted(out.glob(".clean/*/decisions.*"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000000,3000000,10000000")
    ap.add_argument("--near", default="0.1,0.4", help="shares of near copies")
    ap.add_argument("--docs-per-task", type=int, default=500_000)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--work-dir", default="/tmp/clean-scale")
    ap.add_argument("--one-job-tree", help="a checkout with the one-job clusters stage, run on the same corpora")
    ap.add_argument("--join-tree", help="an older checkout whose join (clusters) runs on the same work files")
    args = ap.parse_args()
    work = Path(args.work_dir)
    print(
        f"{'documents':>10} {'near':>4} {'K':>3} | {'stage':>10} {'wall s':>7} {'task s':>7} {'anon MiB':>8} "
        f"{'RSS MiB':>8} | removed exact/near, confirmed pairs, the join's heap a near copy and a pair",
        flush=True,
    )
    for n in map(int, args.sizes.split(",")):
        for near in map(float, args.near.split(",")):
            corpus = work / f"corpus-{n}-{near:g}"
            if not corpus.is_dir():
                write_corpus(corpus, n, near)
            k = -(-n // args.docs_per_task)
            out = work / f"out-{n}-{near:g}"
            subprocess.run(["rm", "-rf", str(out)])
            rows = {}
            same_join = None
            for name in (*ARRAYS, "clusters", "filter"):
                tasks = [None] if name == "clusters" else range(k)
                if name == "clusters" and args.join_tree:
                    rows["old join"] = run_stage([command(corpus, out, name, k, None)], 1, Path(args.join_tree))
                    theirs = decisions(out)
                rows[name] = run_stage([command(corpus, out, name, k, t) for t in tasks], args.parallel)
                if name == "clusters" and args.join_tree:
                    same_join = decisions(out) == theirs
            removed = json.loads((out / "report.json").read_text())["removed"]
            pairs = confirmed_pairs(out)
            near_removed = removed.get("near_duplicate", {}).get("documents", 0)
            per_copy = rows["clusters"]["anon"] * 2**20 / max(near_removed, 1)
            per_pair = rows["clusters"]["anon"] * 2**20 / max(pairs, 1)
            tail = (
                f"{removed.get('exact_duplicate', {}).get('documents', 0):,}/"
                f"{near_removed:,}, {pairs:,} pairs, {per_copy:,.0f} / {per_pair:,.0f} B"
            )
            if same_join is not None:
                tail += f"; the old join's decisions {'identical' if same_join else 'DIFFER'}"
            if args.one_job_tree:
                tree, old_out = Path(args.one_job_tree), work / f"one-job-{n}-{near:g}"
                subprocess.run(["rm", "-rf", str(old_out)])
                for name in ("signatures", "clusters", "filter"):
                    tasks = [None] if name == "clusters" else range(k)
                    r = run_stage([command(corpus, old_out, name, k, t) for t in tasks], args.parallel, tree)
                    rows[f"one-job {name}" if name == "clusters" else f"one-job {name[:3]}"] = r
                same = (old_out / "report.json").read_bytes() == (out / "report.json").read_bytes()
                tail += f"; one-job report {'identical' if same else 'DIFFERS'}"
                subprocess.run(["rm", "-rf", str(old_out)])
            for name, r in rows.items():
                print(
                    f"{n:>10,} {near:>4g} {k:>3} | {name:>10} {r['wall']:>7.1f} {r['task_s']:>7.1f} {r['anon']:>8,} "
                    f"{r['rss']:>8,} | {tail if name == 'clusters' else ''}",
                    flush=True,
                )
            subprocess.run(["rm", "-rf", str(out), str(corpus)])  # 10M documents: ~15 GB with the work files


if __name__ == "__main__":
    main()
