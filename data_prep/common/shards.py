"""The data contract, part 1: the shard tar (its blocks, their members, names, and how they are
read and checked). Part 2, ``manifest.json``: ``data_prep.common.manifest``.

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

What the manifest records about each shard: ``data_prep.common.manifest``.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from data_prep.common.errors import ShardError

if TYPE_CHECKING:
    from data_prep.common.manifest import ShardEntry

TAR_BLOCK = tarfile.BLOCKSIZE  # 512: a tar header, and the unit member data is padded to
IDS_EXT = "input_ids.npy"
WORD_STARTS_EXT = "word_starts.npy"
DEFAULT_BLOCK_SIZE = 256


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
        self.block_offsets: list[int] = []  # the manifest's block_offsets, complete after close()
        self.block_crc32: list[int] = []  # and its block_crc32

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
        self.block_offsets.append(self._tar.offset)  # the end of the last block, before tar's end marker
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        with open(self.tmp, "rb") as f:  # the bytes as written (from the page cache)
            self.block_crc32 = [
                block_checksum(f.read(end - start)) for start, end in zip(self.block_offsets, self.block_offsets[1:])
            ]
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
        raise ShardError(
            f"{where}: its bytes are not those data prep wrote (CRC-32 {got:08x}, the manifest's "
            f"{entry.block_crc32[index]:08x}): the shard was replaced or edited after finalize"
        )


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
            raise ShardError(
                f"{path}: members {ids.name!r} and {starts.name!r} are not one block's {IDS_EXT} and {WORD_STARTS_EXT}"
            )
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
            info = tarfile.TarInfo.frombuf(span[pos : pos + TAR_BLOCK], tarfile.ENCODING, "surrogateescape")
        except tarfile.TarError as exc:
            raise ShardError(f"{where}: no {ext} tar header at byte {pos} of the block ({exc})") from exc
        key, _, got = info.name.partition(".")
        data = span[pos + TAR_BLOCK : pos + TAR_BLOCK + info.size]
        if got != ext:
            raise ShardError(f"{where}: member {info.name!r} where the block's {ext} should be")
        if len(data) != info.size:
            raise ShardError(
                f"{where}: member {info.name!r} of {info.size} bytes runs past the block's "
                f"{len(span)} bytes (truncated read?)"
            )
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
