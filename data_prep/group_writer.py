"""Writing one packing group's shards (``data_prep.groups``), and what a killed run leaves to reuse.

Per group and split: a ``Packer`` turns the documents into sequences, a ``SplitWriter`` shuffles and
writes a shard per ``shard_size`` of them (the last one holds the rest).

Output goes through a ``Store`` (a local folder or a bucket prefix): a shard is written whole to a
local file first and then published (renamed into place, or uploaded), and only then is its
sidecar written, so a sidecar always names a complete shard.

Restarts: after each shard is published, a sidecar ``<progress dir>/<shard>.json`` records
its manifest entry, the settings hash and where the split's stream stands in the group. When a group
is complete, ``<progress dir>/group-sXXXXX-gXXXXX.json`` lists its shards. A re-run of a killed task
skips complete groups whose shards check out (without tokenizing them); inside the group that was
cut short it keeps the longest run of shards whose sidecar and sha256 check out, skips the documents
they hold and writes the rest: the same bytes as a run that was never killed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from data_prep.common.atomic import json_bytes
from data_prep.common.shards import ShardWriter, shard_name
from data_prep.common.storage import Store, sha256_bytes

from .groups import GroupKey
from .packing import Packed, Packer, shard_permutation
from .settings import SPLITS, ShardSettings
from .tokenizer import Encoded, LoadedTokenizer


def group_shard_name(split: str, key: GroupKey, index: int) -> str:
    return shard_name(split, key.source, index, group=key.group)


def group_record_name(progress: str, key: GroupKey) -> str:
    return f"{progress}/group-{key.tag}.json"


def read_record(store: Store, name: str):
    text = store.read_text(name)
    return None if text is None else json.loads(text)


@dataclass
class SplitResume:
    entries: list[dict] = field(default_factory=list)  # manifest entries of shards kept from a killed run
    doc: int = 0  # the split's stream restarts in this document of the group
    offset: int = 0  # after this many of its tokens


def _shard_intact(store: Store, entry: dict) -> bool:
    """Present with its size and sha256: the sha256 recorded at upload (a bucket), or read (a folder)."""
    info = store.stat(entry["name"])
    if info is None or info.size != entry["bytes"]:
        return False
    return (info.sha256 or sha256_bytes(store.read_bytes(entry["name"]))) == entry["sha256"]


def kept_shards(store: Store, progress: str, split: str, key: GroupKey, settings_hash: str) -> SplitResume:
    """The longest run of shards 0, 1, ... of a group's split, left by a killed run, that check out."""
    resume = SplitResume()
    while True:
        name = group_shard_name(split, key, len(resume.entries))
        try:
            record = read_record(store, f"{progress}/{name}.json")
            entry = record["entry"]
            ok = record["settings_sha256"] == settings_hash and _shard_intact(store, entry)
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return resume
        resume.entries.append(entry)
        resume.doc, resume.offset = record["resume"]["doc"], record["resume"]["offset"]


def finished_group(store: Store, progress: str, key: GroupKey, settings_hash: str) -> list[dict] | None:
    """The shard entries of a group a killed run completed, if every shard checks out."""
    try:
        record = read_record(store, group_record_name(progress, key))
        if record["settings_sha256"] != settings_hash:
            return None
        entries = record["entries"]
        return entries if all(_shard_intact(store, e) for e in entries) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


_GROUP_FILE = re.compile(r"-(s\d{5,}-g\d{5,})-\d{5,}\.tar(\.tmp)?$")


def files_by_group(store: Store) -> dict[str, list[str]]:
    """Shard files (finished and ``.tmp``) in the output folder by group tag, from one listing."""
    found: dict[str, list[str]] = {}
    for name in store.list():
        match = None if "/" in name else _GROUP_FILE.search(name)
        if match:
            found.setdefault(match.group(1), []).append(name)
    return found


def remove_group_leftovers(store: Store, names: list[str], keep: set[str]) -> None:
    """Half-written ``*.tmp`` shards of a group and its shards of an older, different run. Only the
    task that owns a group touches its files."""
    gone = [name for name in names if name.endswith(".tmp") or name not in keep]
    if gone:
        store.delete(gone)


class SplitWriter:
    """Collects one split's packed sequences of one group and writes a shard per ``shard_size`` of them."""

    def __init__(
        self,
        store: Store,
        split: str,
        key: GroupKey,
        s: ShardSettings,
        vocab_size: int,
        pad_id: int,
        settings_hash: str,
        progress: str,
        resume: SplitResume,
    ):
        self.store, self.split, self.key, self.s = store, split, key, s
        self.vocab_size, self.pad_id, self.settings_hash = vocab_size, pad_id, settings_hash
        self.progress = progress
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
        local = self.store.staging_dir() / name
        writer = ShardWriter(local, self.vocab_size)
        try:
            for b in range(0, n, self.s.block_size):
                writer.write_block(ids[b : b + self.s.block_size], starts[b : b + self.s.block_size])
            digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        padding = int(np.count_nonzero(ids == self.pad_id))
        entry = {
            "name": name,
            "split": self.split,
            "source": self.key.source,
            "group": self.key.group,
            "index": index,
            "sequences": n,
            "blocks": writer.blocks,
            "tokens": n * self.s.seq_len - padding,
            "padding": padding,
            "bytes": local.stat().st_size,
            "sha256": digest,
            "block_offsets": writer.block_offsets,
            "block_crc32": writer.block_crc32,
        }
        self.store.put_file(local, name, digest)
        self.store.write_bytes(
            f"{self.progress}/{name}.json",
            json_bytes(
                {
                    "settings_sha256": self.settings_hash,
                    "entry": entry,
                    "resume": {"doc": int(packed.end_doc[-1]), "offset": int(packed.end_offset[-1])},
                }
            ),
        )
        self.entries.append(entry)


class GroupWriter:
    """Packs and writes both splits of one group; ``finish`` flushes them and records the group done."""

    def __init__(
        self,
        store: Store,
        key: GroupKey,
        s: ShardSettings,
        tok: LoadedTokenizer,
        dtype,
        settings_hash: str,
        progress: str,
        resume: dict[str, SplitResume],
    ):
        self.store, self.key, self.progress, self.settings_hash = store, key, progress, settings_hash
        ids = tok.special_ids
        self.packers = {split: Packer(s.seq_len, ids["cls"], ids["sep"], ids["pad"], dtype) for split in SPLITS}
        self.writers = {
            split: SplitWriter(store, split, key, s, tok.vocab_size, ids["pad"], settings_hash, progress, resume[split])
            for split in SPLITS
        }

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
        self.store.write_bytes(
            group_record_name(self.progress, self.key),
            json_bytes({"settings_sha256": self.settings_hash, "entries": entries}),
        )
        return entries, written
