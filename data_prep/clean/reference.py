"""The in-memory clustering: every document's signatures in one array, the exact groups, the LSH
candidates and their connected components decided at once. The product decides the same in stages
over sorted key files (``dedup``, ``clusters``: memory is one key range, at any corpus size); this is
what those stages must match, document for document (the tests' oracle), and what the benches use
to measure recall on a sample that fits in memory."""

from __future__ import annotations

import numpy as np

from .lsh import agreement, buckets, components, neighbour_pairs


def exact_groups(exact: np.ndarray, keys: np.ndarray, alive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(representative per document, removed mask): among ``alive`` documents with the same exact key,
    all but the smallest ``keys`` entry are removed. ``exact`` and ``keys`` are ``S16`` arrays."""
    n = len(exact)
    rep = np.arange(n)
    idx = np.flatnonzero(alive)
    if len(idx) == 0:
        return rep, np.zeros(n, bool)
    order = idx[np.lexsort((keys[idx], exact[idx]))]
    first = np.ones(len(order), bool)
    first[1:] = exact[order[1:]] != exact[order[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    rep[order] = order[group_start]
    removed = np.zeros(n, bool)
    removed[order[~first]] = True
    return rep, removed


def band_pairs(signatures: np.ndarray, bands: int, rows: int, min_similarity: float = 0.0) -> np.ndarray:
    """(i, j) pairs, i < j, of rows that agree on all ``rows`` values of at least one band (LSH
    candidates) and on at least ``min_similarity`` of all values (the estimated Jaccard similarity:
    drops the rare pair of unrelated documents that share one band by chance)."""
    pairs = []
    for b in range(bands):
        order, same = buckets(signatures[:, b * rows : (b + 1) * rows])
        if same.any():
            pairs.append(neighbour_pairs(np.concatenate([[0], np.cumsum(~same)]), order))
    if not pairs:
        return np.zeros((0, 2), np.int64)
    pairs = np.unique(np.concatenate(pairs), axis=0)
    if min_similarity > 0:
        pairs = pairs[agreement(signatures, pairs[:, 0], pairs[:, 1]) >= min_similarity]
    return pairs


def near_clusters(
    signatures: np.ndarray, keys: np.ndarray, alive: np.ndarray, bands: int, rows: int, min_similarity: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """(representative per document, removed mask): LSH over the ``alive`` documents' signatures;
    each connected component keeps its smallest ``keys`` member."""
    n = len(keys)
    rep = np.arange(n)
    idx = np.flatnonzero(alive)
    removed = np.zeros(n, bool)
    if len(idx) < 2:
        return rep, removed
    pairs = band_pairs(signatures[idx], bands, rows, min_similarity)
    label = components(len(idx), pairs)
    order = np.lexsort((keys[idx], label))
    first = np.ones(len(order), bool)
    first[1:] = label[order[1:]] != label[order[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    rep[idx[order]] = idx[order[group_start]]
    removed[idx[order[~first]]] = True
    return rep, removed
