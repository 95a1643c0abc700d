"""fastText's binary model format (``.bin``, and ``.ftz`` quantised), as fastText 0.9 reads it
(``FastText::loadModel``): the magic number and version, the training arguments, the dictionary, then
the input and output matrices. The one owner of the format here: ``quality_model`` writes through
``write_supervised``, and ``file_problems`` checks a file someone hands to ``--quality-model``.

fastText's loader trusts the header: a dictionary size of 2^31 makes it read entries past the end of
the file for ever (a 92-byte file took the cleaning parent to 2.9 GB in 64 s and kept growing), a
matrix of 2^32 x 2^30 makes it allocate 16 GiB before it reads a byte of it. ``file_problems`` reads
each count and dimension and checks it against the bytes the file has left, walking the dictionary
over a memory map: a damaged header is named, by field, in well under a second, with no memory beyond
the pages it reads."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

MAGIC, VERSION = 793712314, 12
LOSS_SOFTMAX, MODEL_SUPERVISED = 3, 3  # fastText's loss_name::softmax, model_name::sup
_ARGS = struct.Struct("<12id")  # dim ws epoch minCount neg wordNgrams loss model bucket minn maxn lrUpdateRate, t
_DICTIONARY = struct.Struct("<iiiqq")  # size nwords nlabels, ntokens pruneidx_size
_ENTRY_TAIL = 9  # after a word's NUL: its count (int64) and its type (int8)
_KSUB = 256  # a product quantiser's centroids per sub-quantiser (fastText's 8 bits)


def write_supervised(
    path: Path, args: tuple, entries: list[tuple[str, int, int]], ntokens: int, input_: np.ndarray, output: np.ndarray
) -> None:
    """A supervised model, not quantised: ``args`` the 12 integers and ``t`` of ``_ARGS``, ``entries``
    (word, count, type: 0 word, 1 label), the input and output matrices as float32. Written whole,
    renamed into place."""
    words = sum(1 for _, _, kind in entries if kind == 0)
    parts = [struct.pack("<ii", MAGIC, VERSION), _ARGS.pack(*args)]
    parts.append(_DICTIONARY.pack(len(entries), words, len(entries) - words, ntokens, -1))  # -1: not pruned
    parts += [word.encode("utf-8") + b"\0" + struct.pack("<qb", count, kind) for word, count, kind in entries]
    for matrix in (input_, output):
        parts.append(b"\0")  # not quantised
        parts.append(struct.pack("<qq", *matrix.shape))
        parts.append(np.ascontiguousarray(matrix, "<f4").tobytes())
    partial = path.with_name(path.name + ".tmp")
    partial.write_bytes(b"".join(parts))
    partial.replace(path)


class _Damaged(Exception):
    """A field whose value the file cannot hold (its message names the field)."""


class _Reader:
    def __init__(self, data: mmap.mmap):
        self.data, self.pos = data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def unpack(self, fmt: str, field: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.left() < size:
            raise _Damaged(f"the file ends inside {field} (byte {self.pos} of {len(self.data)})")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def skip(self, count: int, field: str, claim: str) -> None:
        if count < 0 or count > self.left():
            raise _Damaged(f"{field} claims {claim}: {count:,} bytes, and the file has {self.left():,} left")
        self.pos += count


def _dictionary(r: _Reader) -> None:
    size, nwords, nlabels, _, prune = r.unpack(_DICTIONARY.format, "the dictionary's header")
    if nwords < 0 or nlabels < 0 or size != nwords + nlabels:
        raise _Damaged(f"the dictionary's size {size:,} is not its {nwords:,} words and {nlabels:,} labels")
    if size * (1 + _ENTRY_TAIL) > r.left():  # every entry takes at least its NUL, its count and its type
        raise _Damaged(
            f"the dictionary's size claims {size:,} entries (at least {size * (1 + _ENTRY_TAIL):,} bytes), "
            f"and the file has {r.left():,} left"
        )
    for i in range(size):
        end = r.data.find(b"\0", r.pos)
        if end < 0:
            raise _Damaged(f"the dictionary's entry {i:,} of {size:,} has no end: the file ends inside it")
        r.pos = end + 1
        r.skip(_ENTRY_TAIL, f"the dictionary's entry {i:,}", "its count and type")
    if prune < -1:
        raise _Damaged(f"the dictionary's pruned index size is {prune:,}")
    r.skip(max(prune, 0) * 8, "the dictionary's pruned index", f"{prune:,} pairs")


def _matrix(r: _Reader, quantised: bool, name: str) -> int:
    """Walks the matrix; its columns."""
    if not quantised:
        rows, cols = r.unpack("<qq", f"the {name} matrix's shape")
        if rows < 0 or cols < 0:
            raise _Damaged(f"the {name} matrix's shape is {rows:,} x {cols:,}")
        r.skip(rows * cols * 4, f"the {name} matrix", f"{rows:,} x {cols:,} floats")
        return cols
    (qnorm,) = r.unpack("<?", f"the {name} matrix's norm flag")
    rows, cols, codes = r.unpack("<qqi", f"the quantised {name} matrix's header")
    if rows < 0 or cols < 0:
        raise _Damaged(f"the quantised {name} matrix's shape is {rows:,} x {cols:,}")
    r.skip(codes, f"the quantised {name} matrix's codes", f"{codes:,} bytes")
    _quantiser(r, f"the {name} matrix's product quantiser")
    if qnorm:
        r.skip(rows, f"the {name} matrix's norm codes", f"{rows:,} bytes")
        _quantiser(r, f"the {name} matrix's norm quantiser")
    return cols


def _quantiser(r: _Reader, field: str) -> None:
    dim, _, _, _ = r.unpack("<iiii", field)  # dim nsubq dsub lastdsub, then dim x 256 centroids
    r.skip(dim * _KSUB * 4, field, f"{dim:,} x {_KSUB} centroids")


def file_problems(path: str | os.PathLike) -> list[str]:
    """Why fastText's loader should not be handed ``path``: each problem names the field whose value
    the file cannot hold. [] for a file whose every count and size fits in it."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return ["an empty file, not a fastText model"]
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _problems(_Reader(data))
    except OSError as exc:
        return [f"cannot be read ({exc.strerror or exc})"]


def _problems(r: _Reader) -> list[str]:
    try:
        magic, version = r.unpack("<ii", "the magic number and version")
        if magic != MAGIC:
            return ["not a fastText model (its first bytes are not fastText's magic number)"]
        if not 11 <= version <= VERSION:
            return [f"fastText format version {version}; fastText 0.9 reads versions 11 and 12"]
        dim = r.unpack(_ARGS.format, "the training arguments")[0]
        _dictionary(r)
        (quantised,) = r.unpack("<?", "the input matrix's quantised flag")
        if _matrix(r, quantised, "input") != dim:  # fastText sizes its hidden vectors by dim
            raise _Damaged(f"the training arguments' dim {dim:,} is not the input matrix's width")
        (quantised_output,) = r.unpack("<?", "the output matrix's quantised flag")
        _matrix(r, quantised and quantised_output, "output")
    except _Damaged as exc:
        return [f"a damaged fastText header: {exc}"]
    return []
