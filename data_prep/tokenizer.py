"""Tokenizers: train a BERT-style WordPiece one, load a local Hugging Face tokenizer folder, encode
documents into flat numpy arrays, and copy the tokenizer next to the shards.

Word starts (for whole-word masking): a token starts a word iff it is the first piece of a word as
the pre-tokenizer split it. For WordPiece that is exactly "not a ``##`` continuation piece", which a
vocabulary-sized lookup table answers without per-token Python; other models use the encoding's
``word_ids``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from data_prep.common.manifest import SPECIAL_ROLES, tokenizer_sha256
from data_prep.common.tokenizer_cache import TOKENIZER_FILES

from .errors import DataPrepError

BERT_SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
# What is copied next to the shards (and hashed): the files a Hugging Face tokenizer loads from, never weights.


@dataclass
class Encoded:
    """A batch of documents as one flat stream: ``ids[sum(lens)]``, ``starts[sum(lens)]``, ``lens[docs]``."""

    ids: np.ndarray
    starts: np.ndarray
    lens: np.ndarray


@dataclass
class LoadedTokenizer:
    folder: Path
    tokenizer: tokenizers.Tokenizer = field(repr=False)
    special_tokens: dict[str, str]
    special_ids: dict[str, int]
    vocab_size: int
    lowercase: bool
    files: list[str]
    sha256: str
    # continuation[id] is True for WordPiece "##" pieces; None for other models (then word_ids are used)
    continuation: np.ndarray | None = field(default=None, repr=False)

    def manifest_entry(self, rel_path: str = "tokenizer") -> dict:
        return {
            "path": rel_path,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "lowercase": self.lowercase,
            "special_ids": dict(self.special_ids),
            "special_tokens": dict(self.special_tokens),
        }

    def encode(self, texts: list[str]) -> Encoded:
        """Tokenize without special tokens; Rust encodes the batch on all cores (``TOKENIZERS_PARALLELISM``)."""
        if self.continuation is not None:
            # the fast path skips offsets, which only the word_ids fallback needs
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        else:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        lens = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.uint32, count=int(lens.sum()))
        if self.continuation is not None:
            starts = ~self.continuation[ids]
        else:
            starts = np.fromiter(
                itertools.chain.from_iterable(_starts_from_word_ids(e.word_ids) for e in encodings),
                dtype=bool,
                count=len(ids),
            )
        return Encoded(ids, starts, lens)


def _starts_from_word_ids(word_ids: list[int | None]) -> list[bool]:
    return [w is None or i == 0 or w != word_ids[i - 1] for i, w in enumerate(word_ids)]


def _configured_special_tokens(folder: Path) -> dict[str, str]:
    """Special-token strings from the folder's config files; BERT's names where none is configured."""
    found = dict(BERT_SPECIAL_TOKENS)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataPrepError(f"{path}: not valid JSON ({exc})") from None
        for role in SPECIAL_ROLES:
            value = config.get(f"{role}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value:
                found[role] = value
    return found


def _is_lowercasing(normalizer: dict | None) -> bool:
    if not normalizer:
        return False
    kind = normalizer.get("type")
    if kind == "BertNormalizer":
        return bool(normalizer.get("lowercase"))
    if kind == "Lowercase":
        return True
    if kind == "Sequence":
        return any(_is_lowercasing(n) for n in normalizer.get("normalizers", []))
    return False


def _continuation_table(tok: tokenizers.Tokenizer, vocab_size: int) -> np.ndarray | None:
    if not isinstance(tok.model, models.WordPiece):
        return None
    prefix = tok.model.continuing_subword_prefix
    table = np.zeros(vocab_size, dtype=bool)
    added = set(tok.get_added_tokens_decoder())
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx not in added and token.startswith(prefix) and len(token) > len(prefix):
            table[idx] = True
    return table


def load_tokenizer(folder: str | os.PathLike) -> LoadedTokenizer:
    """Load a local tokenizer folder (``tokenizer.json`` plus optional config files)."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not folder.is_dir():
        raise DataPrepError(f"--tokenizer {folder}: no such folder (train one with `data_prep tokenizer`)")
    if not path.is_file():
        raise DataPrepError(
            f"{folder}: has no tokenizer.json (a fast Hugging Face tokenizer is needed; "
            "load it with transformers and save_pretrained() it)"
        )
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataPrepError(f"{path}: not a loadable tokenizer ({exc})") from exc
    # Some published folders bake padding/truncation into tokenizer.json; packing needs the raw stream.
    tok.no_padding()
    tok.no_truncation()
    # Text that literally says "[SEP]" must not become a document separator.
    tok.encode_special_tokens = True
    special_tokens = _configured_special_tokens(folder)
    special_ids = {}
    for role in SPECIAL_ROLES:
        idx = tok.token_to_id(special_tokens[role])
        if idx is None:
            raise DataPrepError(
                f"{folder}: tokenizer has no {special_tokens[role]} token ({role}); "
                f"data prep needs {', '.join(special_tokens[r] for r in SPECIAL_ROLES)}"
            )
        special_ids[role] = idx
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    files = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    lowercase = _is_lowercasing(json.loads(tok.to_str()).get("normalizer"))
    return LoadedTokenizer(
        folder=folder,
        tokenizer=tok,
        special_tokens=special_tokens,
        special_ids=special_ids,
        vocab_size=vocab_size,
        lowercase=lowercase,
        files=files,
        sha256=tokenizer_sha256(folder, files),
        continuation=_continuation_table(tok, vocab_size),
    )


def publish_tokenizer(tok: LoadedTokenizer, store, name: str = "tokenizer") -> None:
    """The tokenizer files beside the shards, in a folder (``install_tokenizer_copy``) or a bucket: each
    file uploaded unless the same bytes are there (tasks racing upload the same bytes; a killed
    upload is completed by the next task); different bytes there are refused."""
    if store.local_dir is not None:
        install_tokenizer_copy(tok, store.local_dir, name)
        return
    present = {n[len(name) + 1 :]: size for n, size in store.list(name).items()}
    for fname in tok.files:
        data = (tok.folder / fname).read_bytes()
        if fname not in present:
            store.write_bytes(f"{name}/{fname}", data)
        elif present[fname] != len(data) or store.read_bytes(f"{name}/{fname}") != data:
            raise DataPrepError(
                f"{store.url(name)}: holds a different {fname} than --tokenizer {tok.folder}; "
                "write to a new --out location"
            )
    extra = sorted(set(present) - set(tok.files))
    if extra:
        raise DataPrepError(
            f"{store.url(name)}: holds files {extra} that --tokenizer {tok.folder} lacks; write to a new --out location"
        )


def install_tokenizer_copy(tok: LoadedTokenizer, out_dir: Path, name: str = "tokenizer") -> Path:
    """Copy the tokenizer files to ``out_dir/name`` atomically. Concurrent array tasks may race: the
    first rename wins and the others check that the winner holds the same bytes."""
    dest = out_dir / name
    if not dest.exists():
        tmp = out_dir / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            for fname in tok.files:
                shutil.copyfile(tok.folder / fname, tmp / fname)
            try:
                os.rename(tmp, dest)
            except OSError:
                if not dest.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    existing = tokenizer_sha256(dest)
    if existing != tok.sha256:
        raise DataPrepError(
            f"{dest}: holds a different tokenizer (sha256 {existing[:12]}) than --tokenizer "
            f"{tok.folder} (sha256 {tok.sha256[:12]}); write to a new --out folder"
        )
    return dest


def train_tokenizer(
    documents: Callable[[], Iterable[str]] | Sequence[str],
    out_dir: str | os.PathLike,
    vocab_size: int,
    lowercase: bool = True,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
    inputs: list[str] | None = None,
) -> Path:
    """Train a BERT-style WordPiece tokenizer and save a folder that
    ``transformers.AutoTokenizer.from_pretrained`` loads: the same documents and settings give the same
    files on any run. ``documents``: a list of strings, or a function that returns them afresh (they
    are read twice). ``inputs`` (the files the documents come from) only serve error messages.

    Why twice: tokenizers' WordPiece trainer numbers each ``##`` character piece when it first meets
    it in a hash map seeded anew in every process, and breaks ties between merges of equal count by
    those numbers (tokenizers issue 1794): the same corpus gave other merges, other tokens, on other
    runs. A first pass finds those pieces; the second names them to the trainer up front (in sorted
    order, as tokens it must keep, which the trainer numbers first), so no id comes from a hash order
    and the same merges follow."""
    from transformers import BertTokenizerFast

    read = documents if callable(documents) else lambda: iter(documents)
    specials = [BERT_SPECIAL_TOKENS[r] for r in SPECIAL_ROLES]
    if vocab_size <= len(specials):
        raise DataPrepError(f"--vocab-size {vocab_size} is too small (at least {len(specials) + 1})")
    settings = dict(min_frequency=min_frequency, limit_alphabet=limit_alphabet, show_progress=False)
    first = _wordpiece(lowercase)
    counted = _CountingIterator(read())
    first.train_from_iterator(counted, trainers.WordPieceTrainer(vocab_size=1, special_tokens=specials, **settings))
    if counted.count == 0:
        names = ", ".join((inputs or [])[:5]) + (" ..." if len(inputs or []) > 5 else "")
        raise DataPrepError(
            "empty input: no documents to train the tokenizer on"
            + (f" in {names}" if names else "")
            + " (every document empty or whitespace)"
        )
    pieces = sorted(t for t in first.get_vocab(with_added_tokens=False) if t.startswith("##"))
    tok = _wordpiece(lowercase)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials + pieces, **settings)
    tok.train_from_iterator(read(), trainer=trainer)
    tok = _only_added(tok, specials)
    cls, sep = BERT_SPECIAL_TOKENS["cls"], BERT_SPECIAL_TOKENS["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # transformers 5 ignores BertTokenizerFast(vocab_file=...); from_pretrained reads tokenizer.json.
    hf = BertTokenizerFast.from_pretrained(
        str(out), do_lower_case=lowercase, **{f"{r}_token": BERT_SPECIAL_TOKENS[r] for r in SPECIAL_ROLES}
    )
    hf.save_pretrained(str(out))
    return out


def _wordpiece(lowercase: bool) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordPiece(unk_token=BERT_SPECIAL_TOKENS["unk"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _only_added(tok: tokenizers.Tokenizer, specials: list[str]) -> tokenizers.Tokenizer:
    """``tok`` with only ``specials`` as added (special) tokens: the trainer also adds every token it
    was told to keep, and the ``##`` pieces are plain vocabulary, matched inside words."""
    data = json.loads(tok.to_str())
    data["added_tokens"] = [a for a in data["added_tokens"] if a["content"] in specials]
    return tokenizers.Tokenizer.from_str(json.dumps(data))


class _CountingIterator:
    def __init__(self, items):
        self._it = iter(items)
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.count += 1
        return item
