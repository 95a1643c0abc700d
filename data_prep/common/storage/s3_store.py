"""``s3://bucket/prefix`` through boto3 directly: endpoint, region and credentials as boto3 resolves
them, so no secret passes through this code; multipart uploads above 64 MiB, our sha256 as object
metadata, transient failures retried (``base.with_retries``)."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from data_prep.common.storage.base import ObjectInfo, StorageError, Store, attempt_timeouts, sha256_bytes, with_retries

SHA256_METADATA = "sha256"  # S3 user metadata (x-amz-meta-sha256): the object's sha256, hex
MULTIPART_BYTES = 64 << 20
_DENIED = {
    "AccessDenied",
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "403",
    "AllAccessDisabled",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
}
_TRANSIENT = {
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "500",
    "502",
    "503",
    "504",
    "Throttling",
    "ThrottlingException",
}


class S3Store(Store):
    """``s3://bucket/prefix`` through boto3; credentials and endpoint as boto3 resolves them."""

    def __init__(self, url: str):
        rest = url[len("s3://") :]
        self.bucket, _, prefix = rest.partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.bucket):
            raise StorageError(f"{url}: {self.bucket!r} is not an S3 bucket name")
        self.prefix = prefix.strip("/")
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._client, self._client_pid = None, None
        self._stage: Optional[Path] = None
        self._bucket_seen = False  # check() found the bucket: a 404 is then a missing object

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
                "s3", config=Config(retries={"total_max_attempts": 1}, connect_timeout=connect, read_timeout=read)
            )
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, name: str, what: str, call: Callable):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )

        def unwrapped(exc: BaseException) -> BaseException:
            # boto3's transfers (upload_file, download_file) raise their own error around a ClientError
            inner = exc.__context__ if isinstance(exc, Boto3Error) else None
            return inner if isinstance(inner, (ClientError, BotoCoreError)) else exc

        def transient(exc: BaseException) -> bool:
            exc = unwrapped(exc)
            if isinstance(exc, ClientError):
                return _code(exc) in _TRANSIENT
            return isinstance(exc, (BotoConnectionError, ConnectionError, TimeoutError)) or (
                isinstance(exc, BotoCoreError) and "timeout" in type(exc).__name__.lower()
            )

        try:
            return with_retries(self, name, what, call, transient)
        except (BotoCoreError, ClientError, Boto3Error, OSError) as raised:
            exc = unwrapped(raised)
            if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
                raise StorageError(
                    f"{self.url(name)}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, and AWS_ENDPOINT_URL for a non-AWS "
                    "server)"
                ) from None
            if isinstance(exc, ClientError):
                code = _code(exc)
                if code in _DENIED:
                    raise StorageError(
                        f"{self.url(name)}: access denied ({code}) for {what}: check the AWS "
                        "credentials and the bucket's policy"
                    ) from None
                if code == "NoSuchBucket":
                    raise StorageError(f"{self.url(name)}: no such bucket {self.bucket!r}") from None
                raise StorageError(f"{self.url(name)}: {what} failed ({code})") from None
            raise StorageError(f"{self.url(name)}: {what} failed ({type(exc).__name__}: {exc})") from None

    def read_bytes(self, name: str) -> bytes:
        return self._call(
            name, "read", lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        )

    def read_range(self, name: str, start: int, end: int) -> bytes:
        data = self._call(
            name,
            "ranged read",
            lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(name), Range=f"bytes={start}-{end - 1}")[
                "Body"
            ].read(),
        )
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

        def into_local():
            # Into ``local`` itself: download_file would write beside it, under a random name of its
            # own that the caller's clean-up (the node cache's) cannot know, and a kill left it for good.
            with open(local, "wb") as f:
                self.client.download_fileobj(self.bucket, self._key(name), f, Config=config)

        self._call(name, "download", into_local)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._call(
            name,
            "write",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self._key(name), Body=data, Metadata={SHA256_METADATA: sha256_bytes(data)}
            ),
        )

    def put_file(self, local: Path, name: str, sha256: str, keep_local: bool = False) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        self._call(
            name,
            "upload",
            lambda: self.client.upload_file(
                str(local),
                self.bucket,
                self._key(name),
                ExtraArgs={"Metadata": {SHA256_METADATA: sha256}},
                Config=config,
            ),
        )
        if not keep_local:
            Path(local).unlink(missing_ok=True)

    def delete(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        for i in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[i : i + 1000]]
            self._call(
                names[0] if names else "",
                "delete",
                lambda: self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True}),
            )

    def check(self, write: bool) -> None:
        """Access and the bucket, before any work: one list, and for writers a probe object."""
        self._call("", "list", lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1))
        if write:
            probe = f".write-probe-{os.getpid()}-{random.getrandbits(32):08x}"
            self.write_bytes(probe, b"")
            self._call(probe, "delete", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(probe)))

    def staging_dir(self) -> Path:
        """Complete files wait here for their upload: under $TMPDIR, one folder per process."""
        if self._stage is None:
            self._stage = Path(tempfile.mkdtemp(prefix="data_prep-upload-"))
        return self._stage

    def discard_staging(self) -> None:
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None


def _code(exc) -> str:
    return str(
        exc.response.get("Error", {}).get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )
