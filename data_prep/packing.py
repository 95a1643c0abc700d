"""Packing a split's token stream into sequences of exactly ``seq_len`` tokens, and the per-shard shuffle.

The rule, in full: a split's documents of one packing group (``data_prep.groups``; in file order,
empty ones dropped) form one stream
``d0 [SEP] d1 [SEP] d2 ...``. The stream is cut into bodies of ``seq_len - 2`` tokens, each sent as
``[CLS] body [SEP]``; a separator that would open a body is dropped, since the ``[SEP]`` closing the
previous sequence already separates the two documents. Long documents continue in the next sequence.
Only the stream's last body may be short: it is sent as ``[CLS] body [SEP] [PAD] ...``. So the bodies
concatenated give back the stream, less those dropped separators. (When a document ends one token
before a body's end, that body ends in its separator and the sequence in ``[SEP] [SEP]``: exactly
``seq_len`` tokens leave no other choice but a one-token fragment of the next document or padding.)

Word starts: ``[CLS]``, ``[SEP]`` and ``[PAD]`` are marked as word starts (each is a word of its own,
so whole-word masking never glues one to a neighbouring word); text tokens carry the tokenizer's bit.

Every sequence also reports where the stream stands after it (document index in the group and token
offset inside that document): a task resumed after a kill restarts each split's stream there.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .tokenizer import Encoded


@dataclass
class Packed:
    ids: np.ndarray  # [n, seq_len]
    starts: np.ndarray  # [n, seq_len] bool
    end_doc: np.ndarray  # [n] group-local index of the document the stream stands in after each sequence
    end_offset: np.ndarray  # [n] tokens of that document already packed
    padding: int = 0  # [PAD] tokens in these sequences

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def empty(seq_len: int, dtype) -> "Packed":
        z = np.empty(0, np.int64)
        return Packed(np.empty((0, seq_len), dtype), np.empty((0, seq_len), bool), z, z.copy())


class Packer:
    """Streaming implementation of the rule above; numpy per batch, a Python step per sequence only."""

    def __init__(self, seq_len: int, cls_id: int, sep_id: int, pad_id: int, dtype):
        if seq_len < 3:
            raise ValueError(f"seq_len {seq_len} < 3 leaves no room for [CLS] x [SEP]")
        self.seq_len, self.body = seq_len, seq_len - 2
        self.cls_id, self.sep_id, self.pad_id = cls_id, sep_id, pad_id
        self.dtype = np.dtype(dtype)
        # the stream not yet cut, and what we know about the documents overlapping it
        self._ids = np.empty(0, self.dtype)
        self._starts = np.empty(0, bool)
        self._is_sep = np.empty(0, bool)
        self._doc_pos = np.empty(0, np.int64)  # where each document's first token sits in the buffer
        self._doc_id = np.empty(0, np.int64)
        self._doc_base = np.empty(0, np.int64)  # tokens of the document cut off before it was fed (resume)
        self._fresh = True  # nothing fed yet: no separator before the first document

    def add(self, enc: Encoded, doc_ids: np.ndarray, first_offset: int = 0) -> Packed:
        """Feed documents (in stream order); returns every sequence that is now complete.
        ``first_offset``: the first document starts that many tokens in (a resumed stream)."""
        lens, doc_ids = enc.lens, np.asarray(doc_ids, np.int64)
        base = np.zeros(len(lens), np.int64)
        ids, starts = enc.ids, enc.starts
        if first_offset:
            ids, starts = ids[first_offset:], starts[first_offset:]
            lens = lens.copy()
            lens[0] -= first_offset
            base[0] = first_offset
        keep = lens > 0
        if not keep.all():
            lens, doc_ids, base = lens[keep], doc_ids[keep], base[keep]
        if len(lens) == 0:
            return Packed.empty(self.seq_len, self.dtype)

        # the batch as a stream piece: a separator before every document, content behind it
        n_tokens = int(lens.sum())
        piece_ids = np.full(n_tokens + len(lens), self.sep_id, self.dtype)
        piece_starts = np.ones(len(piece_ids), bool)
        piece_sep = np.ones(len(piece_ids), bool)
        content = np.arange(n_tokens) + np.repeat(np.arange(1, len(lens) + 1), lens)
        piece_ids[content] = ids
        piece_starts[content] = starts
        piece_sep[content] = False
        doc_pos = np.cumsum(lens + 1) - lens
        if self._fresh:
            piece_ids, piece_starts, piece_sep, doc_pos = piece_ids[1:], piece_starts[1:], piece_sep[1:], doc_pos - 1
            self._fresh = False

        offset = len(self._ids)
        self._ids = np.concatenate([self._ids, piece_ids])
        self._starts = np.concatenate([self._starts, piece_starts])
        self._is_sep = np.concatenate([self._is_sep, piece_sep])
        self._doc_pos = np.concatenate([self._doc_pos, doc_pos + offset])
        self._doc_id = np.concatenate([self._doc_id, doc_ids])
        self._doc_base = np.concatenate([self._doc_base, base])
        return self._cut()

    def _cut(self) -> Packed:
        n, body, is_sep = len(self._ids), self.body, self._is_sep
        body_starts = []
        p = 0
        while True:
            if p < n and is_sep[p]:
                p += 1
            if p + body > n:
                break
            body_starts.append(p)
            p += body
        bs = np.asarray(body_starts, np.int64)
        index = bs[:, None] + np.arange(body)
        packed = self._frame(self._ids[index], self._starts[index])
        ends = bs + body
        doc = np.searchsorted(self._doc_pos, ends, side="right") - 1
        packed.end_doc = self._doc_id[doc]
        packed.end_offset = self._doc_base[doc] + ends - self._doc_pos[doc]
        self._drop_before(p)
        return packed

    def _frame(self, body_ids: np.ndarray, body_starts: np.ndarray, pad: int = 0) -> Packed:
        n, fill = len(body_ids), body_ids.shape[1]
        ids = np.empty((n, self.seq_len), self.dtype)
        ids[:, 0] = self.cls_id
        ids[:, 1 : 1 + fill] = body_ids
        ids[:, 1 + fill] = self.sep_id
        ids[:, 2 + fill :] = self.pad_id
        starts = np.ones((n, self.seq_len), bool)
        starts[:, 1 : 1 + fill] = body_starts
        z = np.zeros(n, np.int64)
        return Packed(ids, starts, z, z.copy(), padding=pad * n)

    def _drop_before(self, p: int) -> None:
        self._ids, self._starts, self._is_sep = self._ids[p:], self._starts[p:], self._is_sep[p:]
        first = max(int(np.searchsorted(self._doc_pos, p, side="right")) - 1, 0)
        self._doc_pos = self._doc_pos[first:] - p
        self._doc_id, self._doc_base = self._doc_id[first:], self._doc_base[first:]

    def finish(self) -> Packed:
        """The stream's last, short body as one padded sequence (or nothing)."""
        ids, starts = self._ids, self._starts
        if len(ids) and self._is_sep[0]:
            ids, starts = ids[1:], starts[1:]
        if len(ids) == 0:
            return Packed.empty(self.seq_len, self.dtype)
        packed = self._frame(ids[None, :], starts[None, :], pad=self.body - len(ids))
        # the stream now stands at the end of its last document
        packed.end_doc[:] = self._doc_id[-1]
        packed.end_offset[:] = self._doc_base[-1] + len(self._ids) - self._doc_pos[-1]
        self._drop_before(len(self._ids))
        return packed


def shard_permutation(seed: int, split: str, source: int, group: int, index: int, n: int) -> np.ndarray:
    """Order of a shard's sequences on disk: position ``j`` holds the ``perm[j]``-th packed sequence.
    Depends only on (seed, split, packing group, shard index): not on the task that writes it, and a
    resumed task shuffles as the first run did."""
    rng = np.random.default_rng([seed, zlib.crc32(split.encode()), source, group, index])
    return rng.permutation(n)
