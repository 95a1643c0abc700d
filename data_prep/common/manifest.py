"""The data contract, part 2: ``manifest.json``, the one file the trainer trusts; the shards it
lists are ``data_prep.common.shards``.

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
import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

from data_prep.common.commands import location, python_command
from data_prep.common.errors import ShardError
from data_prep.common.paths import name_problem
from data_prep.common.storage import open_store

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


# Read once, checked once: every reader gets these types, never the raw dict.

SPECIAL_ROLES = ("pad", "unk", "cls", "sep", "mask")  # the tokenizer's special ids, all in every manifest
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
    source: int | None  # input source and packing group (data_prep.groups); None in manifests written
    group: int | None  # before packing groups, whose entries named the array task instead
    index: int
    sequences: int
    blocks: int
    tokens: int  # sequences x seq_len - padding
    padding: int
    bytes: int
    sha256: str
    block_offsets: tuple[int, ...] | None = None  # blocks + 1 byte offsets; None in older manifests
    block_crc32: tuple[int, ...] | None = None  # blocks CRC-32s of those spans; None in older manifests
    _TEXT_KEYS: ClassVar[tuple[str, ...]] = ("name", "split", "sha256")
    _LIST_KEYS: ClassVar[tuple[str, ...]] = ("block_offsets", "block_crc32")  # the others are integers
    _OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ("source", "group", "block_offsets", "block_crc32")

    @classmethod
    def read(cls, raw, where: str, problems: list[str]) -> ShardEntry | None:
        if (raw := _object(raw, where, problems)) is None:
            return None
        before = len(problems)
        kind = {**{k: str for k in cls._TEXT_KEYS}, **{k: list for k in cls._LIST_KEYS}}
        values = {
            f.name: _field(
                raw, f.name, kind.get(f.name, int), where, problems, required=f.name not in cls._OPTIONAL_KEYS
            )
            for f in fields(cls)
        }
        _name_and_digest(values, "name", where, problems)
        if len(problems) == before and values["block_offsets"] is not None:
            values["block_offsets"] = _block_offsets(values, where, problems)
        if len(problems) == before and values["block_crc32"] is not None:
            crcs = values["block_crc32"]
            if len(crcs) != values["blocks"] or not all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in crcs
            ):
                problems.append(f"{where}block_crc32: not {values['blocks']} CRC-32 values")
            values["block_crc32"] = tuple(crcs)
        return cls(**values) if len(problems) == before else None


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _name_and_digest(values: dict, name_key: str, where: str, problems: list[str]) -> None:
    """A shard's name or the tokenizer's path is joined to the data folder, and a sha256 names cached
    files: a plain relative name and 64 hex digits, never a path out of either folder."""
    if values[name_key] is not None and (problem := name_problem(values[name_key])):
        problems.append(f"{where}{name_key}: {values[name_key]!r} is {problem}, not a name inside the data folder")
    if values["sha256"] is not None and not _SHA256.fullmatch(values["sha256"]):
        problems.append(f"{where}sha256: {values['sha256'][:80]!r} is not 64 hexadecimal digits")


def _block_offsets(values: dict, where: str, problems: list[str]) -> tuple[int, ...] | None:
    """``blocks + 1`` increasing integers within the shard's bytes, or a problem naming the entry."""
    offsets = values["block_offsets"]
    if (
        len(offsets) != values["blocks"] + 1
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or any(b <= a for a, b in zip(offsets, offsets[1:]))
        or offsets[0] < 0
        or offsets[-1] > values["bytes"]
    ):
        problems.append(
            f"{where}block_offsets: not {values['blocks'] + 1} increasing byte offsets within "
            f"its {values['bytes']} bytes"
        )
        return None
    return tuple(offsets)


@dataclass(frozen=True)
class TokenizerInfo(_AsJson):
    """The manifest's ``tokenizer``: the copy beside the shards (``path``, relative to the data folder)."""

    path: str
    sha256: str  # tokenizer_sha256 of that folder
    vocab_size: int
    lowercase: bool
    special_ids: dict[str, int]  # an id for each of SPECIAL_ROLES
    special_tokens: dict[str, str]

    @classmethod
    def read(cls, raw, where: str, problems: list[str]) -> TokenizerInfo | None:
        if (raw := _object(raw, where, problems)) is None:
            return None
        before = len(problems)
        kinds = {
            "path": str,
            "sha256": str,
            "vocab_size": int,
            "lowercase": bool,
            "special_ids": dict,
            "special_tokens": dict,
        }
        values = {key: _field(raw, key, kind, where, problems) for key, kind in kinds.items()}
        _name_and_digest(values, "path", where, problems)
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
    dtype: str  # of input_ids: ids_dtype(tokenizer.vocab_size)
    tokenizer: TokenizerInfo
    num_tasks: int
    shards: tuple[ShardEntry, ...]  # by split (train first), then source, group, index
    totals: dict[str, dict[str, int]]  # per split: shards, sequences, tokens, padding, documents
    settings: dict  # the resolved data-prep settings

    @classmethod
    def from_dict(cls, raw, where: str = MANIFEST) -> Manifest:
        """Raises ``ShardError`` naming ``where`` and every key that is missing or of the wrong type."""
        if not isinstance(raw, dict):
            raise ShardError(f"{where}: not a data_prep manifest (a JSON {type(raw).__name__}, not an object)")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ShardError(f"{where}: format_version {raw.get('format_version')!r}, this code reads {FORMAT_VERSION}")
        problems: list[str] = []
        values = {
            key: _field(raw, key, kind, "", problems)
            for key, kind in (
                ("format_version", int),
                ("seq_len", int),
                ("block_size", int),
                ("dtype", str),
                ("tokenizer", dict),
                ("num_tasks", int),
                ("shards", list),
                ("totals", dict),
                ("settings", dict),
            )
        }
        if values["tokenizer"] is not None:
            values["tokenizer"] = TokenizerInfo.read(values["tokenizer"], "tokenizer.", problems)
        if values["shards"] is not None:
            values["shards"] = tuple(
                ShardEntry.read(entry, f"shards[{i}].", problems) for i, entry in enumerate(values["shards"])
            )
        problems += [
            f"totals.{split}: not {_KIND_NAMES[dict]}"
            for split, t in (values["totals"] or {}).items()
            if not isinstance(t, dict)
        ]
        if problems:
            shown = problems[:_PROBLEMS_SHOWN] + (
                [f"... and {len(problems) - _PROBLEMS_SHOWN} more"] if len(problems) > _PROBLEMS_SHOWN else []
            )
            raise ShardError(f"{where}: not a data_prep manifest:\n  " + "\n  ".join(shown))
        return cls(**values)

    def shards_of(self, split: str) -> list[ShardEntry]:
        return [s for s in self.shards if s.split == split]

    def has_split(self, split: str) -> bool:
        """Whether any shard belongs to ``split`` (a data set may have no validation split)."""
        return any(s.split == split for s in self.shards)


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
