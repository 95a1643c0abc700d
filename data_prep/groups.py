"""Packing groups: fixed runs of documents that are packed, cut into shards and shuffled on their own,
and which array task owns which group.

A group never depends on the number of array tasks ``K``, so the shards are a pure function of
(input, tokenizer, settings): re-running a corpus on a different cluster size gives the same files,
byte for byte. Only *who* writes a group depends on ``K``.

The rule: sources are taken in sorted order (``reader.resolve_inputs``) and numbered from 0. Inside
a source, documents are taken in file order; group 0 starts with the first document, and a group
closes after the document that brings its characters to ``group_chars`` or more. So a group is
named by (source number, group number inside that source), and a group never spans two sources.

Ownership among ``K`` tasks (``partition`` as resolved by ``reader.resolve_partition``):

* ``files``: a task owns every group of the sources it was dealt (``reader.assign_sources``) and
  opens only those sources;
* ``documents``: the groups of all sources are numbered in order (0, 1, 2, ... across sources); task
  ``I`` owns group number ``n`` iff ``n % K == I``. Every task reads every source to find the group
  boundaries, and tokenizes only its own groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from .reader import ReadOptions, Source, assign_sources, iter_source, iter_source_records


class GroupKey(NamedTuple):
    source: int  # index of the source in the sorted source list
    group: int  # index of the group inside that source

    @property
    def tag(self) -> str:
        return f"s{self.source:05d}-g{self.group:05d}"


@dataclass
class ReadCount:
    """What a task's reader saw: every document it read, and those of the groups it owns."""

    documents_read: int = 0
    groups_owned: int = 0


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
    """(group, text) for every document of every group this task owns, in (source, group, file) order;
    (group, record) with ``records`` (every field: what ``data_prep clean`` writes back)."""
    count = count if count is not None else ReadCount()
    if partition == "files":
        opened = {s.path for s in assign_sources(sources, num_tasks)[task_index]}
    else:
        opened = {s.path for s in sources}
    groups_before = 0  # groups of the sources before this one (the documents partition's running number)
    for source_index, source in enumerate(sources):
        if source.path not in opened:
            continue
        group, chars, last_owned = 0, 0, None
        for doc in iter_source_records(source, opts) if records else iter_source(source, opts):
            text = doc[opts.text_field] if records else doc
            count.documents_read += 1
            owned = partition == "files" or (groups_before + group) % num_tasks == task_index
            if owned:
                key = GroupKey(source_index, group)
                if key != last_owned:
                    count.groups_owned += 1
                    last_owned = key
                yield key, doc
            chars += len(text)
            if chars >= group_chars:
                group, chars = group + 1, 0
        groups_before += group + (1 if chars else 0)
