"""Downstream tasks as plain (texts, labels) splits: labelled files the user has, and the built-in
word-order task made from held-out text.

A labelled task is a CSV, TSV or JSONL file (read with ``datasets``) with a text column and a label
column, or a folder with one subfolder of ``.txt`` files per label (one example per file). Without a
given test file, a stratified test split is drawn with a fixed seed. Every problem raises
:class:`TaskError`, whose message names the file and, where it applies, the column.

The word-order task (``path: word_order``): MLM has to use context and word order, and a bag of words
cannot see order. Each held-out sentence appears once, either as written (label ``original``) or
with its words shuffled inside consecutive windows of ``shuffle_window`` words (label
``shuffled``), half and half, chosen with a seeded generator. Both classes hold the same
distribution of word multisets, so any bag-of-words model stays at chance; a model scores above
chance only by reading order.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from data_prep.common.manifest import Manifest, load_manifest
from data_prep.common.tokenizer_cache import tokenizer_dir
from data_prep.sample_corpus import wiki_articles
from pretrain.config.schema import DownstreamTaskConfig
from pretrain.eval.heldout import eval_set_batches
from pretrain.model.masking import SpecialIds

WORD_ORDER = "word_order"
WORD_ORDER_LABELS = ("original", "shuffled")
_FORMATS = {".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}), ".jsonl": ("json", {}), ".json": ("json", {})}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class TaskError(ValueError):
    """A task that cannot be used; the message names the file and column."""


@dataclass
class TaskSplits:
    name: str
    train_texts: list[str]
    train_labels: np.ndarray  # int64 class indices into label_names
    test_texts: list[str]
    test_labels: np.ndarray
    label_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


# ------------------------------------------------------------------------------ labelled files


def read_labelled(
    path: str | Path, text_column: str = "text", label_column: str = "label"
) -> tuple[list[str], list[str]]:
    """(texts, labels as strings) from a CSV/TSV/JSONL file or a folder of per-label subfolders."""
    path = Path(path)
    if path.is_dir():
        return _read_label_folders(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such file or folder")
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise TaskError(
            f"{path}: unknown task format {path.suffix!r} (expected .csv, .tsv, .jsonl or a folder "
            "with one subfolder of .txt files per label)"
        )
    if not _has_rows(path, **fmt[1]):
        raise TaskError(f"{path}: no rows")  # datasets would say "Instruction 'train' corresponds to no data!"
    import datasets

    builder, options = fmt
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True, **options)
    except Exception as exc:  # datasets raises many types for a malformed file
        cause = exc.__cause__ or exc
        raise TaskError(
            f"{path}: cannot be read as {path.suffix[1:].upper()} ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''})"
        ) from exc
    missing = [c for c in (text_column, label_column) if c not in ds.column_names]
    if missing:
        raise TaskError(
            f"{path}: no column {', '.join(repr(c) for c in missing)} (columns: {ds.column_names}); "
            "set the text/label column names"
        )
    texts, labels = ds[text_column], ds[label_column]
    for i, (t, y) in enumerate(zip(texts, labels)):
        if not isinstance(t, str) or not t.strip():
            raise TaskError(f"{path}: column {text_column!r}, row {i + 1}: expected non-empty text, got {t!r}")
        if y is None or (isinstance(y, str) and not y.strip()):
            raise TaskError(f"{path}: column {label_column!r}, row {i + 1}: missing label")
    return list(texts), [str(y) for y in labels]


def _has_rows(path: Path, delimiter: str = ",") -> bool:
    """A data row besides a CSV/TSV header, or a non-blank JSONL line (an unreadable file is left to datasets)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            if path.suffix.lower() in (".jsonl", ".json"):
                return any(line.strip() for line in f)
            rows = csv.reader(f, delimiter=delimiter)
            next(rows, None)
            return any(any(cell.strip() for cell in row) for row in rows)
    except (OSError, csv.Error):
        return True


def _read_label_folders(folder: Path) -> tuple[list[str], list[str]]:
    texts, labels = [], []
    subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
    if not subdirs:
        raise TaskError(f"{folder}: a task folder needs one subfolder of .txt files per label, found none")
    for sub in subdirs:
        for f in sorted(sub.glob("*.txt")):
            try:
                text = f.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise TaskError(f"{f}: unreadable ({exc})") from exc
            if text:
                texts.append(text)
                labels.append(sub.name)
    if not texts:
        raise TaskError(f"{folder}: no non-empty .txt files in its label subfolders")
    return texts, labels


def _encode_labels(labels: Sequence[str], names: list[str]) -> np.ndarray:
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([index[y] for y in labels], dtype=np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices; every class keeps at least one example on each side where it has two."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(len(idx) - 1, max(1, round(test_fraction * len(idx)))) if len(idx) > 1 else 0
        test.extend(idx[:n_test])
        train.extend(idx[n_test:])
    return np.sort(np.asarray(train, dtype=np.int64)), np.sort(np.asarray(test, dtype=np.int64))


def _cap(texts: list[str], labels: np.ndarray, limit: int, seed: int) -> tuple[list[str], np.ndarray]:
    if limit <= 0 or len(texts) <= limit:
        return texts, labels
    keep = np.sort(np.random.default_rng(seed).permutation(len(texts))[:limit])
    return [texts[i] for i in keep], labels[keep]


def labelled_task(spec: DownstreamTaskConfig) -> TaskSplits:
    texts, labels = read_labelled(spec.path, spec.text_column, spec.label_column)
    where = f"{spec.path}: column {spec.label_column!r}" if not Path(spec.path).is_dir() else f"{spec.path}"
    if spec.test_path:
        test_texts, test_labels = read_labelled(spec.test_path, spec.text_column, spec.label_column)
    names = sorted(set(labels))
    if len(names) < 2:
        raise TaskError(f"{where}: only one class ({names[0]!r}) in {len(labels)} examples; a task needs two or more")
    y = _encode_labels(labels, names)
    if spec.test_path:
        unseen = sorted(set(test_labels) - set(names))
        if unseen:
            raise TaskError(
                f"{spec.test_path}: column {spec.label_column!r} has labels absent from the training "
                f"file {spec.path}: {unseen[:5]}"
            )
        train_texts, train_y = texts, y
        test_y = _encode_labels(test_labels, names)
    else:
        tr, te = stratified_split(y, spec.test_fraction, spec.seed)
        if len(te) == 0:
            raise TaskError(f"{where}: too few examples ({len(texts)}) for a test split")
        train_texts, train_y = [texts[i] for i in tr], y[tr]
        test_texts, test_y = [texts[i] for i in te], y[te]
    train_texts, train_y = _cap(train_texts, train_y, spec.max_examples, spec.seed)
    test_texts, test_y = _cap(test_texts, test_y, spec.max_examples, spec.seed + 1)
    return TaskSplits(spec.name or Path(spec.path).stem, train_texts, train_y, test_texts, test_y, names)


# ------------------------------------------------------------------------------ word order


def split_sentences(text: str, min_words: int = 6, max_words: int = 40) -> list[str]:
    out = []
    for para in text.splitlines():
        for s in _SENTENCE_END.split(para.strip()):
            if min_words <= len(s.split()) <= max_words:
                out.append(s)
    return out


def locally_shuffled(words: list[str], window: int, rng: np.random.Generator) -> list[str]:
    """The words permuted inside consecutive windows of ``window``; differs from the input whenever
    some window holds two different words."""
    out = list(words)
    for start in range(0, len(out), window):
        chunk = out[start : start + window]
        if len(set(chunk)) < 2:
            continue
        while True:
            perm = [chunk[i] for i in rng.permutation(len(chunk))]
            if perm != chunk:
                break
        out[start : start + window] = perm
    return out


def word_order_task(
    texts: Iterable[str],
    *,
    name: str = WORD_ORDER,
    max_examples: int = 2000,
    test_fraction: float = 0.25,
    shuffle_window: int = 3,
    seed: int = 0,
) -> TaskSplits:
    """Sentences of ``texts`` (as written, or locally shuffled), balanced, seeded; see the module doc."""
    sentences = [s for t in texts for s in split_sentences(t)]
    sentences = [s for s in dict.fromkeys(sentences) if len(set(s.split())) >= 2]
    rng = np.random.default_rng(seed)
    total = len(sentences) if max_examples <= 0 else min(len(sentences), int(max_examples / (1 - test_fraction)))
    if total < 20:
        raise TaskError(
            f"{name}: only {len(sentences)} usable sentences (6 to 40 words) in the held-out text; "
            "the word-order task needs at least 20"
        )
    chosen = [sentences[i] for i in rng.permutation(len(sentences))[:total]]
    labels = rng.permutation(np.arange(total) % 2).astype(np.int64)
    examples = [" ".join(locally_shuffled(s.split(), shuffle_window, rng)) if y else s for s, y in zip(chosen, labels)]
    n_test = max(2, round(test_fraction * total))
    return TaskSplits(
        name, examples[n_test:], labels[n_test:], examples[:n_test], labels[:n_test], list(WORD_ORDER_LABELS)
    )


def read_texts(path: str | Path) -> list[str]:
    """Raw documents from a .txt file (blank-line separated), a .jsonl file (``text`` field) or a
    folder of those."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise TaskError(f"{path}: no .txt or .jsonl files with held-out text")
    docs = []
    for f in files:
        try:
            raw = f.read_text(encoding="utf-8")
            if f.suffix == ".jsonl":
                docs += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
            else:
                docs += [d for d in raw.split("\n\n") if d.strip()]
        except (OSError, UnicodeDecodeError, ValueError, KeyError) as exc:
            raise TaskError(f"{f}: unreadable held-out text ({type(exc).__name__}: {exc})") from exc
    return docs


def held_out_sentences(
    data_dir: str | Path, manifest: Optional[Manifest] = None, split: str = "validation", max_sequences: int = 8192
) -> list[str]:
    """Whole sentences decoded from a data_prep folder's held-out split. A row holds pieces of
    documents between special tokens; a piece that touches the row's [CLS] or final [SEP] may be cut
    mid-sentence by packing, so its sentence on that side is dropped."""
    from transformers import AutoTokenizer

    manifest = load_manifest(data_dir) if manifest is None else manifest
    special = SpecialIds.from_manifest(manifest)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(manifest, data_dir))
    sentences: list[str] = []
    seen = 0
    for batch in eval_set_batches(data_dir, manifest, split, 0, 1, 256, 0):
        for row in batch["input_ids"].numpy():
            cut = np.flatnonzero(np.isin(row, special.all_special))
            row_end = cut[-1] if row[cut[-1]] == special.sep else len(row)
            if row[cut[-1]] == special.pad:  # the split's last row: [CLS] body [SEP] [PAD]...
                row_end = cut[np.searchsorted(cut, np.flatnonzero(row == special.pad)[0]) - 1]
            for a, b in zip(cut[:-1], cut[1:]):
                if b - a < 4 or b > row_end:
                    continue
                parts = _SENTENCE_END.split(tokenizer.decode(row[a + 1 : b].tolist()).strip())
                sentences += parts[1 if a == cut[0] else 0 : len(parts) - 1 if b == row_end else len(parts)]
            seen += 1
        if seen >= max_sequences:
            break
    return sentences


def word_order_from_data(
    data_dir: str | Path, spec: DownstreamTaskConfig, manifest: Optional[Manifest] = None, split: str = "validation"
) -> TaskSplits:
    return word_order_task(
        held_out_sentences(data_dir, manifest, split),
        name=spec.name or WORD_ORDER,
        max_examples=spec.max_examples,
        test_fraction=spec.test_fraction,
        shuffle_window=spec.shuffle_window,
        seed=spec.seed,
    )


def load_task(
    spec: DownstreamTaskConfig, data_dir: Optional[str] = None, manifest: Optional[Manifest] = None
) -> TaskSplits:
    """A task from its config: ``path: word_order`` uses ``spec.text_path`` (raw text) or else the
    held-out split of ``data_dir``; any other path is a labelled file or folder."""
    if spec.path != WORD_ORDER:
        return labelled_task(spec)
    if spec.text_path:
        return word_order_task(
            read_texts(spec.text_path),
            name=spec.name or WORD_ORDER,
            max_examples=spec.max_examples,
            test_fraction=spec.test_fraction,
            shuffle_window=spec.shuffle_window,
            seed=spec.seed,
        )
    if not data_dir:
        raise TaskError(
            f"task {spec.name or WORD_ORDER!r}: the word-order task needs held-out text: "
            "set text_path, or give a data_prep folder (--data / data.dir)"
        )
    return word_order_from_data(data_dir, spec, manifest)


def sample_article_task(out_path: str | Path, num_articles: int = 10) -> Path:
    """A labelled CSV from the embedded Wikipedia sample: the sentences of the ``num_articles``
    articles with the most sentences, each labelled by its article's title (for tests and benches)."""
    articles = [(title, split_sentences(text, min_words=5, max_words=60)) for title, text in wiki_articles()]
    articles = sorted(articles, key=lambda a: (-len(a[1]), a[0]))[:num_articles]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for title, sentences in articles:
            w.writerows([s, title] for s in sentences)
    return out
