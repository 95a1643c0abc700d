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
         "sequences": 2048, "blocks": 8, "tokens": 262000, "padding": 144, "bytes": 575488, "sha256": "..."}
      ],
      "totals": {"train": {"shards": 8, "sequences": 16384, "tokens": ..., "padding": ..., "documents": ...},
                 "validation": {...}},
      "settings": {...}                      # the resolved data-prep settings
    }

Within a shard every block holds ``block_size`` sequences except possibly the last, so a block's
sequence count follows from the manifest alone (``block_sizes``).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
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
        self._add(f"{key}.{IDS_EXT}", _npy_bytes(np.ascontiguousarray(input_ids, dtype=self.dtype)))
        self._add(f"{key}.{WORD_STARTS_EXT}", _npy_bytes(np.packbits(word_starts.astype(bool), axis=1)))
        self.blocks += 1
        self.sequences += input_ids.shape[0]

    def close(self) -> str:
        """Finish, fsync, rename into place; returns the shard's sha256."""
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        return sha256_file(self.path)

    def abort(self) -> None:
        try:
            self._tar.close()
            self._file.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def block_sizes(shard_entry: dict, block_size: int) -> list[int]:
    """Sequences in each block of a shard, from its manifest entry alone."""
    n, blocks = shard_entry["sequences"], shard_entry["blocks"]
    if blocks == 0:
        return []
    sizes = [block_size] * (blocks - 1) + [n - block_size * (blocks - 1)]
    if sizes[-1] <= 0 or sizes[-1] > block_size:
        raise ShardError(f"{shard_entry['name']}: {n} sequences do not fit {blocks} blocks of {block_size}")
    return sizes


def decode_block(ids_bytes: bytes, starts_bytes: bytes, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.load(io.BytesIO(ids_bytes), allow_pickle=False)
    packed = np.load(io.BytesIO(starts_bytes), allow_pickle=False)
    starts = np.unpackbits(packed, axis=1, count=seq_len).astype(bool)
    return ids, starts


@dataclass
class BlockRef:
    """Where one block lives inside a shard tar, for direct seeks."""
    ids_offset: int
    ids_size: int
    starts_offset: int
    starts_size: int


def index_shard(path: str | os.PathLike) -> list[BlockRef]:
    """Scan a shard's tar headers (no data is read) and return its blocks in order."""
    refs: list[BlockRef] = []
    pending: dict[str, tarfile.TarInfo] = {}
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                key, _, ext = info.name.partition(".")
                pending.setdefault(key, {})[ext] = info  # type: ignore[index]
                got = pending[key]
                if IDS_EXT in got and WORD_STARTS_EXT in got:
                    a, b = got[IDS_EXT], got[WORD_STARTS_EXT]
                    refs.append(BlockRef(a.offset_data, a.size, b.offset_data, b.size))
                    del pending[key]
    except (tarfile.TarError, OSError) as exc:
        raise ShardError(f"{path}: not a readable shard tar ({exc})") from exc
    if pending:
        raise ShardError(f"{path}: incomplete samples {sorted(pending)[:3]} (truncated shard?)")
    return refs


def read_block(f, ref: BlockRef, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    f.seek(ref.ids_offset)
    ids_bytes = f.read(ref.ids_size)
    f.seek(ref.starts_offset)
    starts_bytes = f.read(ref.starts_size)
    return decode_block(ids_bytes, starts_bytes, seq_len)


def iter_blocks(path: str | os.PathLike, seq_len: int):
    """Every (input_ids, word_starts) block of a shard, in order."""
    refs = index_shard(path)
    with open(path, "rb") as f:
        for ref in refs:
            yield read_block(f, ref, seq_len)


def load_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise ShardError(f"{path}: missing (run `data_prep finalize {data_dir}`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ShardError(f"{path}: not valid JSON ({exc})") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"{path}: format_version {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION}")
    return manifest


def tokenizer_sha256(folder: str | os.PathLike, names: list[str] | None = None) -> str:
    """The ``tokenizer.sha256`` of the manifest: over the folder's regular files (or ``names``), in sorted
    name order, each as its name, a NUL byte, its size (8 bytes little-endian) and its bytes."""
    folder = Path(folder)
    if names is None:
        names = [p.name for p in folder.iterdir() if p.is_file()]
    h = hashlib.sha256()
    for name in sorted(names):
        data = (folder / name).read_bytes()
        h.update(name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
