"""``data_prep verify`` (the tokenizer and every shard against the manifest, every id against the
vocabulary) and ``data_prep inspect`` (totals and samples)."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.common.errors import ShardError
from data_prep.common.manifest import MANIFEST, Manifest, ShardEntry, load_manifest, tokenizer_sha256
from data_prep.common.shards import block_checksums, block_sizes, index_shard, parse_block
from data_prep.common.storage import Store, open_store, sha256_bytes
from data_prep.common.tokenizer_cache import tokenizer_dir

from .errors import DataPrepError
from .tokenizer import load_tokenizer


def _load(data_dir: Path) -> Manifest:
    """The manifest; one missing or mistyped key is bad input (exit 2) naming the key."""
    try:
        return load_manifest(data_dir)
    except ShardError as exc:
        raise DataPrepError(str(exc)) from None


@dataclass
class Report:
    """What ``verify`` found. ``damaged``: shards missing, truncated, corrupted or not decoding (restore
    or re-run them). ``mismatched``: data that decodes but disagrees with its tokenizer: ids outside the
    vocabulary, a manifest ``vocab_size`` or special ids that are not the tokenizer's (bad input for the
    trainer: the data set or its manifest was written wrong or edited)."""

    damaged: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return self.mismatched + self.damaged


def check_shard(store: Store, entry: ShardEntry, manifest: Manifest, vocab_size: int) -> tuple[str, str] | None:
    """None when the shard matches its manifest entry and every id is below ``vocab_size``; else
    ("damaged" or "mismatched", what is wrong, naming the shard)."""
    name = entry.name
    info = store.stat(name)
    if info is None:
        return "damaged", f"{name}: missing"
    if info.size != entry.bytes:
        return "damaged", f"{name}: {info.size} bytes, manifest says {entry.bytes} (truncated or rewritten?)"
    data = store.read_bytes(name)
    if sha256_bytes(data) != entry.sha256:
        return "damaged", f"{name}: sha256 differs from the manifest (corrupted)"
    try:
        expected = block_sizes(entry, manifest.block_size)
        scanned = index_shard(store.url(name), data)
        problem = _block_index_problem(entry, data, scanned)
        if problem:
            return "damaged", f"{name}: {problem}"
        scan = _scan_blocks(data, scanned, manifest, vocab_size)
    except (ShardError, ValueError, OSError) as exc:
        return "damaged", f"{name}: does not decode ({exc})"
    if isinstance(scan, str):
        return "damaged", f"{name}: {scan}"
    got, padding = scan.rows, scan.padding
    if got != expected:
        return "damaged", (
            f"{name}: {len(got)} blocks of {sum(got)} sequences, manifest says {entry.blocks} of {entry.sequences}"
        )
    if padding != entry.padding or sum(got) * manifest.seq_len - padding != entry.tokens:
        return "damaged", f"{name}: {padding} padding tokens, manifest says {entry.padding}"
    if scan.first_bad is not None:
        block, row, col, value = scan.first_bad
        return "mismatched", (
            f"{name}: block {block}, sequence {row}, position {col}: token id {value} is outside "
            f"the tokenizer's vocabulary of {vocab_size} ({scan.bad_ids} such id(s) in this shard)"
        )
    return None


def _block_index_problem(entry: ShardEntry, data: bytes, scanned: list[int]) -> str | None:
    """The manifest's block offsets and CRC-32s (when it has them) against the tar's own headers."""
    if entry.block_offsets is not None and list(entry.block_offsets) != scanned:
        first = next(
            (k for k, (a, b) in enumerate(zip(entry.block_offsets, scanned)) if a != b),
            min(len(scanned), len(entry.block_offsets)),
        )
        return (
            f"block_offsets differ from its tar headers from offset {first} on "
            f"(manifest edited, or the shard rewritten after finalize)"
        )
    crcs = block_checksums(data, scanned) if entry.block_crc32 is not None else None
    if crcs is not None and list(entry.block_crc32) != crcs:
        first = next(k for k, (a, b) in enumerate(zip(entry.block_crc32, crcs)) if a != b)
        return f"block {first}'s CRC-32 differs from the manifest's block_crc32 (manifest edited)"
    return None


@dataclass
class _BlockScan:
    rows: list[int] = field(default_factory=list)  # sequences per block
    padding: int = 0
    first_bad: tuple | None = None  # (block, row, column, id) of the first id outside the vocabulary
    bad_ids: int = 0


def _scan_blocks(data: bytes, scanned: list[int], manifest: Manifest, vocab_size: int) -> _BlockScan | str:
    """Every block decoded: its rows, padding and ids outside the vocabulary; or what is damaged."""
    seq_len, dtype, pad_id = manifest.seq_len, np.dtype(manifest.dtype), manifest.tokenizer.pad_id
    scan = _BlockScan()
    for k in range(len(scanned) - 1):
        ids, starts = parse_block(data[scanned[k] : scanned[k + 1]], seq_len, f"block {k}")
        if ids.dtype != dtype or ids.ndim != 2 or ids.shape[1] != seq_len or starts.shape != ids.shape:
            return f"block {len(scan.rows)} is {ids.dtype} {ids.shape}, expected {dtype} [n, {seq_len}]"
        if ids.size and int(ids.max()) >= vocab_size:
            outside = ids >= vocab_size
            scan.bad_ids += int(np.count_nonzero(outside))
            if scan.first_bad is None:
                row, col = (int(i) for i in np.argwhere(outside)[0])
                scan.first_bad = (len(scan.rows), row, col, int(ids[row, col]))
        scan.rows.append(len(ids))
        scan.padding += int(np.count_nonzero(ids == pad_id))
    return scan


def _tokenizer_vocab(store: Store, manifest: Manifest, report: Report) -> int:
    """The vocabulary size to check ids against: the tokenizer's beside the shards (the manifest's when
    that cannot be loaded); disagreements with the manifest go into ``report``."""
    info = manifest.tokenizer
    stated = info.vocab_size
    where, manifest_url = store.url(info.path), store.url(MANIFEST)
    try:
        folder = tokenizer_dir(manifest, store.url())
    except ShardError as exc:  # remote: does not hash to the manifest's sha256
        report.damaged.append(str(exc))
        return stated
    if not folder.is_dir() or not any(folder.iterdir()):
        report.damaged.append(f"{where}: tokenizer folder missing")
        return stated
    if tokenizer_sha256(folder) != info.sha256:
        report.damaged.append(f"{where}: tokenizer sha256 differs from the manifest")
    try:
        tok = load_tokenizer(folder)
    except DataPrepError as exc:
        report.mismatched.append(f"{where}: the tokenizer beside the shards does not load ({exc})")
        return stated
    if stated != tok.vocab_size:
        report.mismatched.append(
            f"{manifest_url}: vocab_size {stated!r}, but the tokenizer in {where} has "
            f"{tok.vocab_size} tokens (manifest edited, or written for another tokenizer?)"
        )
    if info.special_ids != tok.special_ids:
        report.mismatched.append(
            f"{manifest_url}: special_ids {info.special_ids} are not the tokenizer's {tok.special_ids} ({where})"
        )
    return tok.vocab_size


def verify_report(data_dir: str | os.PathLike, workers: int = 4) -> Report:
    """Check the tokenizer beside the shards against the manifest, then every shard (all are checked)."""
    store = open_store(data_dir)
    manifest = _load(data_dir)
    report = Report()
    vocab_size = _tokenizer_vocab(store, manifest, report)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        report.mismatched.append(f"{store.url(MANIFEST)}: vocab_size {vocab_size!r} is not a positive integer")
        return report
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashing and reads release the GIL
        for result in pool.map(lambda e: check_shard(store, e, manifest, vocab_size), manifest.shards):
            if result:
                getattr(report, result[0]).append(result[1])
    return report


def verify(data_dir: str | os.PathLike, workers: int = 4) -> list[str]:
    """Every problem found; an empty list means the data is sound."""
    return verify_report(data_dir, workers).problems


def inspect(data_dir: str | os.PathLike, samples: int = 3, split: str = "train", file=None) -> None:
    """Print totals, padding and bytes per token, and a few decoded sequences."""
    import tokenizers

    out = file or sys.stdout
    store = open_store(data_dir)
    m = _load(data_dir)
    print(
        f"{store.url()}: seq_len {m.seq_len}, {m.dtype}, block_size {m.block_size}, {m.num_tasks} task(s), "
        f"vocab {m.tokenizer.vocab_size} (lowercase {m.tokenizer.lowercase})",
        file=out,
    )
    for name, t in m.totals.items():
        size = sum(e.bytes for e in m.shards_of(name))
        slots = t["sequences"] * m.seq_len
        print(
            f"  {name:<10} {t['shards']:>5} shards {t['sequences']:>10,} sequences {t['tokens']:>13,} tokens "
            f"{t['documents']:>9,} documents  padding {t['padding'] / max(slots, 1):.4%}  "
            f"{size / max(slots, 1):.3f} bytes/token",
            file=out,
        )
    shard = next(iter(m.shards_of(split)), None)
    if shard is None or samples <= 0:
        return
    tok = tokenizers.Tokenizer.from_str(store.read_bytes(f"{m.tokenizer.path}/tokenizer.json").decode("utf-8"))
    if shard.block_offsets is not None:  # one ranged read
        span = store.read_range(shard.name, shard.block_offsets[0], shard.block_offsets[1])
    else:
        data = store.read_bytes(shard.name)
        first = index_shard(store.url(shard.name), data)
        span = data[first[0] : first[1]]
    ids, starts = parse_block(span, m.seq_len, f"{store.url(shard.name)}: block 0")
    for i in range(min(samples, len(ids))):
        row = ids[i].tolist()
        print(f"\n--- {shard.name} sequence {i} ---", file=out)
        print(tok.decode(row, skip_special_tokens=False), file=out)
        pieces = [("|" if s else "") + tok.id_to_token(t) for t, s in zip(row[:40], starts[i][:40], strict=True)]
        print("tokens (| = word start): " + " ".join(pieces) + (" ..." if len(row) > 40 else ""), file=out)
