"""Packing groups: fixed runs of documents that are packed, cut into shards and shuffled on their own,
and which array task owns which group.

A group never depends on the number of array tasks ``K``, so the shards are a pure function of
(input, tokenizer, settings): re-running a corpus on a different cluster size gives the same files,
byte for byte. Only *who* writes a group depends on ``K``.

The rule: sources are taken in sorted order (``reader.resolve_inputs``) and gathered into bundles
(``reader.bundle_sources``: consecutive small files together, up to ``group_chars`` bytes), numbered
from 0. Inside a bundle, documents are taken file by file in file order; group 0 starts with the
first document, and a group closes after the document that brings its characters to ``group_chars``
or more. So a group is named by (bundle number, group number inside that bundle), a group never spans
two bundles, and a folder of small files packs into full groups as one large file does.

Ownership among ``K`` tasks (``partition`` as resolved by ``reader.resolve_partition``):

* ``files``: a task owns every group of the bundles it was dealt (``reader.assign_bundles``) and
  opens only their files;
* ``documents``: the groups of all bundles are numbered in order (0, 1, 2, ... across bundles); task
  ``I`` owns group number ``n`` iff ``n % K == I``. Every task reads every source to find the group
  boundaries, and tokenizes only its own groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from .reader import Bundle, ReadOptions, Source, assign_bundles, bundle_sources, iter_source, iter_source_records


class GroupKey(NamedTuple):
    source: int  # index of the bundle in the sorted source list's bundles (``reader.bundle_sources``)
    group: int  # index of the group inside that source

    @property
    def tag(self) -> str:
        return f"s{self.source:05d}-g{self.group:05d}"


@dataclass
class ReadCount:
    """What a task's reader saw: every document it read, and those of the groups it owns."""

    documents_read: int = 0
    groups_owned: int = 0
    bytes_read: int = 0  # of the input files on disk, as they are read (progress lines)

    def advance(self, n: int) -> None:
        self.bytes_read += n


def owned_bytes(sources: list[Source], partition: str, num_tasks: int, task_index: int, group_chars: int) -> int:
    """The bytes on disk of the files one task reads: what its progress lines count towards."""
    bundles = bundle_sources(sources, group_chars)
    opened = assign_bundles(bundles, num_tasks)[task_index] if partition == "files" else range(len(bundles))
    return sum(s.bytes for i in opened for s in bundles[i])


def iter_owned_documents(
    sources: list[Source],
    partition: str,
    num_tasks: int,
    task_index: int,
    opts: ReadOptions,
    group_chars: int,
    count: ReadCount | None = None,
    records: bool = False,
) -> Iterator[tuple[GroupKey, str | dict]]:
    """(group, text) for every document of every group this task owns, in (bundle, group, file) order;
    (group, record) with ``records`` (every field: what ``data_prep clean`` writes back)."""
    count = count if count is not None else ReadCount()
    bundles = bundle_sources(sources, group_chars)
    opened = set(assign_bundles(bundles, num_tasks)[task_index]) if partition == "files" else range(len(bundles))
    groups_before = 0  # groups of the bundles before this one (the documents partition's running number)
    for bundle_index, bundle in enumerate(bundles):
        if bundle_index not in opened:
            continue
        group, chars, last_owned = 0, 0, None
        for doc in _bundle_documents(bundle, opts, records, count.advance):
            text = doc[opts.text_field] if records else doc
            count.documents_read += 1
            owned = partition == "files" or (groups_before + group) % num_tasks == task_index
            if owned:
                key = GroupKey(bundle_index, group)
                if key != last_owned:
                    count.groups_owned += 1
                    last_owned = key
                yield key, doc
            chars += len(text)
            if chars >= group_chars:
                group, chars = group + 1, 0
        groups_before += group + (1 if chars else 0)


def _bundle_documents(bundle: Bundle, opts: ReadOptions, records: bool, advance) -> Iterator[str | dict]:
    for source in bundle:
        yield from iter_source_records(source, opts, advance=advance) if records else iter_source(source, opts, advance)
