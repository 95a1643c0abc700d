"""Where data lives: a local folder, ``s3://bucket/prefix``, or ``https://host/prefix`` (read only).

The one package that knows what a scheme is (one module per scheme). ``open_store(url)`` gives a ``Store``, a folder of named
objects; ``data_prep`` (and, in later steps, the trainer's data and checkpoint code) call it with
names relative to that folder, and local paths go through the same calls as buckets.

S3 goes through boto3 directly: endpoint, region and credentials come from the standard AWS
variables and files (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``, ...), resolved by
boto3 itself, so no secret passes through this code or any message it writes. A ranged read is one
``GetObject`` with ``Range``; a file goes up with boto3's managed transfer (multipart above 64 MiB),
which makes the object visible only once complete; our sha256 rides along as object metadata, so
a re-run can skip a finished object from a ``HeadObject`` alone. Transient failures (connection
errors, 5xx, ``SlowDown``) are retried with exponential backoff and logged once per store; access
errors, a missing bucket and an unsupported scheme are ``StorageError``: bad input, exit 2, naming
the URL.
"""

from __future__ import annotations

import os

from data_prep.common.storage.base import (
    SCHEME,
    ObjectInfo,
    StorageError,
    Store,
    StoreUnavailable,
    attempt_timeouts,
    is_url,
    retry_window_s,
    set_retry_window,
    sha256_bytes,
)
from data_prep.common.storage.http_store import HttpStore
from data_prep.common.storage.local_store import LocalStore
from data_prep.common.storage.s3_store import S3Store

__all__ = [
    "HttpStore",
    "LocalStore",
    "ObjectInfo",
    "S3Store",
    "StorageError",
    "Store",
    "StoreUnavailable",
    "attempt_timeouts",
    "is_url",
    "open_store",
    "retry_window_s",
    "set_retry_window",
    "sha256_bytes",
]


def open_store(location: str | os.PathLike) -> Store:
    """The store for a local path, ``s3://bucket/prefix`` or ``http(s)://host/prefix``; any other
    scheme is a ``StorageError`` (never a local folder named after it)."""
    text = str(location)
    scheme = SCHEME.match(text)
    if scheme is None:
        return LocalStore(text)
    kind = scheme.group(1).lower()
    if kind == "s3":
        return S3Store(text)
    if kind in ("https", "http"):
        return HttpStore(text)
    if kind == "file":
        return LocalStore(text[len("file://") :])
    raise StorageError(
        f"{text}: the scheme {kind}:// is not supported (use a local path, s3://bucket/prefix, "
        "or https://host/prefix to read)"
    )
