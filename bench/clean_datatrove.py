"""``data_prep clean``'s near-duplicate removal beside Hugging Face's datatrove (issue 74, item 3): its
MinHash pipeline (signature, buckets, cluster, filter), at its defaults and at the project's n-gram
and bands, on the corpora of ``bench/clean_near.py``: recall by edit rate, related documents removed,
documents per CPU-second and peak memory, each run its own process.

    pip install --target /tmp/datatrove "datatrove[processing]==0.10.1" spacy orjson
    python bench/clean_datatrove.py [--datatrove /tmp/datatrove] [--copies 200] [--seed 0]

datatrove goes into its own folder, as ``bench/clean_quality_model.py`` brings fastText's trainer: its
``processing`` extra pins ``xxhash<4`` against this environment's 4.1 (and lacks ``spacy`` and
``orjson``, which its word tokenizer and its readers import). Its English word tokenizer is spaCy's
blank English model, which downloads nothing. Two corpora: the first 8,000 sample articles with the
planted copies and follow-ups (recall, follow-ups removed), and the whole sample (its ten related
pairs, articles removed). Ours runs with its exact step on (datatrove's MinHash finds exact copies too)
and the language and quality steps off, one worker, as datatrove runs one task a stage here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.clean_near import CORPUS, KINDS, SHARES, follow_ups, planted, related_in_sample  # noqa: E402

# datatrove's four stages, one task each, in a process whose sys.path starts with its own folder
DATATROVE = """
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
    MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers.jsonl import JsonlWriter

corpus, work, n_grams, buckets, rows = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
config = MinhashConfig(n_grams=n_grams, num_buckets=buckets, hashes_per_bucket=rows)
def run(name, pipeline, tasks=1):
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=f"{work}/logs/{name}").run()
run("signatures", [JsonlReader(corpus), MinhashDedupSignature(output_folder=f"{work}/sigs", config=config)])
run("buckets", [MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets", config=config)],
    tasks=config.num_buckets)
run("cluster", [MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove", config=config)])
run("filter", [JsonlReader(corpus), MinhashDedupFilter(input_folder=f"{work}/remove",
    exclusion_writer=JsonlWriter(f"{work}/removed")), JsonlWriter(f"{work}/kept")])
"""


# Runs a command and prints its CPU seconds and the peak resident set of its largest process: a
# fresh parent, so that no earlier run's peak is counted.
WATCH = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, done.returncode)
sys.stderr.write(done.stderr[-3000:])
"""


def measured(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """(CPU seconds, peak resident MiB) of ``cmd``, run to a clean exit in its own process."""
    done = subprocess.run([sys.executable, "-c", WATCH, *cmd], cwd=REPO, capture_output=True, text=True, env=env)
    cpu, rss, code = done.stdout.split()
    if done.returncode or code != "0":
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{done.stderr[-3000:]}")
    return float(cpu), float(rss)


def kept_ids(folder: Path) -> set[str]:
    ids = set()
    for path in folder.rglob("*.jsonl*"):
        if path.suffix == ".gz":
            import gzip

            lines = gzip.open(path, "rt", encoding="utf-8")
        else:
            lines = open(path, encoding="utf-8")
        ids |= {json.loads(line)["id"] for line in lines if line.strip()}
    return ids


def write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datatrove", default="/tmp/datatrove", help="the folder datatrove was installed into")
    p.add_argument("--copies", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/clean-datatrove")
    args = p.parse_args()
    if not (Path(args.datatrove) / "datatrove").is_dir():
        sys.exit(f"no datatrove in {args.datatrove}: {__doc__.split(chr(10) + chr(10))[1].strip().splitlines()[0]}")
    from data_prep.sample_corpus import wiki_articles

    rng = random.Random(args.seed)
    titles, sample = zip(*wiki_articles())
    articles, material = list(sample[:CORPUS]), list(sample[CORPUS:])
    copies = planted(articles, args.copies, rng)
    follow = [(share, a, t) for share in SHARES for a, t in follow_ups(articles, material, args.copies, share, rng)]
    work = Path(args.work_dir)
    planted_corpus = write(
        work / "planted" / "corpus.jsonl",
        [{"id": f"a{i}", "text": t} for i, t in enumerate(articles)]
        + [{"id": f"c{j}", "text": t} for j, (_, _, t) in enumerate(copies)]
        + [{"id": f"f{j}", "text": t} for j, (_, _, t) in enumerate(follow)],
    )
    sample_corpus = write(work / "sample" / "corpus.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(sample)])
    pairs = related_in_sample(list(sample))
    n_docs = {"planted": len(articles) + len(copies) + len(follow), "sample": len(sample)}

    def datatrove(n: int, bands: int, rows: int):
        env = {**os.environ, "PYTHONPATH": args.datatrove}
        out = {}
        for name, corpus in (("planted", planted_corpus), ("sample", sample_corpus)):
            run_dir = work / f"datatrove-{n}-{bands}x{rows}" / name
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            cpu, rss = measured(
                [sys.executable, "-c", DATATROVE, str(corpus), str(run_dir), str(n), str(bands), str(rows)], env
            )
            out[name] = (kept_ids(run_dir / "kept"), cpu, rss)
        return out

    def ours():
        out = {}
        for name, corpus in (("planted", planted_corpus), ("sample", sample_corpus)):
            run_dir = work / "ours" / name
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            cmd = [sys.executable, "-m", "data_prep", "clean", "--input", str(corpus), "--out", str(run_dir)]
            cmd += ["--workers", "1", "--set", "quality.enabled=false", "--set", "language.keep="]
            cpu, rss = measured(cmd)
            out[name] = (kept_ids(run_dir), cpu, rss)
        return out

    runs = {
        "datatrove, its defaults (5-grams, 14 x 8)": datatrove(5, 14, 8),
        "datatrove at our n-gram and bands (3-grams, 40 x 3; it has no agreement check)": datatrove(3, 40, 3),
        "ours (3-grams, 40 x 3, 42% agreement)": ours(),
    }
    header = ["run", *KINDS, "follow-ups removed", "sample articles removed", "related pairs split"]
    header += ["documents/CPU-s", "peak MiB"]
    print(f"{n_docs['planted']:,} planted-corpus documents, {n_docs['sample']:,} sample articles; one process each\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, out in runs.items():
        kept, cpu_p, rss_p = out["planted"]
        kept_s, cpu_s, rss_s = out["sample"]
        recall = []
        for kind in KINDS:
            members = [(f"c{j}", f"a{i}") for j, (k, i, _) in enumerate(copies) if k == kind]
            recall.append(sum(not (c in kept and o in kept) for c, o in members) / len(members))
        # a follow-up removed, or its story removed for it (not for a planted copy of the story)
        copied = {f"a{i}" for _, i, _ in copies}
        lost = sum(
            f"f{j}" not in kept or (f"a{a}" not in kept and f"a{a}" not in copied) for j, (_, a, _) in enumerate(follow)
        )
        removed = len(sample) - len(kept_s)
        split = sum(not (f"a{i}" in kept_s and f"a{j}" in kept_s) for i, j, _ in pairs)
        rate = (n_docs["planted"] + n_docs["sample"]) / (cpu_p + cpu_s)
        row = [name, *(f"{r:.3f}" for r in recall), str(lost), str(removed), f"{split} of {len(pairs)}"]
        print("| " + " | ".join(row + [f"{rate:,.0f}", f"{max(rss_p, rss_s):,.0f}"]) + " |")


if __name__ == "__main__":
    main()
