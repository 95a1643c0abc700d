"""Seeds derived from where the run is, so that a resumed run draws exactly what it would have."""

from __future__ import annotations

import hashlib


def derive_seed(namespace: str, *parts: int) -> int:
    """A well-mixed 63-bit seed from ``(namespace, *parts)``: nearby tuples give unrelated streams."""
    key = "/".join([namespace, *(str(int(p)) for p in parts)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
