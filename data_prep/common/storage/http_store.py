"""``https://host/prefix`` (and ``http://``), read only: ranged reads need a server that honours Range."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from data_prep.common.storage.base import ObjectInfo, StorageError, Store, attempt_timeouts, with_retries


class HttpStore(Store):
    """``https://host/prefix`` (and ``http://``): read only, ranged reads need a server that honours Range."""

    def __init__(self, url: str):
        self.root = url.rstrip("/")

    def _open(self, name: str, what: str, headers: Optional[dict] = None, method: str = "GET"):
        request = urllib.request.Request(self.url(name), headers=headers or {}, method=method)

        def transient(exc: BaseException) -> bool:
            if isinstance(exc, urllib.error.HTTPError):
                return exc.code >= 500 or exc.code == 429
            return isinstance(exc, (urllib.error.URLError, ConnectionError, TimeoutError))

        def fetch():
            with urllib.request.urlopen(request, timeout=min(60.0, attempt_timeouts()[1])) as response:
                return response.status, dict(response.headers), response.read()

        try:
            return with_retries(self, name, what, fetch, transient)
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "HEAD":
                return 404, {}, b""
            raise StorageError(f"{self.url(name)}: {what} failed (HTTP {exc.code} {exc.reason})") from None
        except (urllib.error.URLError, OSError) as exc:
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
