"""Writing one packing group's shards (``data_prep.groups``), and what a killed run leaves to reuse.

Per group and split: a ``Packer`` turns the documents into sequences, a ``SplitWriter`` shuffles and
writes a shard per ``shard_size`` of them (the last one holds the rest).

Restarts: after each shard is renamed into place, a sidecar ``<progress dir>/<shard>.json`` records
its manifest entry, the settings hash and where the split's stream stands in the group. When a group
is complete, ``<progress dir>/group-sXXXXX-gXXXXX.json`` lists its shards. A re-run of a killed task
skips complete groups whose shards check out (without tokenizing them); inside the group that was
cut short it keeps the longest run of shards whose sidecar and sha256 check out, skips the documents
they hold and writes the rest: the same bytes as a run that was never killed.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .groups import GroupKey
from .packing import Packed, Packer, shard_permutation
from .settings import SPLITS, ShardSettings
from .atomic import write_json_atomic
from .shard_format import ShardWriter, sha256_file, shard_name
from .tokenizer import Encoded, LoadedTokenizer


def group_shard_name(split: str, key: GroupKey, index: int) -> str:
    return shard_name(split, key.source, index, group=key.group)


def group_record_path(progress_dir: Path, key: GroupKey) -> Path:
    return progress_dir / f"group-{key.tag}.json"


@dataclass
class SplitResume:
    entries: list[dict] = field(default_factory=list)   # manifest entries of shards kept from a killed run
    doc: int = 0                                        # the split's stream restarts in this document of the group
    offset: int = 0                                     # after this many of its tokens


def _shard_intact(out: Path, entry: dict) -> bool:
    path = out / entry["name"]
    return path.is_file() and path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"]


def kept_shards(out: Path, progress_dir: Path, split: str, key: GroupKey, settings_hash: str) -> SplitResume:
    """The longest run of shards 0, 1, ... of a group's split, left by a killed run, that check out."""
    resume = SplitResume()
    while True:
        name = group_shard_name(split, key, len(resume.entries))
        try:
            record = json.loads((progress_dir / f"{name}.json").read_text())
            entry = record["entry"]
            ok = record["settings_sha256"] == settings_hash and _shard_intact(out, entry)
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return resume
        resume.entries.append(entry)
        resume.doc, resume.offset = record["resume"]["doc"], record["resume"]["offset"]


def finished_group(out: Path, progress_dir: Path, key: GroupKey, settings_hash: str) -> list[dict] | None:
    """The shard entries of a group a killed run completed, if every shard checks out."""
    try:
        record = json.loads(group_record_path(progress_dir, key).read_text())
        if record["settings_sha256"] != settings_hash:
            return None
        entries = record["entries"]
        return entries if all(_shard_intact(out, e) for e in entries) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


_GROUP_FILE = re.compile(r"-(s\d{5,}-g\d{5,})-\d{5,}\.tar(\.tmp)?$")


def files_by_group(out: Path) -> dict[str, list[str]]:
    """Shard files (finished and ``.tmp``) in the output folder by group tag, from one listing."""
    found: dict[str, list[str]] = {}
    for name in os.listdir(out):
        match = _GROUP_FILE.search(name)
        if match:
            found.setdefault(match.group(1), []).append(name)
    return found


def remove_group_leftovers(out: Path, names: list[str], keep: set[str]) -> None:
    """Half-written ``*.tmp`` shards of a group and its shards of an older, different run. Only the
    task that owns a group touches its files."""
    for name in names:
        if name.endswith(".tmp") or name not in keep:
            (out / name).unlink(missing_ok=True)


class SplitWriter:
    """Collects one split's packed sequences of one group and writes a shard per ``shard_size`` of them."""

    def __init__(self, out: Path, split: str, key: GroupKey, s: ShardSettings, vocab_size: int, pad_id: int,
                 settings_hash: str, progress_dir: Path, resume: SplitResume):
        self.out, self.split, self.key, self.s = out, split, key, s
        self.vocab_size, self.pad_id, self.settings_hash = vocab_size, pad_id, settings_hash
        self.progress_dir = progress_dir
        self.entries = list(resume.entries)
        self.reused = len(resume.entries)
        self._chunks: list[Packed] = []
        self._rows = 0

    def add(self, packed: Packed) -> int:
        """Returns the number of shards written."""
        if len(packed) == 0:
            return 0
        self._chunks.append(packed)
        self._rows += len(packed)
        written = 0
        while self._rows >= self.s.shard_size:
            self._write(self._take(self.s.shard_size))
            written += 1
        return written

    def close(self) -> int:
        if self._rows == 0:
            return 0
        self._write(self._take(self._rows))
        return 1

    def _take(self, n: int) -> Packed:
        ids = np.concatenate([c.ids for c in self._chunks])
        starts = np.concatenate([c.starts for c in self._chunks])
        end_doc = np.concatenate([c.end_doc for c in self._chunks])
        end_offset = np.concatenate([c.end_offset for c in self._chunks])
        taken = Packed(ids[:n], starts[:n], end_doc[:n], end_offset[:n])
        self._rows -= n
        self._chunks = [Packed(ids[n:], starts[n:], end_doc[n:], end_offset[n:])] if self._rows else []
        return taken

    def _write(self, packed: Packed) -> None:
        index = len(self.entries)
        name = group_shard_name(self.split, self.key, index)
        n = len(packed)
        order = shard_permutation(self.s.seed, self.split, self.key.source, self.key.group, index, n)
        ids, starts = packed.ids[order], packed.starts[order]
        writer = ShardWriter(self.out / name, self.vocab_size)
        try:
            for b in range(0, n, self.s.block_size):
                writer.write_block(ids[b:b + self.s.block_size], starts[b:b + self.s.block_size])
            digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        padding = int(np.count_nonzero(ids == self.pad_id))
        entry = {"name": name, "split": self.split, "source": self.key.source, "group": self.key.group,
                 "index": index, "sequences": n, "blocks": writer.blocks, "tokens": n * self.s.seq_len - padding,
                 "padding": padding, "bytes": (self.out / name).stat().st_size, "sha256": digest,
                 "block_offsets": writer.block_offsets}
        write_json_atomic(self.progress_dir / f"{name}.json", {
            "settings_sha256": self.settings_hash, "entry": entry,
            "resume": {"doc": int(packed.end_doc[-1]), "offset": int(packed.end_offset[-1])}})
        self.entries.append(entry)


class GroupWriter:
    """Packs and writes both splits of one group; ``finish`` flushes them and records the group done."""

    def __init__(self, out: Path, key: GroupKey, s: ShardSettings, tok: LoadedTokenizer, dtype, settings_hash: str,
                 progress_dir: Path, resume: dict[str, SplitResume]):
        self.key, self.progress_dir, self.settings_hash = key, progress_dir, settings_hash
        ids = tok.special_ids
        self.packers = {split: Packer(s.seq_len, ids["cls"], ids["sep"], ids["pad"], dtype) for split in SPLITS}
        self.writers = {split: SplitWriter(out, split, key, s, tok.vocab_size, ids["pad"], settings_hash,
                                           progress_dir, resume[split]) for split in SPLITS}

    @property
    def reused(self) -> int:
        return sum(w.reused for w in self.writers.values())

    def add(self, split: str, enc: Encoded, doc_ids: list[int], first_offset: int) -> int:
        """Returns the number of shards written."""
        return self.writers[split].add(self.packers[split].add(enc, np.asarray(doc_ids), first_offset))

    def finish(self) -> tuple[list[dict], int]:
        """(every shard entry of the group, shards written by this call)."""
        written = 0
        for split in SPLITS:
            written += self.writers[split].add(self.packers[split].finish()) + self.writers[split].close()
        entries = [e for split in SPLITS for e in self.writers[split].entries]
        write_json_atomic(group_record_path(self.progress_dir, self.key),
                          {"settings_sha256": self.settings_hash, "entries": entries})
        return entries, written
