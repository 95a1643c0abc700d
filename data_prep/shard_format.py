"""The on-disk contract between ``data_prep`` and ``pretrain``: shard tars and ``manifest.json``.

A shard is a plain POSIX tar readable by ``tar -tf``, ``webdataset.WebDataset`` and ``numpy.load``.
Each webdataset *sample* is a block of up to ``block_size`` packed sequences, stored as two members
sharing the sample key::

    <key>.input_ids.npy    2-D array [n, seq_len], uint16 when the vocabulary fits, else uint32
    <key>.word_starts.npy  2-D uint8 [n, ceil(seq_len / 8)]: np.packbits of "token starts a word"

Storing blocks instead of one sequence per sample keeps tar's 512-byte headers and padding at a few
percent of the data (about 2.2 bytes per token at uint16 and 128 tokens per sequence).

Shard file names: ``<split>-s<source:05d>-g<group:05d>-<index:05d>.tar``: shard ``index`` of one
split of packing group ``group`` of input source ``source`` (``data_prep.groups``). Groups do not
depend on the number of array tasks, so neither do the names nor the bytes. Every sequence is exactly
``seq_len`` tokens: ``[CLS] ... [SEP]``, documents separated by ``[SEP]``; only the last sequence of
each split of a group may end in ``[PAD]`` tokens.

``manifest.json`` (written by ``data_prep finalize``; the trainer trusts nothing else)::

    {
      "format_version": 1,
      "seq_len": 128, "block_size": 256, "dtype": "uint16",
      "tokenizer": {
        "path": "tokenizer",                 # relative to the data dir: a copy made by data prep
        "sha256": "...",                     # over the tokenizer folder's files (sorted name + bytes)
        "vocab_size": 30522, "lowercase": true,
        "special_ids": {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103},
        "special_tokens": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
      },
      "num_tasks": 4,                       # how many array tasks wrote it (does not change the shards)
      "shards": [                           # by split (train first), then source, group, index
        {"name": "train-s00000-g00000-00000.tar", "split": "train", "source": 0, "group": 0, "index": 0,
         "sequences": 2048, "blocks": 8, "tokens": 262000, "padding": 144, "bytes": 575488, "sha256": "...",
         "block_offsets": [0, 66560, ..., 574464]}
      ],
      "totals": {"train": {"shards": 8, "sequences": 16384, "tokens": ..., "padding": ..., "documents": ...},
                 "validation": {...}},
      "settings": {...}                      # the resolved data-prep settings
    }

Readers get it as a ``Manifest`` (``load_manifest``), checked once: a missing or mistyped key is a
``ShardError`` naming the key, not a ``KeyError`` wherever it is first read.

Within a shard every block holds ``block_size`` sequences except possibly the last, so a block's
sequence count follows from the manifest alone (``block_sizes``).

``block_offsets`` (``blocks + 1`` integers) are where each block's first tar header starts, then the
end of the last block's data: block ``k`` is the bytes ``[block_offsets[k], block_offsets[k + 1])``,
its two members with their headers, so one read (one ranged GET from a bucket) fetches it and no
reader scans tar headers. Manifests written before this key was added have none; readers then scan
the headers (``index_shard``), and ``verify`` checks the recorded offsets against that scan.

``block_crc32`` (``blocks`` integers) is each block's CRC-32 over those bytes: every reader checks
the bytes of every block it reads against it (``check_block``), from a local disk, a bucket or a web
folder, so that a shard replaced or edited after ``finalize`` is never trained on, even where it
still decodes (CRC-32 from zlib: about 0.4 GB/s on one loaded core of this project's CPU machines,
well under the cost of reading the block). Manifests written before it have none; ``data_prep
finalize`` on the folder again adds them.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from .commands import location, python_command
from .storage import StorageError, open_store

FORMAT_VERSION = 1
TAR_BLOCK = tarfile.BLOCKSIZE          # 512: a tar header, and the unit member data is padded to
MANIFEST = "manifest.json"
IDS_EXT = "input_ids.npy"
WORD_STARTS_EXT = "word_starts.npy"
DEFAULT_BLOCK_SIZE = 256


class ShardError(RuntimeError):
    """A shard or manifest that cannot be trusted; the message names the file."""


def shard_name(split: str, source: int, index: int, group: int = 0) -> str:
    """Shard ``index`` of ``split`` in packing group ``group`` of input source ``source``."""
    return f"{split}-s{source:05d}-g{group:05d}-{index:05d}.tar"


def ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


class ShardWriter:
    """Writes one shard to ``<name>.tmp`` and renames it into place on ``close()``: a shard under its
    final name is always complete. Member headers carry fixed metadata (mtime 0, uid 0) so that the
    same input always gives the same bytes."""

    def __init__(self, path: str | os.PathLike, vocab_size: int):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.dtype = ids_dtype(vocab_size)
        self._file = open(self.tmp, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self.blocks = 0
        self.sequences = 0
        self.block_offsets: list[int] = []      # the manifest's block_offsets, complete after close()
        self.block_crc32: list[int] = []        # and its block_crc32

    def _add(self, name: str, payload: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mtime = 0
        info.mode = 0o444
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(payload))

    def write_block(self, input_ids: np.ndarray, word_starts: np.ndarray) -> None:
        """``input_ids`` [n, L] ints, ``word_starts`` [n, L] bools."""
        assert input_ids.ndim == 2 and word_starts.shape == input_ids.shape
        key = f"{self.path.stem}.{self.blocks:06d}".replace(".", "_")
        self.block_offsets.append(self._tar.offset)
        self._add(f"{key}.{IDS_EXT}", _npy_bytes(np.ascontiguousarray(input_ids, dtype=self.dtype)))
        self._add(f"{key}.{WORD_STARTS_EXT}", _npy_bytes(np.packbits(word_starts.astype(bool), axis=1)))
        self.blocks += 1
        self.sequences += input_ids.shape[0]

    def close(self) -> str:
        """Finish, fsync, rename into place; returns the shard's sha256."""
        self.block_offsets.append(self._tar.offset)     # the end of the last block, before tar's end marker
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        with open(self.tmp, "rb") as f:                  # the bytes as written (from the page cache)
            self.block_crc32 = [block_checksum(f.read(end - start))
                                for start, end in zip(self.block_offsets, self.block_offsets[1:])]
        os.replace(self.tmp, self.path)
        return sha256_file(self.path)

    def abort(self) -> None:
        try:
            self._tar.close()
            self._file.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def block_checksum(span: bytes) -> int:
    """The manifest's ``block_crc32`` of one block's bytes."""
    return zlib.crc32(span)


def block_checksums(data: bytes, offsets: Sequence[int]) -> list[int]:
    return [block_checksum(data[start:end]) for start, end in zip(offsets, offsets[1:])]


def check_block(entry: ShardEntry, index: int, span: bytes, where: str) -> None:
    """Raise ``ShardError`` unless block ``index``'s bytes are those ``finalize`` recorded (a manifest
    without ``block_crc32`` records none: nothing to check)."""
    if entry.block_crc32 is None:
        return
    got = block_checksum(span)
    if got != entry.block_crc32[index]:
        raise ShardError(f"{where}: its bytes are not those data prep wrote (CRC-32 {got:08x}, the manifest's "
                         f"{entry.block_crc32[index]:08x}): the shard was replaced or edited after finalize")


def block_sizes(shard_entry: ShardEntry, block_size: int) -> list[int]:
    """Sequences in each block of a shard, from its manifest entry alone."""
    n, blocks = shard_entry.sequences, shard_entry.blocks
    if blocks == 0:
        return []
    sizes = [block_size] * (blocks - 1) + [n - block_size * (blocks - 1)]
    if sizes[-1] <= 0 or sizes[-1] > block_size:
        raise ShardError(f"{shard_entry.name}: {n} sequences do not fit {blocks} blocks of {block_size}")
    return sizes


def decode_block(ids_bytes: bytes, starts_bytes: bytes, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.load(io.BytesIO(ids_bytes), allow_pickle=False)
    packed = np.load(io.BytesIO(starts_bytes), allow_pickle=False)
    starts = np.unpackbits(packed, axis=1, count=seq_len).astype(bool)
    return ids, starts


def index_shard(path: str | os.PathLike, data: bytes | None = None) -> list[int]:
    """A shard's ``block_offsets`` from its tar headers (no data is read), of the file ``path`` or of
    its bytes ``data``: for manifests that do not record them, and for ``verify`` to check those that do."""
    offsets: list[int] = []
    try:
        with tarfile.open(path, mode="r:", fileobj=None if data is None else io.BytesIO(data)) as tar:
            members = tar.getmembers()
    except (tarfile.TarError, OSError) as exc:
        raise ShardError(f"{path}: not a readable shard tar ({exc})") from exc
    for k in range(0, len(members) - 1, 2):
        ids, starts = members[k], members[k + 1]
        key, _, ext = ids.name.partition(".")
        if ext != IDS_EXT or starts.name != f"{key}.{WORD_STARTS_EXT}":
            raise ShardError(f"{path}: members {ids.name!r} and {starts.name!r} are not one block's "
                             f"{IDS_EXT} and {WORD_STARTS_EXT}")
        offsets.append(ids.offset)
    if len(members) % 2:
        raise ShardError(f"{path}: incomplete block {members[-1].name!r} (truncated shard?)")
    if members:
        last = members[-1]
        offsets.append(last.offset_data + -(-last.size // TAR_BLOCK) * TAR_BLOCK)
    return offsets


def parse_block(span: bytes, seq_len: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, word_starts) of one block from its bytes, ``[block_offsets[k], block_offsets[k+1])``:
    the two members' tar headers are checked (names, one key, sizes within the span)."""
    payloads, keys, pos = [], [], 0
    for ext in (IDS_EXT, WORD_STARTS_EXT):
        try:
            info = tarfile.TarInfo.frombuf(span[pos:pos + TAR_BLOCK], tarfile.ENCODING, "surrogateescape")
        except tarfile.TarError as exc:
            raise ShardError(f"{where}: no {ext} tar header at byte {pos} of the block ({exc})") from exc
        key, _, got = info.name.partition(".")
        data = span[pos + TAR_BLOCK:pos + TAR_BLOCK + info.size]
        if got != ext:
            raise ShardError(f"{where}: member {info.name!r} where the block's {ext} should be")
        if len(data) != info.size:
            raise ShardError(f"{where}: member {info.name!r} of {info.size} bytes runs past the block's "
                             f"{len(span)} bytes (truncated read?)")
        payloads.append(data)
        keys.append(key)
        pos += TAR_BLOCK + -(-info.size // TAR_BLOCK) * TAR_BLOCK
    if keys[0] != keys[1] or pos != len(span):
        raise ShardError(f"{where}: the block's members {keys} span {pos} bytes of {len(span)}")
    return decode_block(payloads[0], payloads[1], seq_len)


def read_span(f, start: int, end: int) -> bytes:
    """The bytes ``[start, end)`` of an open file: one block at its ``block_offsets``."""
    f.seek(start)
    return f.read(end - start)


def read_block(f, start: int, end: int, seq_len: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    return parse_block(read_span(f, start, end), seq_len, where)


def iter_blocks(path: str | os.PathLike, seq_len: int, offsets: Sequence[int] | None = None):
    """Every (input_ids, word_starts) block of a shard, in order; ``offsets`` from the manifest, or scanned."""
    offsets = index_shard(path) if offsets is None else offsets
    with open(path, "rb") as f:
        for k in range(len(offsets) - 1):
            yield read_block(f, offsets[k], offsets[k + 1], seq_len, f"{path}: block {k}")


# ------------------------------------------------------------------------------------ manifest.json
# Read once, checked once: every reader gets these types, never the raw dict.

SPECIAL_ROLES = ("pad", "unk", "cls", "sep", "mask")    # the tokenizer's special ids, all in every manifest
_PROBLEMS_SHOWN = 20
_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", dict: "an object", list: "a list"}


def _field(raw: dict, key: str, kind: type, where: str, problems: list[str], required: bool = True):
    """``raw[key]`` when it is a ``kind``; else None and, unless an optional key is absent, a problem
    naming ``where + key``. A bool is not an integer here (JSON true is not a count)."""
    if key not in raw:
        if required:
            problems.append(f"{where}{key}: missing")
        return None
    value = raw[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        problems.append(f"{where}{key}: not {_KIND_NAMES[kind]} ({shown})")
        return None
    return copy.deepcopy(value) if kind is dict else value


def _object(raw, where: str, problems: list[str]) -> dict | None:
    if isinstance(raw, dict):
        return raw
    problems.append(f"{where.rstrip('.')}: not {_KIND_NAMES[dict]}")
    return None


class _AsJson:
    def to_dict(self) -> dict:
        """The JSON object, keys in the order data prep writes them; absent optional keys stay absent.
        Nested dicts are copies: a caller that edits the result (tests, tools) leaves this object alone."""
        def plain(value):
            if isinstance(value, _AsJson):
                return value.to_dict()
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return copy.deepcopy(value) if isinstance(value, dict) else value

        return {f.name: plain(v) for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class ShardEntry(_AsJson):
    """One element of the manifest's ``shards``."""
    name: str
    split: str
    source: int | None     # input source and packing group (data_prep.groups); None in manifests written
    group: int | None      # before packing groups, whose entries named the array task instead
    index: int
    sequences: int
    blocks: int
    tokens: int            # sequences x seq_len - padding
    padding: int
    bytes: int
    sha256: str
    block_offsets: tuple[int, ...] | None = None     # blocks + 1 byte offsets; None in older manifests
    block_crc32: tuple[int, ...] | None = None       # blocks CRC-32s of those spans; None in older manifests
    _TEXT_KEYS: ClassVar[tuple[str, ...]] = ("name", "split", "sha256")
    _LIST_KEYS: ClassVar[tuple[str, ...]] = ("block_offsets", "block_crc32")   # the others are integers
    _OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ("source", "group", "block_offsets", "block_crc32")

    @classmethod
    def read(cls, raw, where: str, problems: list[str]) -> ShardEntry | None:
        if (raw := _object(raw, where, problems)) is None:
            return None
        before = len(problems)
        kind = {**{k: str for k in cls._TEXT_KEYS}, **{k: list for k in cls._LIST_KEYS}}
        values = {f.name: _field(raw, f.name, kind.get(f.name, int), where, problems,
                                 required=f.name not in cls._OPTIONAL_KEYS) for f in fields(cls)}
        if len(problems) == before and values["block_offsets"] is not None:
            values["block_offsets"] = _block_offsets(values, where, problems)
        if len(problems) == before and values["block_crc32"] is not None:
            crcs = values["block_crc32"]
            if len(crcs) != values["blocks"] or not all(
                    isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2 ** 32 for c in crcs):
                problems.append(f"{where}block_crc32: not {values['blocks']} CRC-32 values")
            values["block_crc32"] = tuple(crcs)
        return cls(**values) if len(problems) == before else None


def _block_offsets(values: dict, where: str, problems: list[str]) -> tuple[int, ...] | None:
    """``blocks + 1`` increasing integers within the shard's bytes, or a problem naming the entry."""
    offsets = values["block_offsets"]
    if (len(offsets) != values["blocks"] + 1
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or any(b <= a for a, b in zip(offsets, offsets[1:])) or offsets[0] < 0 or offsets[-1] > values["bytes"]):
        problems.append(f"{where}block_offsets: not {values['blocks'] + 1} increasing byte offsets within "
                        f"its {values['bytes']} bytes")
        return None
    return tuple(offsets)


@dataclass(frozen=True)
class TokenizerInfo(_AsJson):
    """The manifest's ``tokenizer``: the copy beside the shards (``path``, relative to the data folder)."""
    path: str
    sha256: str                    # tokenizer_sha256 of that folder
    vocab_size: int
    lowercase: bool
    special_ids: dict[str, int]    # an id for each of SPECIAL_ROLES
    special_tokens: dict[str, str]

    @classmethod
    def read(cls, raw, where: str, problems: list[str]) -> TokenizerInfo | None:
        if (raw := _object(raw, where, problems)) is None:
            return None
        before = len(problems)
        kinds = {"path": str, "sha256": str, "vocab_size": int, "lowercase": bool, "special_ids": dict,
                 "special_tokens": dict}
        values = {key: _field(raw, key, kind, where, problems) for key, kind in kinds.items()}
        ids = values["special_ids"]
        if ids is not None and (lacking := [r for r in SPECIAL_ROLES if not isinstance(ids.get(r), int)]):
            problems.append(f"{where}special_ids lacks {lacking} (has {sorted(ids)})")
        return cls(**values) if len(problems) == before else None

    @property
    def pad_id(self) -> int:
        return self.special_ids["pad"]


@dataclass(frozen=True)
class Manifest(_AsJson):
    """``manifest.json`` (the module docstring), checked: ``from_dict`` refuses a missing or mistyped key."""
    format_version: int
    seq_len: int
    block_size: int
    dtype: str                               # of input_ids: ids_dtype(tokenizer.vocab_size)
    tokenizer: TokenizerInfo
    num_tasks: int
    shards: tuple[ShardEntry, ...]           # by split (train first), then source, group, index
    totals: dict[str, dict[str, int]]        # per split: shards, sequences, tokens, padding, documents
    settings: dict                           # the resolved data-prep settings

    @classmethod
    def from_dict(cls, raw, where: str = MANIFEST) -> Manifest:
        """Raises ``ShardError`` naming ``where`` and every key that is missing or of the wrong type."""
        if not isinstance(raw, dict):
            raise ShardError(f"{where}: not a data_prep manifest (a JSON {type(raw).__name__}, not an object)")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ShardError(f"{where}: format_version {raw.get('format_version')!r}, this code reads {FORMAT_VERSION}")
        problems: list[str] = []
        values = {key: _field(raw, key, kind, "", problems) for key, kind in (
            ("format_version", int), ("seq_len", int), ("block_size", int), ("dtype", str), ("tokenizer", dict),
            ("num_tasks", int), ("shards", list), ("totals", dict), ("settings", dict))}
        if values["tokenizer"] is not None:
            values["tokenizer"] = TokenizerInfo.read(values["tokenizer"], "tokenizer.", problems)
        if values["shards"] is not None:
            values["shards"] = tuple(ShardEntry.read(entry, f"shards[{i}].", problems)
                                     for i, entry in enumerate(values["shards"]))
        problems += [f"totals.{split}: not {_KIND_NAMES[dict]}" for split, t in (values["totals"] or {}).items()
                     if not isinstance(t, dict)]
        if problems:
            shown = problems[:_PROBLEMS_SHOWN] + ([f"... and {len(problems) - _PROBLEMS_SHOWN} more"]
                                                  if len(problems) > _PROBLEMS_SHOWN else [])
            raise ShardError(f"{where}: not a data_prep manifest:\n  " + "\n  ".join(shown))
        return cls(**values)

    def shards_of(self, split: str) -> list[ShardEntry]:
        return [s for s in self.shards if s.split == split]

    def has_split(self, split: str) -> bool:
        """Whether any shard belongs to ``split`` (a data set may have no validation split)."""
        return any(s.split == split for s in self.shards)

    def tokenizer_dir(self, data_dir: str | os.PathLike) -> Path:
        """The tokenizer copy beside the shards of ``data_dir`` as a local folder: itself, or for a URL
        a download checked against ``tokenizer.sha256`` and kept under that hash (``cached_tokenizer``)."""
        store = open_store(data_dir)
        if store.local_dir is not None:
            return store.local_dir / self.tokenizer.path
        return cached_tokenizer(store, self.tokenizer.path, self.tokenizer.sha256)


def load_manifest(data_dir: str | os.PathLike) -> Manifest:
    """``DIR/manifest.json`` (DIR a folder or a URL), checked (``Manifest.from_dict``); raises
    ``ShardError`` naming what is wrong."""
    store = open_store(data_dir)
    path = store.url(MANIFEST)
    text = store.read_text(MANIFEST)
    if text is None:
        raise ShardError(f"{path}: missing (run `{python_command('data_prep', 'finalize', location(data_dir))}`)")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShardError(f"{path}: not valid JSON ({exc})") from exc
    return Manifest.from_dict(raw, where=str(path))


def cached_tokenizer(store, prefix: str, sha256: str) -> Path:
    """The tokenizer files under ``prefix`` of a remote store, in ``$MLM_CACHE_DIR`` (default
    ``~/.cache/mlm-pretrain``) ``/tokenizers/<sha256>``: downloaded once per machine (renamed into place,
    so ranks racing each leave a whole copy), refused when its files do not hash to ``sha256``."""
    from .tokenizer import TOKENIZER_FILES            # tokenizer.py imports this module

    root = Path(os.environ.get("MLM_CACHE_DIR") or Path.home() / ".cache" / "mlm-pretrain") / "tokenizers"
    dest = root / sha256
    if dest.is_dir():
        return dest
    try:
        names = [n[len(prefix) + 1:] for n in store.list(prefix)]
    except StorageError:                              # https: no listing; the files a tokenizer has
        names = [n for n in TOKENIZER_FILES if store.stat(f"{prefix}/{n}") is not None]
    files = {name: store.read_bytes(f"{prefix}/{name}") for name in names}
    if files_sha256(files) != sha256:
        raise ShardError(f"{store.url(prefix)}: the tokenizer's files do not hash to the manifest's "
                         f"tokenizer.sha256 {sha256[:12]}... (changed after data prep, or incomplete)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=root))
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    try:
        os.rename(tmp, dest)
    except OSError:                                   # another rank's copy won
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def tokenizer_sha256(folder: str | os.PathLike, names: list[str] | None = None) -> str:
    """The ``tokenizer.sha256`` of the manifest: over the folder's regular files (or ``names``), in sorted
    name order, each as its name, a NUL byte, its size (8 bytes little-endian) and its bytes."""
    folder = Path(folder)
    if names is None:
        names = [p.name for p in folder.iterdir() if p.is_file()]
    return files_sha256({name: (folder / name).read_bytes() for name in names})


def files_sha256(files: dict[str, bytes]) -> str:
    """``tokenizer_sha256`` of files given by name and bytes (a tokenizer copy read from a bucket)."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
