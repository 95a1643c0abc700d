"""The learned quality filter of ``data_prep clean``: how well a model of ``quality-model train`` tells
good text from bad on documents it never saw, what it costs per document, and what it takes from
clean Wikipedia; beside fastText's own trainer (``fasttext-numpy2-wheel``) when one is given.

    python bench/clean_quality_model.py [--fasttext-dir DIR] [--work-dir /tmp/clean-quality]
    python bench/clean_quality_model.py --at-scale 200000 [--fasttext-dir DIR]   # the trainer at scale

DIR: ``pip install --no-deps --target DIR fasttext-numpy2-wheel`` (not installable beside
``fasttext-predict``: the same ``fasttext`` module; loaded from DIR in a child process).

Data: the embedded sample's articles, split in two halves: the second half and as many generated
negatives (boilerplate, spam, shuffled articles: ``sample_corpus.low_quality_documents``) train;
the first half and 5,000 other generated documents are the held-out labelled set. Then
``data_prep clean`` over the first half (language and quality rules on, one worker) without and
with the model at threshold 0.5: documents per second per core, and the share of the articles the
model removes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FASTTEXT_CHILD = """
import sys, time, json
sys.path.insert(0, sys.argv[1])
import fasttext
t0 = time.perf_counter()
m = fasttext.train_supervised(input=sys.argv[2], wordNgrams=2, dim=32, bucket=1000000, epoch=5, lr=0.1, thread=1,
                              verbose=0)
seconds = time.perf_counter() - t0
m.save_model(sys.argv[3])
print(json.dumps({"seconds": seconds}))
"""


def held_out_scores(predict, held: list[tuple[str, bool]]) -> tuple[float, float, float]:
    scored = [(predict(text) >= 0.5, positive) for text, positive in held]
    tp = sum(s and p for s, p in scored)
    return tp / max(1, sum(s for s, _ in scored)), tp / sum(p for _, p in scored), len(held) / sum(p for _, p in held)


def fasttext_predict(path: Path):
    """What ``data_prep clean`` scores a document with (``fasttext-predict``, its lines joined)."""
    from data_prep.clean.document import QualityScorer

    return QualityScorer(str(path), "__label__hq")


def clean_rate(inputs: Path, out: Path, *extra: str) -> tuple[float, dict]:
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, "-m", "data_prep", "clean", "--input", str(inputs), "--out", str(out), "--workers", "1"]
    t0 = time.perf_counter()
    subprocess.run([*cmd, *extra], cwd=REPO, check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    return seconds, json.loads((out / "report.json").read_text())


FASTTEXT_CPU_CHILD = """
import sys, time, json, resource
sys.path.insert(0, sys.argv[1])
import fasttext
m = fasttext.train_supervised(input=sys.argv[2], wordNgrams=2, dim=32, bucket=1000000, epoch=5, lr=0.1, thread=1,
                              verbose=0)
print(json.dumps({"cpu": resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime}))
"""


def at_scale(work: Path, per_label: int, fasttext_dir: str | None) -> None:
    """``per_label`` documents a label: positives of 3-10 sentences drawn from the embedded articles,
    negatives made from them (``--negative generated``'s kinds), both as JSONL files. Our command at
    its defaults (``--epochs auto --lr auto``) against fastText's trainer at its defaults (5 epochs,
    lr 0.1, one thread) over the same files: CPU seconds of the whole process, reading included."""
    import random
    import re

    from data_prep.clean.negatives import NegativeMaker
    from data_prep.clean.quality_model import one_line
    from data_prep.sample_corpus import wiki_articles

    rng = random.Random(0)
    sentences = [x for _, t in wiki_articles() for x in re.split(r"(?<=[.!?])\s+", t) if len(x.split()) >= 5]
    pos = [" ".join(rng.sample(sentences, rng.randint(3, 10))) for _ in range(per_label)]
    neg = [x for x, _ in NegativeMaker(pos, 1).make(per_label)]
    files = {}
    for name, texts in (("positive", pos), ("negative", neg)):
        files[name] = work / f"{name}-{per_label}.jsonl"
        files[name].write_text("".join(json.dumps({"text": x}) + "\n" for x in texts), encoding="utf-8")
    cmd = [sys.executable, "-m", "data_prep", "quality-model", "train", "--positive", str(files["positive"])]
    cmd += ["--negative", str(files["negative"]), "--out", str(work / "scale.bin")]
    before, t0 = os.times(), time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
    after, wall = os.times(), time.perf_counter() - t0
    ours = after.children_user + after.children_system - before.children_user - before.children_system
    print(
        f"{per_label:,} documents a label; ours, at its defaults (one process a core): {ours:.0f} CPU s, {wall:.0f} s"
    )
    print("  " + "\n  ".join(out.strip().splitlines()))
    if fasttext_dir:
        data = work / f"scale-{per_label}.txt"
        with open(data, "w", encoding="utf-8") as f:
            for label, texts in (("__label__hq", pos), ("__label__cc", neg)):
                f.writelines(f"{label} {one_line(x)}\n" for x in texts)
        child = [sys.executable, "-c", FASTTEXT_CPU_CHILD, fasttext_dir, str(data)]
        t0 = time.perf_counter()
        theirs = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)["cpu"]
        took = time.perf_counter() - t0
        print(
            f"  fastText's trainer, 5 epochs at 0.1 on all {2 * per_label:,}, one thread: {theirs:.0f} CPU s, "
            f"{took:.0f} s; ours {ours / theirs:.2f}x its CPU time, {wall / took:.2f}x its wall time"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fasttext-dir", help="a --target folder of fasttext-numpy2-wheel, to compare its trainer")
    ap.add_argument("--work-dir", default="/tmp/clean-quality")
    ap.add_argument(
        "--at-scale", type=int, metavar="N", help="only: N documents a label, ours at its defaults against fastText"
    )
    args = ap.parse_args()
    if args.at_scale:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        return at_scale(Path(args.work_dir), args.at_scale, args.fasttext_dir)
    from data_prep.clean.quality_model import Settings, one_line, train
    from data_prep.sample_corpus import low_quality_documents, wiki_articles

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    articles = [text for _, text in wiki_articles()]
    half = len(articles) // 2
    train_pos, held_pos = articles[half:], articles[:half]
    examples = [(x, True) for x in train_pos] + [(x, False) for x in low_quality_documents(len(train_pos))]
    held = [(x, True) for x in held_pos] + [(x, False) for x in low_quality_documents(5000, seed=99)]

    t0 = time.perf_counter()
    ours = train(examples, Settings())
    ours_s = time.perf_counter() - t0
    ours.save(work / "ours.bin")
    rows = [
        ("ours (data_prep quality-model train)", ours_s, held_out_scores(fasttext_predict(work / "ours.bin"), held))
    ]
    if args.fasttext_dir:
        data = work / "train.txt"
        labels = {True: "__label__hq", False: "__label__cc"}
        data.write_text("".join(f"{labels[p]} {one_line(x)}\n" for x, p in examples), encoding="utf-8")
        child = [sys.executable, "-c", FASTTEXT_CHILD, args.fasttext_dir, str(data), str(work / "fasttext.bin")]
        took = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)["seconds"]
        rows.append(
            (
                "fastText's trainer (fasttext-numpy2-wheel)",
                took,
                held_out_scores(fasttext_predict(work / "fasttext.bin"), held),
            )
        )

    print(f"training: {len(examples):,} documents (dim 32, 1M buckets, 5 epochs, lr 0.1, bigrams, one thread)")
    print(f"held out: {len(held_pos):,} articles, 5,000 generated documents; a document is good at score >= 0.5")
    print(f"{'trainer':<44} {'train s':>8} {'precision':>10} {'recall':>7}")
    for name, seconds, (precision, recall, _) in rows:
        print(f"{name:<44} {seconds:>8.1f} {precision:>10.4f} {recall:>7.4f}")

    scorer = fasttext_predict(work / "ours.bin")
    t0 = time.perf_counter()
    for text in held_pos:
        scorer(text)
    print(f"the model alone (fasttext-predict): {len(held_pos) / (time.perf_counter() - t0):,.0f} documents/s/core")

    inputs = work / "articles.jsonl"
    inputs.write_text("".join(json.dumps({"text": x}) + "\n" for x in held_pos), encoding="utf-8")
    plain_s, plain = clean_rate(inputs, work / "clean-plain")
    model_s, with_model = clean_rate(
        inputs, work / "clean-model", "--quality-model", str(work / "ours.bin"), "--quality-threshold", "0.5"
    )
    n = plain["totals"]["in"]["documents"]
    removed = with_model["removed"].get("quality_model", {}).get("documents", 0)
    print(f"data_prep clean over {n:,} held-out articles, one worker (process start-up included):")
    print(f"  rules only:            {plain_s:6.1f} s, {n / plain_s:7,.0f} documents/s/core")
    print(f"  rules and the model:   {model_s:6.1f} s, {n / model_s:7,.0f} documents/s/core ({model_s / plain_s:.2f}x)")
    scored = with_model["quality_model"]["scored"]
    print(f"  the model removed {removed:,} of the {scored:,} articles it scored ({100 * removed / scored:.2f}%)")


if __name__ == "__main__":
    main()
