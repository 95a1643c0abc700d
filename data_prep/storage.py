"""Where data lives: a local folder, ``s3://bucket/prefix``, or ``https://host/prefix`` (read only).

The one module that knows what a scheme is. ``open_store(url)`` gives a ``Store``, a folder of named
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

import hashlib
import logging
import os
import random
import re
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .atomic import write_atomic
from .errors import DataPrepError

log = logging.getLogger("data_prep")

SHA256_METADATA = "sha256"          # S3 user metadata (x-amz-meta-sha256): the object's sha256, hex
MULTIPART_BYTES = 64 << 20
RETRY_ENV = "MLM_STORE_RETRY_S"     # how long transient failures are retried (the trainer sets data.remote_timeout_s)
DEFAULT_RETRY_S = 30.0
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_DENIED = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "403", "AllAccessDisabled",
           "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"}
_TRANSIENT = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed",
              "500", "502", "503", "504", "Throttling", "ThrottlingException"}


class StorageError(DataPrepError):
    """A URL that cannot be used: unsupported scheme, no access, no such bucket or object."""


class StoreUnavailable(StorageError):
    """Transient failures (connection errors, 5xx, throttling) outlasted the retry window: the store is
    down, not the data bad. The trainer exits 3 (requeue) on it; the last checkpoint resumes."""


def is_url(location: str | os.PathLike) -> bool:
    return bool(_SCHEME.match(str(location)))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    sha256: Optional[str]           # recorded at upload (S3) or None where not known without reading


class Store:
    """A folder of named objects. Names are relative, '/'-separated; ``url(name)`` is for messages."""
    root: str

    def url(self, name: str = "") -> str:
        return f"{self.root.rstrip('/')}/{name}" if name else self.root

    @property
    def local_dir(self) -> Optional[Path]:
        """The folder itself where the store is local, else None."""
        return None

    def read_bytes(self, name: str) -> bytes: raise NotImplementedError
    def read_range(self, name: str, start: int, end: int) -> bytes: raise NotImplementedError
    def stat(self, name: str) -> Optional[ObjectInfo]: raise NotImplementedError
    def list(self, prefix: str = "") -> dict[str, int]: raise NotImplementedError
    def write_bytes(self, name: str, data: bytes) -> None: raise NotImplementedError
    def put_file(self, local: Path, name: str, sha256: str, keep_local: bool = False) -> None:
        """Publish the complete file ``local`` as ``name`` whole (the object appears only complete);
        ``local`` is consumed unless ``keep_local``."""
        raise NotImplementedError
    def delete(self, names: list[str]) -> None: raise NotImplementedError
    def check(self, write: bool) -> None: raise NotImplementedError

    def delete_folder(self, prefix: str) -> None:
        """Every object under ``prefix/``."""
        self.delete(sorted(self.list(prefix)))

    def download(self, name: str, local: Path) -> None:
        """The object into the local file ``local``."""
        Path(local).write_bytes(self.read_bytes(name))

    def read_text(self, name: str) -> Optional[str]:
        """The object as text, or None where it does not exist."""
        if self.stat(name) is None:
            return None
        return self.read_bytes(name).decode("utf-8")

    def staging_dir(self) -> Path:
        """A local folder where files are written before ``put_file`` publishes them."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ local
class LocalStore(Store):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.path.expanduser(str(path)))
        self.root = str(self.path)

    @property
    def local_dir(self) -> Path:
        return self.path

    def _path(self, name: str) -> Path:
        return self.path / name if name else self.path

    def read_bytes(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except OSError as exc:
            raise StorageError(f"{self.url(name)}: cannot read ({exc.strerror or exc})") from None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with open(self._path(name), "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def stat(self, name: str) -> Optional[ObjectInfo]:
        path = self._path(name)
        return ObjectInfo(path.stat().st_size, None) if path.is_file() else None

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every file under ``prefix`` (a folder name, or '' for all), by name relative to the store."""
        found = {}
        # os.walk skips a folder that vanishes under it, and a file may vanish between listing and stat:
        # array tasks sharing the folder rename and delete their own files while another task lists.
        for folder, _, names in os.walk(self._path(prefix)):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    found[os.path.relpath(path, self.path)] = os.stat(path).st_size
                except FileNotFoundError:
                    continue
        return dict(sorted(found.items()))

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def put_file(self, local: Path, name: str, sha256: str, keep_local: bool = False) -> None:
        target = self._path(name)
        if Path(local).resolve() == target.resolve():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        if keep_local:
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            shutil.copyfile(local, tmp)
            os.replace(tmp, target)
        else:
            os.replace(local, target)

    def delete(self, names: list[str]) -> None:
        for name in names:
            self._path(name).unlink(missing_ok=True)

    def delete_folder(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def check(self, write: bool) -> None:
        if write:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"{self.path}: cannot create the folder ({exc.strerror or exc})") from None
        elif not self.path.is_dir():
            raise StorageError(f"{self.path}: no such folder")

    def staging_dir(self) -> Path:
        return self.path


# ------------------------------------------------------------------------------------------ retries
def set_retry_window(seconds: float) -> None:
    """How long this process and the ones it starts retry transient failures."""
    os.environ[RETRY_ENV] = str(float(seconds))


def retry_window_s() -> float:
    try:
        return max(0.0, float(os.environ.get(RETRY_ENV) or DEFAULT_RETRY_S))
    except ValueError:
        return DEFAULT_RETRY_S


def attempt_timeouts() -> tuple[float, float]:
    """(connect, read) seconds of one request: a server that accepts and then says nothing (frozen)
    costs at most this per attempt, and no attempt outlasts the retry window, so the wait from the
    first failure to ``StoreUnavailable`` is the window plus at most one attempt."""
    window = max(1.0, retry_window_s())
    return min(20.0, window), min(120.0, window)


def _with_retries(store: "Store", name: str, what: str, call: Callable, transient: Callable[[BaseException], bool]):
    """``call()``, again after a transient failure (backoff 0.5 s doubling to 16 s, jittered) until the
    retry window (``MLM_STORE_RETRY_S``, default 30 s) has passed, then ``StoreUnavailable``; the first
    retry of each store is logged, not every one."""
    started, attempt = time.monotonic(), 0
    while True:
        try:
            return call()
        except Exception as exc:      # noqa: BLE001 -- classified just below
            if not transient(exc):
                raise
            waited = time.monotonic() - started
            if waited >= retry_window_s():
                raise StoreUnavailable(f"{store.url(name)}: {what} failed for {waited:.0f} s "
                                       f"({type(exc).__name__}: {exc}); the store looks unavailable") from None
            if not getattr(store, "_retry_logged", False):
                store._retry_logged = True
                log.warning("%s: %s failed (%s); retrying with backoff", store.url(), what, type(exc).__name__)
            time.sleep(min(16.0, 0.5 * 2 ** attempt, max(0.05, retry_window_s() - waited))
                       * (0.5 + random.random() / 2))
            attempt += 1


# ------------------------------------------------------------------------------------------ s3
class S3Store(Store):
    """``s3://bucket/prefix`` through boto3; credentials and endpoint as boto3 resolves them."""

    def __init__(self, url: str):
        rest = url[len("s3://"):]
        self.bucket, _, prefix = rest.partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.bucket):
            raise StorageError(f"{url}: {self.bucket!r} is not an S3 bucket name")
        self.prefix = prefix.strip("/")
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._client, self._client_pid = None, None
        self._stage: Optional[Path] = None
        self._bucket_seen = False              # check() found the bucket: a 404 is then a missing object

    def __getstate__(self) -> dict:
        # A DataLoader worker gets a copy: boto3 clients are neither picklable nor safe across a fork.
        return {**self.__dict__, "_client": None, "_client_pid": None}

    @property
    def client(self):
        if self._client is None or self._client_pid != os.getpid():
            self._client_pid = os.getpid()
            import boto3
            from botocore.config import Config

            # botocore says at INFO where it found credentials, on every client: not our users' news.
            logging.getLogger("botocore").setLevel(logging.WARNING)
            # Our own retries (logged, classified); botocore's would hide them.
            connect, read = attempt_timeouts()
            self._client = boto3.session.Session().client(
                "s3", config=Config(retries={"total_max_attempts": 1}, connect_timeout=connect, read_timeout=read))
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, name: str, what: str, call: Callable):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                         NoCredentialsError, PartialCredentialsError)

        def unwrapped(exc: BaseException) -> BaseException:
            # boto3's transfers (upload_file, download_file) raise their own error around a ClientError
            inner = exc.__context__ if isinstance(exc, Boto3Error) else None
            return inner if isinstance(inner, (ClientError, BotoCoreError)) else exc

        def transient(exc: BaseException) -> bool:
            exc = unwrapped(exc)
            if isinstance(exc, ClientError):
                return _code(exc) in _TRANSIENT
            return isinstance(exc, (BotoConnectionError, ConnectionError, TimeoutError)) or (
                isinstance(exc, BotoCoreError) and "timeout" in type(exc).__name__.lower())

        try:
            return _with_retries(self, name, what, call, transient)
        except (BotoCoreError, ClientError, Boto3Error, OSError) as raised:
            exc = unwrapped(raised)
            if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
                raise StorageError(f"{self.url(name)}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                                   "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, and AWS_ENDPOINT_URL for a non-AWS "
                                   "server)") from None
            if isinstance(exc, ClientError):
                code = _code(exc)
                if code in _DENIED:
                    raise StorageError(f"{self.url(name)}: access denied ({code}) for {what}: check the AWS "
                                       "credentials and the bucket's policy") from None
                if code == "NoSuchBucket":
                    raise StorageError(f"{self.url(name)}: no such bucket {self.bucket!r}") from None
                raise StorageError(f"{self.url(name)}: {what} failed ({code})") from None
            raise StorageError(f"{self.url(name)}: {what} failed ({type(exc).__name__}: {exc})") from None

    def read_bytes(self, name: str) -> bytes:
        return self._call(name, "read", lambda: self.client.get_object(
            Bucket=self.bucket, Key=self._key(name))["Body"].read())

    def read_range(self, name: str, start: int, end: int) -> bytes:
        data = self._call(name, "ranged read", lambda: self.client.get_object(
            Bucket=self.bucket, Key=self._key(name), Range=f"bytes={start}-{end - 1}")["Body"].read())
        if len(data) != end - start:
            raise StorageError(f"{self.url(name)}: asked for bytes {start}-{end - 1}, got {len(data)} bytes")
        return data

    def stat(self, name: str) -> Optional[ObjectInfo]:
        from botocore.exceptions import ClientError

        def head():
            try:
                return self.client.head_object(Bucket=self.bucket, Key=self._key(name))
            except ClientError as exc:
                if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise
        got = self._call(name, "stat", head)
        if got is None:
            # S3 answers a HEAD in a bucket that does not exist with the same bare 404: ask the bucket
            # (once: the mirror polls for objects still to come), so that a wrong bucket name is said
            # as such, not as a missing object.
            if not self._bucket_seen:
                self.check(write=False)
                self._bucket_seen = True
            return None
        return ObjectInfo(int(got["ContentLength"]), got.get("Metadata", {}).get(SHA256_METADATA))

    def list(self, prefix: str = "") -> dict[str, int]:
        start = self._key(prefix.rstrip("/") + "/") if prefix else (self.prefix + "/" if self.prefix else "")
        cut = len(self.prefix) + 1 if self.prefix else 0

        def pages():
            found = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                found.update({o["Key"][cut:]: int(o["Size"]) for o in page.get("Contents", [])})
            return found
        return self._call(prefix, "list", pages)

    def download(self, name: str, local: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        self._call(name, "download", lambda: self.client.download_file(
            self.bucket, self._key(name), str(local), Config=config))

    def write_bytes(self, name: str, data: bytes) -> None:
        self._call(name, "write", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self._key(name), Body=data, Metadata={SHA256_METADATA: sha256_bytes(data)}))

    def put_file(self, local: Path, name: str, sha256: str, keep_local: bool = False) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        self._call(name, "upload", lambda: self.client.upload_file(
            str(local), self.bucket, self._key(name), ExtraArgs={"Metadata": {SHA256_METADATA: sha256}},
            Config=config))
        if not keep_local:
            Path(local).unlink(missing_ok=True)

    def delete(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        for i in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[i:i + 1000]]
            self._call(names[0] if names else "", "delete", lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True}))

    def check(self, write: bool) -> None:
        """Access and the bucket, before any work: one list, and for writers a probe object."""
        self._call("", "list", lambda: self.client.list_objects_v2(
            Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1))
        if write:
            probe = f".write-probe-{os.getpid()}-{random.getrandbits(32):08x}"
            self.write_bytes(probe, b"")
            self._call(probe, "delete", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(probe)))

    def staging_dir(self) -> Path:
        """Complete files wait here for their upload: under $TMPDIR, one folder per process."""
        if self._stage is None:
            import tempfile

            self._stage = Path(tempfile.mkdtemp(prefix="data_prep-upload-"))
        return self._stage


def _code(exc) -> str:
    return str(exc.response.get("Error", {}).get("Code") or exc.response.get("ResponseMetadata", {})
               .get("HTTPStatusCode", ""))


# ------------------------------------------------------------------------------------------ http(s)
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
            return _with_retries(self, name, what, fetch, transient)
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
            raise StorageError(f"{self.url(name)}: the server answered a range request with HTTP {status} and "
                               f"{len(data)} bytes (it must honour Range: bytes={start}-{end - 1})")
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
        raise StorageError(f"{self.url(prefix)}: an https:// folder cannot be listed; only data with a "
                           "manifest.json can be read from one")

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


def open_store(location: str | os.PathLike) -> Store:
    """The store for a local path, ``s3://bucket/prefix`` or ``http(s)://host/prefix``; any other
    scheme is a ``StorageError`` (never a local folder named after it)."""
    text = str(location)
    scheme = _SCHEME.match(text)
    if scheme is None:
        return LocalStore(text)
    kind = scheme.group(1).lower()
    if kind == "s3":
        return S3Store(text)
    if kind in ("https", "http"):
        return HttpStore(text)
    if kind == "file":
        return LocalStore(text[len("file://"):])
    raise StorageError(f"{text}: the scheme {kind}:// is not supported (use a local path, s3://bucket/prefix, "
                       "or https://host/prefix to read)")
