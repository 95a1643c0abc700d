"""The exact, pairs and clusters stages at any corpus size: duplicates found from per-group *sorted*
key files, one key range at a time, so that memory follows the candidates, not the corpus (as
datatrove's MinHash stages read sorted buckets).

The signatures stage writes, beside each group's ``sig-<group>.npz``, ``keys-<group>.npz`` with the
group's kept-so-far documents (not removed by language or quality) sorted by key: the exact key
(``exact``: two uint64 words, the record key, the document) and, per LSH band, a 64-bit hash of the
band's values (``band``: bands x n hashes, each row sorted, and the documents in that order). The
clusters stage then walks the key space in ``ranges`` slices: for each slice it takes every group's
part (a binary search in the sorted row), sorts them together and reads off the equal keys. A slice
holds about ``documents / ranges`` keys; only candidate pairs and duplicates outlive it.

Documents are named by a global id: the group's offset (groups in input order) plus the position in
the group. Band hashes can collide (two different bands, one hash: about one pair in 2^64 per band);
the agreement check on the full signatures (``near.min_similarity``) drops such a pair.

The work splits into **units** that array tasks share out (unit u to task u mod K): an exact-key
range, or a (band, band-hash range) pair. A key is in one range only and a bucket is one hash, so
every exact group and every LSH bucket lies whole inside one unit: the units' results joined are
the whole corpus's, at any number of tasks. The number of ranges follows the corpus
(``key_ranges``), never the number of tasks.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from .lsh import components, neighbour_pairs, sorted_unique

_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def band_hashes(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(bands, n) uint64: each band's ``rows`` uint32 values mixed into one 64-bit hash (splitmix64's
    finaliser over a running combination)."""
    n = len(signatures)
    out = np.empty((bands, n), np.uint64)
    with np.errstate(over="ignore"):
        for b in range(bands):
            h = np.full(n, np.uint64(b) * _M1, np.uint64)
            for v in signatures[:, b * rows : (b + 1) * rows].T.astype(np.uint64):
                h = (h ^ v) * _M2
                h ^= h >> np.uint64(31)
            h = (h ^ (h >> np.uint64(30))) * _M3
            out[b] = h ^ (h >> np.uint64(27))
    return out


EXACT_ARRAYS = ("exact", "exact_key", "exact_doc")  # what the exact stage maps
BAND_ARRAYS = ("band", "band_doc")  # what the pairs stage maps, with MINHASH
MINHASH = "minhash"  # every document's full signature, row = position in the group (mapped, never read whole)


def key_file(group_tag: str, array: str) -> str:
    return f"keys-{group_tag}.{array}.npy"


def group_keys(
    exact: np.ndarray, keys: np.ndarray, signatures: np.ndarray | None, alive: np.ndarray, bands: int, rows: int
) -> dict[str, bytes]:
    """The alive documents' keys, sorted (see the module docstring), as ``.npy`` bytes by array name
    (one file each, so that the clusters stage can map them and read only the slices it needs)."""
    docs = np.flatnonzero(alive).astype(np.uint32)
    ex = exact[docs].view(np.uint64).reshape(-1, 2) if len(docs) else np.zeros((0, 2), np.uint64)
    order = np.lexsort((keys[docs], ex[:, 1], ex[:, 0])) if len(docs) else np.zeros(0, np.int64)
    arrays = {"exact": ex[order], "exact_key": keys[docs][order], "exact_doc": docs[order]}
    if signatures is not None and signatures.shape[1]:
        h = band_hashes(signatures[docs], bands, rows)
        o = np.argsort(h, axis=1, kind="stable")
        arrays["band"] = np.take_along_axis(h, o, axis=1)
        arrays["band_doc"] = docs[o]
        arrays[MINHASH] = signatures
    out = {}
    for name, array in arrays.items():
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(array))
        out[name] = buf.getvalue()
    return out


def key_ranges(documents: int, slice_keys: int) -> int:
    """Ranges of the 64-bit key space such that one holds about ``slice_keys`` keys."""
    return max(1, -(-documents // slice_keys))


def range_bounds(ranges: int) -> list[tuple[int, int]]:
    edges = [r * (1 << 64) // ranges for r in range(ranges)] + [1 << 64]
    return list(zip(edges[:-1], edges[1:]))


def owned(units: list, num_tasks: int, task: int) -> list:
    """The units of task ``task`` of ``num_tasks`` (round robin: neighbouring ranges, which hold
    about as many keys each, go to different tasks)."""
    return units[task::num_tasks]


def band_units(bands: int, ranges: int) -> list[tuple[int, int, int]]:
    """(band, lo, hi) for every band and hash range, band by band."""
    return [(b, lo, hi) for b in range(bands) for lo, hi in range_bounds(ranges)]


class Gone:
    """The documents already removed (exact duplicates), as one bit per global id: 125 MB for a
    billion documents, whatever share of them is gone."""

    def __init__(self, documents: int, ids: np.ndarray | None = None):
        self._bits = np.zeros(-(-documents // 8), np.uint8)  # set in place: never a byte a document
        self.any = False
        if ids is not None:
            self.add(ids)

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, np.int64)
        np.bitwise_or.at(self._bits, ids >> 3, (128 >> (ids & 7)).astype(np.uint8))
        self.any = self.any or bool(len(ids))

    def mask(self, gid: np.ndarray) -> np.ndarray:
        return ((self._bits[gid >> 3] >> (7 - (gid & 7)).astype(np.uint8)) & 1).astype(bool)


def _slice(sorted_row: np.ndarray, lo: int, hi: int) -> slice:
    a = np.searchsorted(sorted_row, np.uint64(lo), side="left")
    b = len(sorted_row) if hi >= 1 << 64 else np.searchsorted(sorted_row, np.uint64(hi), side="left")
    return slice(int(a), int(b))


@dataclass
class KeyFiles:
    """Every group's key arrays, memory-mapped (``load(i)``: group i's arrays by name), and its offset."""

    load: callable
    offsets: np.ndarray  # global id of each group's first document
    release: callable = lambda: None  # after each slice: unmap, so that mapped pages leave the process

    def __len__(self) -> int:
        return len(self.offsets)


def exact_duplicates(files: KeyFiles, bounds: list[tuple[int, int]], advance=None) -> tuple[np.ndarray, np.ndarray]:
    """(removed global ids, their representatives) of the exact keys in the ranges ``bounds``: per
    exact key, the document with the smallest record key stays. ``advance()`` after each range."""
    removed, reps = [], []
    for lo, hi in _counted(bounds, advance):
        ex, rk, gid = [], [], []
        for g in range(len(files)):
            d = files.load(g)
            s = _slice(d["exact"][:, 0], lo, hi)
            ex.append(d["exact"][s])
            rk.append(d["exact_key"][s])
            gid.append(d["exact_doc"][s].astype(np.int64) + files.offsets[g])
        ex, rk, gid = np.concatenate(ex), np.concatenate(rk), np.concatenate(gid)
        files.release()
        if len(gid) < 2:
            continue
        order = np.lexsort((rk, ex[:, 1], ex[:, 0]))
        ex, gid = ex[order], gid[order]
        first = np.ones(len(gid), bool)
        first[1:] = np.any(ex[1:] != ex[:-1], axis=1)
        start = np.maximum.accumulate(np.where(first, np.arange(len(gid)), 0))
        removed.append(gid[~first])
        reps.append(gid[start[~first]])
    if not removed:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    removed, reps = np.concatenate(removed), np.concatenate(reps)
    order = np.argsort(removed)
    return removed[order], reps[order]


def _counted(items: list, advance):
    """``items``, calling ``advance()`` as the loop over them asks for the next: a piece counts once done."""
    for item in items:
        yield item
        if advance:
            advance()


def band_pairs_confirmed(
    files: KeyFiles, units: list[tuple[int, int, int]], gone: Gone, confirm, advance=None
) -> np.ndarray:
    """The distinct (i, j) global-id pairs, i < j, that share a band hash in one of the ``units``
    (band, lo, hi) and that ``confirm`` keeps. In a bucket each member is paired with the next
    ``BUCKET_REACH`` members (in global-id order), as ``reference.band_pairs`` does; the ``gone``
    documents take no part. Each unit's candidates are confirmed before the next unit is read:
    memory holds one unit's candidates and the confirmed pairs, never all the candidates. ``advance()``
    after each unit."""
    found = [np.zeros((0, 2), np.int64)]
    for band, lo, hi in _counted(units, advance):
        hs, gid = [], []
        for g in range(len(files)):
            d = files.load(g)
            if "band" not in d:
                return found[0]
            s = _slice(d["band"][band], lo, hi)
            hs.append(d["band"][band][s])
            gid.append(d["band_doc"][band][s].astype(np.int64) + files.offsets[g])
        hs, gid = np.concatenate(hs), np.concatenate(gid)
        files.release()
        if gone.any and len(gid):
            keep = ~gone.mask(gid)
            hs, gid = hs[keep], gid[keep]
        if len(gid) < 2:
            continue
        order = np.lexsort((gid, hs))
        candidates = neighbour_pairs(hs[order], gid[order])
        if len(candidates):
            found.append(confirm(np.unique(candidates, axis=0)))
        if sum(map(len, found[1:])) > max(1 << 20, len(found[0])):  # a pair is found in up to every band
            found = [np.unique(np.concatenate(found), axis=0)]
    return np.unique(np.concatenate(found), axis=0)


BLOCK = 1 << 22  # documents at a time in a pass over every document's parent: no temporary of a corpus's size
BATCH_PAIRS = 1 << 20  # pairs joined at a time (~100 bytes each while joined)


class Components:
    """Connected components of pairs given in batches, over ``n`` documents (global ids): one parent
    per document, a root being its component's smallest id. Each batch is joined before the next is
    read, so memory is 4 bytes a document (8 from 2^31 documents) and one batch, however many pairs
    (a near copy can be confirmed by a dozen of them)."""

    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        self.steps_up = 0  # levels _roots has walked, all batches together (what a deep tree costs)

    def _roots(self, x: np.ndarray) -> np.ndarray:
        """The roots of ``x``: a step up per batch that moved the root of theirs, at most."""
        r = self.parent[x]
        while True:
            self.steps_up += 1
            up = self.parent[r]
            if np.array_equal(up, r):
                return r
            r = up

    def add(self, pairs: np.ndarray) -> None:
        """Joins the two documents of every (i, j) row. The batch's graph over the roots of its ends
        is split into components in one pass (scipy), and every root of a component is hooked under
        the smallest: a tree grows a level per batch at most, never a level per pair (hooking pair by
        pair made a bucket of 100,000 copies, each paired with the next 16, a chain 6,250 deep)."""
        for lo in range(0, len(pairs), BATCH_PAIRS):  # a bound on what a batch holds, whatever a file's size
            self._join(pairs[lo : lo + BATCH_PAIRS])

    def _join(self, pairs: np.ndarray) -> None:
        ra, rb = self._roots(pairs[:, 0]), self._roots(pairs[:, 1])
        self.parent[pairs[:, 0]], self.parent[pairs[:, 1]] = ra, rb  # the ends straight under their roots
        split = ra != rb
        ra, rb = ra[split], rb[split]
        if not len(ra):
            return
        roots = sorted_unique(np.concatenate([ra, rb]))
        ends = np.stack([np.searchsorted(roots, ra), np.searchsorted(roots, rb)], axis=1).astype(np.int32)
        label = components(len(roots), ends)
        smallest = np.full(label.max() + 1, len(self.parent), np.int64)
        np.minimum.at(smallest, label, roots)
        self.parent[roots] = smallest[label]

    def labels(self) -> np.ndarray:
        """Each document's root: its component's smallest id (its own where it is in no pair). Parents
        are replaced by grandparents in place, a block at a time, until none changes: no second array
        of a parent per document."""
        p, changed = self.parent, True
        while changed:
            changed = False
            for lo in range(0, len(p), BLOCK):
                part = p[lo : lo + BLOCK]  # a view: assigning to it writes into p
                up = p[part]
                if not np.array_equal(up, part):
                    part[:], changed = up, True
        return p


def clusters_of(label: np.ndarray, ident_of) -> tuple[np.ndarray, np.ndarray]:
    """(removed global ids, their representatives) of the near-duplicate clusters, from each
    document's component (``Components.labels``): each keeps its member with the smallest identity
    (``ident_of(members)``, members sorted; the smaller id where two are equal). Memory follows the
    documents in a cluster, not the pairs that joined them."""
    joined = np.concatenate(
        [np.zeros(0, np.int64)]
        + [
            np.flatnonzero(label[lo : lo + BLOCK] != np.arange(lo, min(lo + BLOCK, len(label)), dtype=label.dtype)) + lo
            for lo in range(0, len(label), BLOCK)
        ]
    )
    if not len(joined):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    roots = sorted_unique(label[joined])  # a root is its own label: never in ``joined``
    members = np.insert(joined, np.searchsorted(joined, roots), roots)
    del joined, roots  # here and below: the arrays of a member each are freed as soon as they are used
    ident, root = ident_of(members), label[members]
    order = np.lexsort((ident, root))  # by cluster, then identity (then id: lexsort is stable)
    del ident
    root = root[order]
    first = np.concatenate([[True], root[1:] != root[:-1]])  # each cluster's first: the one it keeps
    del root
    ordered = members[order]
    del members, order
    heads = np.flatnonzero(first)
    reps = np.repeat(ordered[heads], np.diff(np.append(heads, len(ordered))))[~first]
    removed = ordered[~first]
    del ordered, first
    o = np.argsort(removed)
    return removed[o], reps[o]
