"""Raw documents in, one string per document out; and which task of a Slurm array reads what.

Inputs (``--input``, any number, globs allowed):

* ``.txt`` — by ``txt_mode`` (``txt_rule``): ``auto`` (the default) reads a file under 32 KiB on
  disk as one document and splits a larger one at blank lines; ``file``: one document per file;
  ``blocks``: per blank-line-separated block; ``lines``: per non-empty line;
* ``.jsonl`` (and ``.json`` holding JSON lines) — one object per line, the text under ``text_field``;
* ``.json`` holding one top-level array, and ``.parquet`` — through ``datasets`` in streaming mode;
* a folder written by ``datasets``' ``save_to_disk`` (memory-mapped; ``hf_split`` picks the split of
  a ``DatasetDict``); a folder written by ``data_prep clean`` stands for the kept documents its
  ``report.json`` lists; any other folder stands for the supported files inside it;
* ``hub:NAME`` or ``hub:NAME:CONFIG`` — ``datasets.load_dataset(..., streaming=True)`` (needs a network).

``.txt``, ``.jsonl`` and ``.json`` may be gzip-compressed (``.gz``); a truncated or damaged ``.gz``
is reported as such (not as an encoding problem), naming the file. Documents that are empty or only
whitespace are skipped. Sources are sorted by path, so the order of ``--input`` flags does not matter.

Bundles: small files are read together. Sources are taken in sorted order; a ``.txt``, ``.jsonl`` or
``.json`` file (or its ``.gz``) smaller than ``bundle_bytes`` (``--group-chars``) joins the bundle
before it until that bundle's bytes on disk reach ``bundle_bytes``; any other source is a bundle of
its own. A crawl of millions of one-page files becomes a few thousand bundles: the unit of work,
packing and output files, as one large file is. Bundles depend on the source list alone, never on
the number of tasks.

Partitioning among ``K`` array tasks (deterministic, from the bundle list alone):

* ``files``: each bundle belongs to exactly one task. Bundles are dealt largest first to the task
  with the fewest bytes so far (ties: lower task index). Scales: a task reads only its own files.
* ``documents``: every task reads every source. ``data_prep shard`` shares out packing groups
  (``data_prep.groups``: every ``K``-th group); ``iter_task_documents`` keeps the documents whose
  running index ``d`` (over all sources in sorted order, from 0) has ``d % K == I``. For one big file.
* ``auto`` (default): ``files`` when there are at least ``K`` bundles, else ``documents``.

Neither changes the shards: they are cut by packing groups, which do not depend on ``K``.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import fnmatch
import glob
import gzip
import hashlib
import heapq
import json
import os
import stat
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from data_prep.common.storage import is_url, open_store

from .cleaned_folder import is_part, read_report
from .errors import DataPrepError

Advance = Callable[[int], None]  # told the bytes of the input each read consumed (progress)
_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
_GZIP_OK = {"txt", "jsonl", "json"}
HUB_PREFIX = "hub:"


@dataclass(frozen=True)
class Source:
    kind: str  # txt | jsonl | json | parquet | saved | hub
    path: str  # absolute path, or the hub name (with ":CONFIG")
    bytes: int  # size on disk (0 for the hub); used to balance tasks and to notice changed inputs
    fingerprint: str = ""  # of a local file's or saved dataset's content (``fingerprint``); "" elsewhere

    def to_dict(self) -> dict:
        return asdict(self)


# Why auto, and why 32 KiB: people's own corpora come as a folder of one-document files (news
# articles, web pages, posts: a few KiB each, almost all under 32 KiB) or as a few large files of
# many documents separated by blank lines (BERT's original format; Hugging Face datasets' text loader
# calls it "paragraph"). A file of many documents is rarely under 32 KiB; a longer single document
# (a book, a report) needs --txt-mode file, and the survey at the start of a run (txt_survey) says
# which rule read how many files.
TXT_DOCUMENT_BYTES = 32 << 10


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    txt_mode: str = "auto"  # auto | file | blocks | lines (txt_rule)
    hf_split: str = "train"  # split of a saved DatasetDict or a hub dataset


def _file_kind(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        kind = _KINDS.get(suffixes[-2]) if len(suffixes) > 1 else None
        return kind if kind in _GZIP_OK else None
    return _KINDS.get(suffixes[-1]) if suffixes else None


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


WHOLE_HASH_BYTES = 8 << 20  # files up to this size are hashed whole
SAMPLE_BYTES, SAMPLES = 64 << 10, 16


def fingerprint(path: str | os.PathLike, info: os.stat_result | None = None) -> str:
    """What identifies a local input's content, so that a re-run notices an edit that kept the size:
    up to 8 MiB the sha256 of the whole file (exact; a file touched but unchanged keeps it); above,
    its modification time and 16 chunks of 64 KiB spread over it (1 MiB read whatever the size: an
    edit that keeps the size and the modification time and misses every chunk is not seen)."""
    info = os.stat(path) if info is None else info
    size = info.st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            digest.update(str(info.st_mtime_ns).encode())
            for k in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * k // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def _folder_fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            digest.update(f"{p.relative_to(folder).as_posix()}:{fingerprint(p)}\n".encode())
    return digest.hexdigest()[:32]


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _cleaned_sources(folder: Path) -> list[Source] | None:
    """The kept documents of a folder ``data_prep clean`` wrote (its report, removed/ and stray files
    left out), or None when ``folder`` is not one."""
    report = read_report(str(folder))
    if report is None:
        if any(is_part(p.name) for p in folder.iterdir()) and (folder / "removed").is_dir():
            raise DataPrepError(
                f"{folder}: a data_prep clean folder without its report.json: the cleaning did "
                "not finish; run data_prep clean again"
            )
        return None
    paths = [folder / f["name"] for f in report["files"]]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataPrepError(f"{folder}: files its report.json lists are missing: {', '.join(missing[:5])}")
    return [Source(_file_kind(p), str(p.resolve()), p.stat().st_size, fingerprint(p)) for p in paths]


def _sources_in(path: Path, pattern: str) -> list[Source]:
    if path.is_dir():
        if _is_saved_dataset(path):
            return [Source("saved", str(path.resolve()), _folder_bytes(path), _folder_fingerprint(path))]
        cleaned = _cleaned_sources(path)
        if cleaned is not None:
            return cleaned
        return _files_in(path, pattern)
    kind = _file_kind(path)
    if kind is None:
        raise DataPrepError(
            f"--input {pattern!r}: {path} has an unsupported type "
            "(supported: .txt, .jsonl, .json, .parquet, .txt.gz, .jsonl.gz, .json.gz, "
            "a save_to_disk folder, hub:NAME)"
        )
    return [Source(kind, str(path.resolve()), path.stat().st_size, fingerprint(path))]


def _files_in(folder: Path, pattern: str) -> list[Source]:
    """The supported files under a plain folder (hidden names left out), by their real paths. Plain
    strings and one ``stat`` a file: pathlib's objects cost 2.5 of the 7 s that listing 100,000 small
    files took; ``os.walk``, as ``rglob`` did, does not descend into linked folders."""
    root = os.path.realpath(folder)
    sources = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            kind = None if name.startswith(".") else _file_kind(Path(name))
            path = os.path.join(dirpath, name)
            info = os.stat(path) if kind else None
            if info is None or not stat.S_ISREG(info.st_mode):
                continue
            real = os.path.realpath(path) if os.path.islink(path) else path
            sources.append(Source(kind, real, info.st_size, fingerprint(real, info)))
    if not sources:
        raise DataPrepError(
            f"--input {pattern!r}: folder {folder} holds no .txt/.jsonl/.json/.parquet files "
            "and is not a dataset saved with save_to_disk"
        )
    return sorted(sources, key=lambda s: s.path)


def resolve_inputs(patterns: list[str]) -> list[Source]:
    """Expand ``--input`` values to a sorted, de-duplicated list of sources; every pattern must match."""
    if not patterns:
        raise DataPrepError("no --input given")
    sources: dict[str, Source] = {}
    for pattern in patterns:
        if pattern.startswith(HUB_PREFIX):
            name = pattern[len(HUB_PREFIX) :]
            if not name:
                raise DataPrepError(f"--input {pattern!r}: empty hub dataset name")
            sources[pattern] = Source("hub", name, 0)
            continue
        if is_url(pattern):
            for source in _sources_at_url(pattern):
                sources[source.path] = source
            continue
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise DataPrepError(f"--input {pattern!r} matches no files")
        else:
            matches = [os.path.expanduser(pattern)]
            if not os.path.exists(matches[0]):
                raise DataPrepError(f"--input {pattern!r}: no such file or folder")
        for match in matches:
            for source in _sources_in(Path(match), pattern):
                sources[source.path] = source
    return sorted(sources.values(), key=lambda s: (s.kind == "hub", s.path))


def _sources_at_url(pattern: str) -> list[Source]:
    """``s3://bucket/prefix/*.jsonl`` (a glob, ``*`` crossing '/'), one object, or a prefix standing for
    the supported files under it (a folder ``data_prep clean`` wrote: the files its report lists);
    ``https://host/path/file.jsonl`` one file, or such a cleaned folder. Read through a local copy
    (``iter_source``)."""
    is_s3 = pattern.startswith("s3://")
    if not (is_s3 or pattern.startswith(("https://", "http://"))):
        raise DataPrepError(
            f"--input {pattern!r}: inputs are local paths, hub:NAME, s3://bucket/prefix globs or https:// files"
        )
    magic = next((i for i, c in enumerate(pattern) if c in "*?["), len(pattern))
    base = pattern[: pattern.rfind("/", 0, magic)]
    if base.count("/") < 2:
        raise DataPrepError(f"--input {pattern!r}: name a {'bucket' if is_s3 else 'host'} before any wildcard")
    store = open_store(base)
    rest = pattern[len(base) + 1 :]
    if magic == len(pattern) and not _file_kind(Path(rest or "x")):
        report = read_report(pattern.rstrip("/"))
        if report is not None:
            folder = open_store(pattern.rstrip("/"))
            return [Source(_file_kind(Path(f["name"])), folder.url(f["name"]), f["bytes"]) for f in report["files"]]
    if not is_s3:
        if magic < len(pattern):
            raise DataPrepError(f"--input {pattern!r}: an https:// location cannot be listed: name each file")
        info = store.stat(rest)
        if info is None:
            raise DataPrepError(f"--input {pattern!r}: no such file (HTTP 404)")
        if not _file_kind(Path(rest)):
            raise DataPrepError(f"--input {pattern!r}: unsupported type (.txt, .jsonl, .json, .parquet, .gz of text)")
        return [Source(_file_kind(Path(rest)), store.url(rest), info.size)]
    listing = store.list()
    if magic < len(pattern):
        names = [n for n in sorted(listing) if fnmatch.fnmatchcase(n, rest)]
    elif rest in listing:
        names = [rest]
    else:
        names = [n for n in sorted(listing) if n.startswith(rest.rstrip("/") + "/") or not rest]
    names = [n for n in names if not Path(n).name.startswith(".") and _file_kind(Path(n))]
    if not names:
        raise DataPrepError(f"--input {pattern!r} matches no .txt/.jsonl/.json/.parquet objects")
    return [Source(_file_kind(Path(n)), store.url(n), listing[n]) for n in names]


@contextlib.contextmanager
def _readable_path(source: Source):
    """A local path to read ``source`` from: itself, or a download of an object (under $TMPDIR, named
    like it, removed after reading)."""
    if not is_url(source.path):
        yield source.path
        return
    with tempfile.TemporaryDirectory(prefix="data_prep-input-") as tmp:
        local = Path(tmp) / source.path.rsplit("/", 1)[-1]
        base, _, name = source.path.rpartition("/")
        open_store(base).download(name, local)
        if local.stat().st_size != source.bytes:
            raise DataPrepError(
                f"{source.path}: {local.stat().st_size} bytes now, {source.bytes} when the "
                "inputs were listed (changed while data prep was running)"
            )
        yield str(local)


# ----------------------------------------------------------------------------------------------
# Reading one source


def _open_binary(path: str, advance: Advance | None = None):
    f = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    return _Counted(f, advance) if advance is not None else f


class _Counted:
    """A file read line by line (or whole) that tells ``advance`` how many bytes of the file on disk
    each read consumed: for a ``.gz``, the compressed bytes (what ``Source.bytes`` counts)."""

    def __init__(self, f, advance: Advance):
        self.f, self.advance, self.at = f, advance, 0
        self.raw = getattr(f, "fileobj", None)  # a GzipFile's compressed stream

    def _tell(self, n: int) -> None:
        if self.raw is None:
            self.advance(n)
        else:
            now = self.raw.tell()
            self.advance(now - self.at)
            self.at = now

    def __iter__(self):
        for line in self.f:
            self._tell(len(line))
            yield line

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self._tell(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def _gzip_problem(path: str, exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return (
            f"{path}: truncated gzip file: the compressed data ends before its end marker (an interrupted "
            "download or copy?); copy or compress it again"
        )
    if isinstance(exc, gzip.BadGzipFile) and "Not a gzipped file" in str(exc):
        return f"{path}: not a gzip file ({exc}); remove the .gz suffix if it is plain text"
    return f"{path}: corrupt gzip data ({exc}): the file is damaged, not wrongly encoded; copy or compress it again"


def _gzip_damage(path: str) -> str | None:
    """Why a ``.gz`` file does not decompress to its end (checksum included), or None when it does."""
    try:
        with gzip.open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    except _GZIP_ERRORS as exc:
        return _gzip_problem(path, exc)
    return None


def _not_utf8(path: str, lineno: int, offset: int, exc: UnicodeDecodeError) -> DataPrepError:
    # Damage inside a gzip stream decompresses to garbage before the checksum at the end can
    # catch it: check the whole stream before blaming the encoding.
    damage = _gzip_damage(path) if path.endswith(".gz") else None
    if damage:
        return DataPrepError(damage)
    return DataPrepError(
        f"{path}: line {lineno} (byte offset {offset}): not valid UTF-8 ({exc.reason}); convert the file to UTF-8"
    )


def encoding_problem(source: "Source", limit: int = 1 << 20) -> str | None:
    """Why a local text source (txt, jsonl, json) is not UTF-8 in its first ``limit`` bytes, or None:
    a check before any work, so that every such input is named at once; damage further in is still
    found when the file is read."""
    if source.kind not in ("txt", "jsonl", "json") or is_url(source.path):
        return None
    try:
        with _open_binary(source.path) as f:
            data = f.read(limit)
    except _GZIP_ERRORS as exc:
        return _gzip_problem(source.path, exc)
    except OSError as exc:
        return f"{source.path}: cannot read ({exc.strerror or exc})"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) < limit)
    except UnicodeDecodeError as exc:
        return str(_not_utf8(source.path, data.count(b"\n", 0, exc.start) + 1, exc.start, exc))
    return None


def _decode_line(raw: bytes, path: str, lineno: int, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, lineno, offset + exc.start, exc) from None


def _iter_txt_blocks(path: str, advance: Advance | None = None) -> Iterator[str]:
    lines: list[str] = []
    offset = 0
    with _open_binary(path, advance) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno, offset)
            offset += len(raw)
            if line.strip():
                lines.append(line.rstrip("\r\n"))
            elif lines:
                yield "\n".join(lines)
                lines = []
    if lines:
        yield "\n".join(lines)


def _iter_txt_lines(path: str, advance: Advance | None = None) -> Iterator[str]:
    offset = 0
    with _open_binary(path, advance) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno, offset).rstrip("\r\n")
            offset += len(raw)
            if line.strip():
                yield line


def txt_rule(source: Source, txt_mode: str) -> str:
    """How a ``.txt`` source becomes documents: ``file``, ``blocks`` or ``lines`` (``auto``: one
    document when the file is under ``TXT_DOCUMENT_BYTES`` on disk, else blocks)."""
    if txt_mode != "auto":
        return txt_mode
    return "file" if source.bytes < TXT_DOCUMENT_BYTES else "blocks"


def _iter_txt_file(path: str, advance: Advance | None = None) -> Iterator[str]:
    with _open_binary(path, advance) as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data.count(b"\n", 0, exc.start) + 1, exc.start, exc) from None
    if text.strip():
        yield text


_TXT_READERS = {"file": _iter_txt_file, "blocks": _iter_txt_blocks, "lines": _iter_txt_lines}


def _text_of(obj, field: str, where: str):
    if not isinstance(obj, dict) or field not in obj:
        keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DataPrepError(f"{where}: no {field!r} field (has: {keys}); pick the field with --text-field")
    text = obj[field]
    if text is not None and not isinstance(text, str):
        raise DataPrepError(f"{where}: field {field!r} is a {type(text).__name__}, expected a string")
    return text


def _iter_jsonl(path: str, field: str, advance: Advance | None = None) -> Iterator[dict]:
    offset = 0
    with _open_binary(path, advance) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataPrepError(f"{path}: line {lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
            text = _text_of(obj, field, f"{path}: line {lineno}")
            if text and text.strip():
                yield obj


def _json_is_array(path: str) -> bool:
    with _open_binary(path) as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _iter_hf_dataset(ds, field: str, where: str, all_fields: bool) -> Iterator[dict]:
    """Rows of a ``datasets`` Dataset or IterableDataset with a non-empty ``field``, in batches (only
    that column unless ``all_fields``)."""
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise DataPrepError(f"{where}: no {field!r} column (has: {', '.join(columns)}); pick it with --text-field")
    if columns is not None and not all_fields:
        ds = ds.select_columns([field])
    row = 0
    for batch in ds.iter(batch_size=1024):
        if field not in batch:
            raise DataPrepError(f"{where}: no {field!r} column (has: {', '.join(batch)}); pick it with --text-field")
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            row += 1
            record = dict(zip(names, values))
            text = record[field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataPrepError(f"{where}: row {row}: {field!r} is a {type(text).__name__}, expected a string")
            if text.strip():
                yield record


def _load_streaming(builder: str, path: str):
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
    except Exception as exc:  # datasets raises many types for unreadable files
        raise DataPrepError(f"{path}: cannot be read as {builder} ({type(exc).__name__}: {exc})") from exc


def _open_saved(path: str, split: str):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataPrepError(
                f"{path}: saved DatasetDict has no split {split!r} (has: {', '.join(ds)}); pick one with --hf-split"
            )
        ds = ds[split]
    return ds


def _open_hub(name: str, split: str):
    import datasets

    repo, _, config = name.partition(":")
    try:
        return datasets.load_dataset(repo, config or None, split=split, streaming=True)
    except Exception as exc:
        raise DataPrepError(f"hub:{name}: cannot be loaded ({type(exc).__name__}: {exc})") from exc


def iter_source(source: Source, opts: ReadOptions, advance: Advance | None = None) -> Iterator[str]:
    """Every non-empty document of one source, in file order."""
    field = opts.text_field
    for record in iter_source_records(source, opts, all_fields=False, advance=advance):
        yield record[field]


def iter_source_records(
    source: Source, opts: ReadOptions, all_fields: bool = True, advance: Advance | None = None
) -> Iterator[dict]:
    """Every record of one source whose text is not empty, with all its fields (columnar sources:
    only the text unless ``all_fields``), in file order; a ``.txt`` document is ``{text_field: text}``.
    ``advance`` is told the bytes of the source read so far, as they are read (a text or JSON-lines
    file), or all of them at its end (the formats ``datasets`` reads)."""
    if not (source.kind == "hub" or is_url(source.path) or os.path.exists(source.path)):
        raise DataPrepError(f"{source.path}: input disappeared while data prep was running")
    with _readable_path(source) as path:
        local = dataclasses.replace(source, path=path)
        if not source.path.endswith(".gz"):
            yield from _iter_source(local, opts, all_fields, advance)
            return
        try:
            yield from _iter_source(local, opts, all_fields, advance)
        except _GZIP_ERRORS as exc:
            raise DataPrepError(_gzip_problem(source.path, exc)) from None


def _iter_source(source: Source, opts: ReadOptions, all_fields: bool, advance: Advance | None) -> Iterator[dict]:
    field = opts.text_field
    if source.kind == "txt":
        texts = _TXT_READERS[txt_rule(source, opts.txt_mode)](source.path, advance)
        yield from ({field: text} for text in texts)
    elif source.kind == "jsonl" or (source.kind == "json" and not _json_is_array(source.path)):
        yield from _iter_jsonl(source.path, field, advance)
    else:
        yield from _iter_columnar(source, opts, all_fields)
        if advance is not None:
            advance(source.bytes)


def _iter_columnar(source: Source, opts: ReadOptions, all_fields: bool) -> Iterator[dict]:
    field = opts.text_field
    if source.kind == "json":
        yield from _iter_hf_dataset(_load_streaming("json", source.path), field, source.path, all_fields)
    elif source.kind == "parquet":
        yield from _iter_hf_dataset(_load_streaming("parquet", source.path), field, source.path, all_fields)
    elif source.kind == "saved":
        yield from _iter_hf_dataset(_open_saved(source.path, opts.hf_split), field, source.path, all_fields)
    elif source.kind == "hub":
        yield from _iter_hf_dataset(_open_hub(source.path, opts.hf_split), field, f"hub:{source.path}", all_fields)
    else:
        raise DataPrepError(f"{source.path}: unknown source kind {source.kind!r}")


# ----------------------------------------------------------------------------------------------
# Partitioning among array tasks

PARTITIONS = ("auto", "files", "documents")
_BUNDLED_KINDS = ("txt", "jsonl", "json")

Bundle = tuple[Source, ...]


def bundle_sources(sources: list[Source], bundle_bytes: int) -> list[Bundle]:
    """The sources (sorted) in bundles: consecutive small text files together until their bytes reach
    ``bundle_bytes``; a large file, a columnar file, a saved dataset or a hub dataset alone."""
    bundles: list[Bundle] = []
    open_bundle: list[Source] = []
    size = 0
    for source in sources:
        if source.kind not in _BUNDLED_KINDS or source.bytes >= bundle_bytes:
            if open_bundle:
                bundles.append(tuple(open_bundle))
                open_bundle, size = [], 0
            bundles.append((source,))
            continue
        open_bundle.append(source)
        size += source.bytes
        if size >= bundle_bytes:
            bundles.append(tuple(open_bundle))
            open_bundle, size = [], 0
    if open_bundle:
        bundles.append(tuple(open_bundle))
    return bundles


def bundled_files(sources: list[Source], bundle_bytes: int) -> int:
    """How many sources share a bundle with another: 0 where bundles change nothing (every file alone,
    as before bundles were made), so that the outputs' identities record them only where they do."""
    return sum(len(b) for b in bundle_sources(sources, bundle_bytes) if len(b) > 1)


def resolve_partition(partition: str, num_bundles: int, num_tasks: int) -> str:
    if partition not in PARTITIONS:
        raise DataPrepError(f"--partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
    if partition == "auto":
        return "files" if num_bundles >= num_tasks else "documents"
    if partition == "files" and num_bundles < num_tasks:
        raise DataPrepError(
            f"--partition files: {num_bundles} input bundle(s) (small files are read together up to "
            f"--group-chars bytes) for {num_tasks} tasks leaves tasks without input; use fewer tasks or "
            "--partition documents"
        )
    return partition


def assign_bundles(bundles: list[Bundle], num_tasks: int) -> list[list[int]]:
    """Which bundles (by index) each task reads under the ``files`` partition: largest first, to the
    task with the fewest bytes so far."""
    heap = [(0, task) for task in range(num_tasks)]
    owned: list[list[int]] = [[] for _ in range(num_tasks)]
    sizes = [sum(s.bytes for s in b) for b in bundles]
    for index in sorted(range(len(bundles)), key=lambda i: (-sizes[i], i)):
        load, task = heapq.heappop(heap)
        owned[task].append(index)
        heapq.heappush(heap, (load + max(sizes[index], 1), task))
    return [sorted(o) for o in owned]


def task_sources(bundles: list[Bundle], partition: str, num_tasks: int, task_index: int) -> list[Source]:
    """The sources task ``task_index`` opens (``partition`` already resolved)."""
    if partition == "files":
        return [s for i in assign_bundles(bundles, num_tasks)[task_index] for s in bundles[i]]
    return [s for b in bundles for s in b]


def iter_task_documents(
    sources: list[Source], partition: str, num_tasks: int, task_index: int, opts: ReadOptions
) -> Iterator[str]:
    """The documents that belong to one task, in a fixed order."""
    mine = task_sources([(s,) for s in sources], partition, num_tasks, task_index)
    if partition == "files" or num_tasks == 1:
        for source in mine:
            yield from iter_source(source, opts)
        return
    d = 0
    for source in mine:
        for text in iter_source(source, opts):
            if d % num_tasks == task_index:
                yield text
            d += 1
