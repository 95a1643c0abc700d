"""A local folder as a store: atomic writes, renames into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from data_prep.common.atomic import write_atomic
from data_prep.common.storage.base import ObjectInfo, StorageError, Store


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
