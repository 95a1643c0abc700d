"""``https://host/prefix`` (and ``http://``), read only: ranged reads need a server that honours Range."""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from data_prep.common.storage.base import ObjectInfo, StorageError, Store, attempt_timeouts, with_retries

_CHUNK = 1 << 16


def _body(response: http.client.HTTPResponse, deadline: float) -> bytes:
    """The whole body by ``deadline`` (else TimeoutError), and as long as its Content-Length (else
    IncompleteRead): both transient, retried, and in the end the store's outage."""
    chunks, got = [], 0
    sock = getattr(getattr(response.fp, "raw", None), "_sock", None)  # to bound each wait by the deadline
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the body did not arrive within {attempt_timeouts()[1]:.0f} s ({got:,} bytes came)")
        if sock is not None:
            sock.settimeout(max(0.05, min(left, sock.gettimeout() or left)))
        chunk = response.read1(_CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    expected = response.headers.get("Content-Length")
    if expected is not None and got != int(expected):
        raise http.client.IncompleteRead(b"".join(chunks), int(expected) - got)
    return b"".join(chunks)


class HttpStore(Store):
    """``https://host/prefix`` (and ``http://``): read only, ranged reads need a server that honours Range."""

    def __init__(self, url: str):
        self.root = url.rstrip("/")

    def _open(self, name: str, what: str, headers: Optional[dict] = None, method: str = "GET"):
        request = urllib.request.Request(self.url(name), headers=headers or {}, method=method)

        def transient(exc: BaseException) -> bool:
            if isinstance(exc, urllib.error.HTTPError):
                return exc.code >= 500 or exc.code == 429
            return isinstance(exc, (urllib.error.URLError, ConnectionError, TimeoutError, http.client.IncompleteRead))

        def fetch():
            # The socket's timeout bounds each read, not the body: a server that sends a byte a second
            # would never time out. Each attempt has one deadline (the read timeout) for headers and body.
            deadline = time.monotonic() + attempt_timeouts()[1]
            with urllib.request.urlopen(request, timeout=min(60.0, attempt_timeouts()[1])) as response:
                body = b"" if method == "HEAD" else _body(response, deadline)
                return response.status, dict(response.headers), body

        try:
            return with_retries(self, name, what, fetch, transient)
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "HEAD":
                return 404, {}, b""
            raise StorageError(f"{self.url(name)}: {what} failed (HTTP {exc.code} {exc.reason})") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise StorageError(f"{self.url(name)}: {what} failed ({exc})") from None

    def read_bytes(self, name: str) -> bytes:
        return self._open(name, "read")[2]

    def read_range(self, name: str, start: int, end: int) -> bytes:
        status, _, data = self._open(name, "ranged read", {"Range": f"bytes={start}-{end - 1}"})
        if status != 206 or len(data) != end - start:
            raise StorageError(
                f"{self.url(name)}: the server answered a range request with HTTP {status} and "
                f"{len(data)} bytes (it must honour Range: bytes={start}-{end - 1})"
            )
        return data

    def stat(self, name: str) -> Optional[ObjectInfo]:
        status, headers, _ = self._open(name, "stat", method="HEAD")
        if status == 404:
            return None
        size = {k.lower(): v for k, v in headers.items()}.get("content-length")
        if size is None:
            raise StorageError(f"{self.url(name)}: the server gives no Content-Length")
        return ObjectInfo(int(size), None)

    def list(self, prefix: str = "") -> dict[str, int]:
        raise StorageError(
            f"{self.url(prefix)}: an https:// folder cannot be listed; only data with a "
            "manifest.json can be read from one"
        )

    def _read_only(self, name: str, *_):
        raise StorageError(f"{self.url(name)}: https:// locations are read only")

    write_bytes = put_file = _read_only

    def delete(self, names: list[str]) -> None:
        self._read_only(names[0] if names else "")

    def check(self, write: bool) -> None:
        if write:
            self._read_only("")

    def staging_dir(self) -> Path:
        self._read_only("")
