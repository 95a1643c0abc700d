"""Does a quality model trained with ``--negative generated`` remove junk it never saw, made of text it
never saw, and keep good text? (issue 83, item 2)

    python bench/clean_quality_junk.py [--work-dir /tmp/clean-quality-junk]

1. The bundled articles: ``data_prep quality-model train --negative generated`` at its defaults
   (``--epochs auto --lr auto``) on 2,000 of them; held out: 1,000 other articles and junk made from
   those 1,000 by a recipe of this script, not the trainer's (``held_out_junk``): word salad cut into
   sentences, keyword spam, menus of openings, and repeats (a sentence or two looped, word chunks
   stuttered). Each kind: the share the model removes at 0.5, the share the quality rules remove
   (``data_prep clean``'s defaults), and either.
2. Another domain, Python's reference manual (``pydoc_data``, paragraphs of 25 words or more): the
   same model size trained against the bundled generator's junk (made of Wikipedia's words) and
   against junk made of the manual's own words, scored on junk made from held-out paragraphs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JUNK_KINDS = ("salad", "spam", "menus", "repeats")


def held_out_junk(texts: list[str], n: int, seed: int = 99) -> dict[str, list[str]]:
    """``n`` documents of each kind from ``texts``, by another recipe than the trainer's generator."""
    rng = random.Random(seed)
    vocab = [w for t in texts for w in t.split() if len(w) > 3]
    out: dict[str, list[str]] = {k: [] for k in JUNK_KINDS}
    for _ in range(n):
        pool = rng.choice(texts).split() + rng.choice(texts).split()
        rng.shuffle(pool)
        words, pieces, j = pool[: rng.randint(40, 200)], [], 0
        while j < len(words):
            piece = words[j : j + rng.randint(5, 14)]
            pieces.append(piece[0].capitalize() + " " + " ".join(piece[1:]) + rng.choice([".", ".", ",", ";"]))
            j += len(piece)
        out["salad"].append(" ".join(pieces))
        keys = rng.sample(vocab, 6)
        tails = ["", "", ",", " -", " best", " 2024"]
        out["spam"].append(" ".join(rng.choice(keys) + rng.choice(tails) for _ in range(rng.randint(20, 60))))
        titles = [" ".join(rng.choice(texts).split()[: rng.randint(1, 4)]) for _ in range(rng.randint(6, 20))]
        out["menus"].append(rng.choice(["\n", " | ", "  "]).join(titles))
        sentences = re.split(r"(?<=[.!?])\s+", rng.choice(texts))
        if rng.random() < 0.5:
            out["repeats"].append(" ".join(sentences[:2] * rng.randint(3, 6)))
        else:
            stuttered = []
            for sentence in sentences[:8]:
                w = sentence.split()
                if len(w) > 6:
                    i = rng.randrange(len(w) - 3)
                    w = w[: i + 3] + w[i : i + 3] * 2 + w[i + 3 :]
                stuttered.append(" ".join(w))
            out["repeats"].append(" ".join(stuttered))
    return out


def manual_paragraphs() -> list[str]:
    import pydoc_data.topics

    paragraphs = (" ".join(p.split()) for t in pydoc_data.topics.topics.values() for p in re.split(r"\n\s*\n", t))
    return [p for p in paragraphs if len(p.split()) >= 25]


def share(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags)


def bundled_articles(work: Path) -> None:
    from data_prep.clean.document import QualityScorer
    from data_prep.clean.quality import first_failure
    from data_prep.clean.settings import QualitySettings
    from data_prep.sample_corpus import wiki_articles

    articles = [t for _, t in wiki_articles()]
    train_pos, held_pos = articles[2000:4000], articles[:1000]
    positives = work / "articles.jsonl"
    positives.write_text("".join(json.dumps({"text": x}) + "\n" for x in train_pos), encoding="utf-8")
    cmd = [sys.executable, "-m", "data_prep", "quality-model", "train", "--positive", str(positives)]
    t0 = time.perf_counter()
    done = subprocess.run(
        [*cmd, "--negative", "generated", "--out", str(work / "q.bin")], cwd=REPO, check=True, capture_output=True
    )
    seconds = time.perf_counter() - t0
    print(f"1. trained on {len(train_pos):,} bundled articles in {seconds:.0f} s (defaults: --epochs auto --lr auto):")
    print("   " + "\n   ".join(done.stdout.decode().strip().splitlines()))
    score, rules = QualityScorer(str(work / "q.bin"), "__label__hq"), QualitySettings()

    def kept(text: str) -> tuple[bool, bool]:
        return score(text) >= 0.5, first_failure(text, rules, True) is None

    print(f"   held out: {len(held_pos):,} articles and 400 documents a kind of junk made from them")
    print(f"   {'':<16} {'the model':>10} {'the rules':>10} {'either':>8}")
    verdicts = [kept(x) for x in held_pos]
    row = (share(m for m, _ in verdicts), share(r for _, r in verdicts), share(m and r for m, r in verdicts))
    print(f"   {'articles kept':<16} {row[0]:>10.3f} {row[1]:>10.3f} {row[2]:>8.3f}")
    for kind, docs in held_out_junk(held_pos, 400).items():
        verdicts = [kept(x) for x in docs]
        row = (
            share(not m for m, _ in verdicts),
            share(not r for _, r in verdicts),
            share(not (m and r) for m, r in verdicts),
        )
        print(f"   {kind + ' removed':<16} {row[0]:>10.3f} {row[1]:>10.3f} {row[2]:>8.3f}")


def another_domain() -> None:
    from data_prep.clean.negatives import NegativeMaker
    from data_prep.clean.quality_model import Settings, split_held_out, train
    from data_prep.sample_corpus import low_quality_documents

    paragraphs = manual_paragraphs()
    fit, held = split_held_out([(x, True) for x in paragraphs], 0.2, 0)
    fit_pos, held_pos = [x for x, _ in fit], [x for x, _ in held]
    junk = held_out_junk(held_pos, 200)
    print(
        f"2. Python's reference manual: {len(fit_pos):,} paragraphs train, {len(held_pos):,} held out (50 epochs, lr 0.5)"
    )
    print(f"   {'negatives':<34} {'kept':>6} " + " ".join(f"{k:>8}" for k in JUNK_KINDS))
    for name, negatives in (
        ("the bundled generator's (Wikipedia)", low_quality_documents(len(fit_pos))),
        ("made of the manual's words", [x for x, _ in NegativeMaker(fit_pos).make(len(fit_pos))]),
    ):
        model = train(fit + [(x, False) for x in negatives], Settings(epochs=50, lr=0.5))
        kept = share(model.probability(x) >= 0.5 for x in held_pos)
        removed = [share(model.probability(x) < 0.5 for x in junk[k]) for k in JUNK_KINDS]
        print(f"   {name:<34} {kept:>6.3f} " + " ".join(f"{r:>8.3f}" for r in removed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default="/tmp/clean-quality-junk")
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    bundled_articles(work)
    another_domain()


if __name__ == "__main__":
    main()
