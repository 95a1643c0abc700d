"""``data_prep clean`` as stages at growing corpus sizes: documents per second per core at K = 1 and
K = 2 signature tasks, and the clusters stage's time and peak memory against the number of documents.

    python bench/clean_scale.py [--sizes 100000,300000,1000000] [--work-dir /tmp/clean-scale]

The corpus: the embedded sample's articles repeated with 30% of their words replaced (distinct
documents: no two share an LSH band more than by chance), and in every 100 documents 5 exact copies
and 5 copies with 2% of their words changed of earlier ones. Signatures run with the language and
quality steps off (they cost the same per document at any size) and slices of 65,536 keys (a corpus
of a billion documents at the default 4 Mi keys takes ~250 slices; these take 2-15) and groups of
8 Mi characters (a stage holds one group at a time: fixed groups leave what grows with the corpus);
each stage is its own
``python -m data_prep clean --stage ...`` process, timed from outside, its peak memory read from
``/usr/bin/time``-style rusage (``ru_maxrss`` of the child).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SLICE_KEYS = 1 << 16  # small, so that these corpora take many slices, as a billion documents would
GROUP_CHARS = 1 << 23  # groups of ~17,000 documents whatever the corpus size (the default's are 8x)


def write_corpus(folder: Path, n: int, files: int = 8) -> list[Path]:
    from data_prep.sample_corpus import wiki_articles

    texts = [x for _, x in wiki_articles()]
    pool = sorted({w for x in texts[:2000] for w in x.split() if w.isalpha()})
    rng = random.Random(n)
    partial = folder.with_name(folder.name + ".partial")  # renamed when complete: a kill leaves no half corpus
    subprocess.run(["rm", "-rf", str(partial)])
    partial.mkdir(parents=True)
    paths = [partial / f"c{i:02d}.jsonl" for i in range(files)]
    handles = [open(p, "w", encoding="utf-8") for p in paths]
    made: list[str] = []
    for i in range(n):
        slot = i % 100
        if slot < 5 and made:
            text = rng.choice(made)
        elif slot < 10 and made:
            words = rng.choice(made).split(" ")
            for j in rng.sample(range(len(words)), max(1, len(words) // 50)):
                words[j] = rng.choice(pool)
            text = " ".join(words)
        else:
            words = texts[i % len(texts)].split(" ")
            for j in rng.sample(range(len(words)), max(1, 3 * len(words) // 10)):
                words[j] = rng.choice(pool)
            text = " ".join(words)
            if len(made) < 5000:
                made.append(text)
        handles[i % files].write(json.dumps({"id": i, "text": text}) + "\n")
    for h in handles:
        h.close()
    partial.rename(folder)
    return [folder / p.name for p in paths]


def stage(folder: Path, out: Path, name: str, tasks: int, task: int | None, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "data_prep",
        "clean",
        "--input",
        str(folder),
        "--out",
        str(out),
        "--stage",
        name,
        "--num-tasks",
        str(tasks),
        "--workers",
        "1",
        "--languages",
        "any",
        "--set",
        "quality.enabled=false",
        "--set",
        f"slice_keys={SLICE_KEYS}",
        "--group-chars",
        str(GROUP_CHARS),
        *extra,
    ]
    if task is not None:
        cmd += ["--task-index", str(task)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_all(procs: list[subprocess.Popen]) -> tuple[float, int]:
    """(seconds, peak MiB of the largest child) for processes started together."""
    t0 = time.perf_counter()
    peak = 0
    for p in procs:
        _, status, usage = __import__("os").wait4(p.pid, 0)
        if status != 0:
            raise SystemExit(f"{p.args} failed:\n{p.stderr.read()[-3000:]}")
        peak = max(peak, usage.ru_maxrss // 1024)
    return time.perf_counter() - t0, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,300000,1000000")
    ap.add_argument("--work-dir", default="/tmp/clean-scale")
    args = ap.parse_args()
    work = Path(args.work_dir)
    print(
        f"{'documents':>10} {'K':>2} {'signatures s':>13} {'docs/s/core':>12} {'clusters s':>11} {'clusters MiB':>13} "
        f"{'filter s':>9} {'removed exact/near':>19}"
    )
    for n in map(int, args.sizes.split(",")):
        corpus = work / f"corpus-{n}"
        if not corpus.is_dir():
            write_corpus(corpus, n)
        for k in (1, 2):
            out = work / f"out-{n}-k{k}"
            subprocess.run(["rm", "-rf", str(out)])
            sig_s, _ = wait_all([stage(corpus, out, "signatures", k, t) for t in range(k)])
            clu_s, clu_mib = wait_all([stage(corpus, out, "clusters", k, None)])
            fil_s, _ = wait_all([stage(corpus, out, "filter", k, t) for t in range(k)])
            report = json.loads((out / "report.json").read_text())
            removed = report["removed"]
            print(
                f"{n:>10,} {k:>2} {sig_s:>13.1f} {n / sig_s / k:>12,.0f} {clu_s:>11.1f} {clu_mib:>13,} {fil_s:>9.1f} "
                f"{removed.get('exact_duplicate', {}).get('documents', 0):>9,}/"
                f"{removed.get('near_duplicate', {}).get('documents', 0):<9,}",
                flush=True,
            )
    print(f"(peak memory: the clusters process's ru_maxrss; this machine: {resource.getpagesize()} B pages)")


if __name__ == "__main__":
    main()
