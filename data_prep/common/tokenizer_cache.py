"""The tokenizer beside a data folder, as a local folder: itself, or for a bucket or web folder a copy
downloaded once per machine and checked against the manifest's ``tokenizer.sha256``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from data_prep.common.errors import ShardError
from data_prep.common.manifest import Manifest, files_sha256
from data_prep.common.paths import name_problem
from data_prep.common.storage import StorageError, open_store

# Every file a Hugging Face tokenizer folder may hold (copied, fingerprinted and exported together).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
# The ones that carry a vocabulary: a folder with none of them loads as a 5-token tokenizer.
_NO_VOCABULARY = {"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt"}
VOCABULARY_FILES = tuple(name for name in TOKENIZER_FILES if name not in _NO_VOCABULARY)


def tokenizer_dir(manifest: Manifest, data_dir: str | os.PathLike) -> Path:
    """The tokenizer copy beside the shards of ``data_dir`` as a local folder: itself, or for a URL
    a download checked against ``tokenizer.sha256`` and kept under that hash (``cached_tokenizer``)."""
    store = open_store(data_dir)
    if store.local_dir is not None:
        return store.local_dir / manifest.tokenizer.path
    return cached_tokenizer(store, manifest.tokenizer.path, manifest.tokenizer.sha256)


def cached_tokenizer(store, prefix: str, sha256: str) -> Path:
    """The tokenizer files under ``prefix`` of a remote store, in ``$MLM_CACHE_DIR`` (default
    ``~/.cache/mlm-pretrain``) ``/tokenizers/<sha256>``: downloaded once per machine (renamed into place,
    so ranks racing each leave a whole copy), refused when its files do not hash to ``sha256``."""
    root = Path(os.environ.get("MLM_CACHE_DIR") or Path.home() / ".cache" / "mlm-pretrain") / "tokenizers"
    dest = root / sha256
    if dest.is_dir():
        return dest
    try:
        names = [n[len(prefix) + 1 :] for n in store.list(prefix)]
    except StorageError:  # https: no listing; the files a tokenizer has
        names = [n for n in TOKENIZER_FILES if store.stat(f"{prefix}/{n}") is not None]
    for name in names:  # bucket keys, written to the cache below: plain names only
        if problem := name_problem(name):
            raise ShardError(f"{store.url(f'{prefix}/{name}')}: {problem}, not a tokenizer file name; refused")
    files = {name: store.read_bytes(f"{prefix}/{name}") for name in names}
    if files_sha256(files) != sha256:
        raise ShardError(
            f"{store.url(prefix)}: the tokenizer's files do not hash to the manifest's "
            f"tokenizer.sha256 {sha256[:12]}... (changed after data prep, or incomplete)"
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=root))
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    try:
        os.rename(tmp, dest)
    except OSError:  # another rank's copy won
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
