"""How ``.txt`` files become documents, said at the start of ``clean``, ``shard`` and ``tokenizer``.

A ``.txt`` file is read by one of three rules (``reader.txt_rule``): the whole file, its blank-line
blocks, or its lines. A wrong rule is silent otherwise: a folder of articles split at blank lines
becomes headlines and paragraphs, which the language and quality rules then remove and deduplication
compares one by one. So a run first says how many files each rule reads and how many documents that
gives (counted on a sample of the split files: at most 200 files, 16 MiB), and warns when the
documents look like pieces of larger ones: most of them short, or a handful per file.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from data_prep.common.storage import is_url

from .reader import TXT_DOCUMENT_BYTES, ReadOptions, Source, iter_source, txt_rule

SAMPLE_FILES = 200
SAMPLE_BYTES = 16 << 20
SHORT_WORDS = 20  # a document under this many words looks like a headline or a lone paragraph
_SAID = {
    "file": "as one document each",
    "blocks": "split at blank lines",
    "lines": "read line by line",
}


@dataclass
class RuleCount:
    files: int = 0
    bytes: int = 0
    sampled_files: int = 0
    sampled_bytes: int = 0
    documents: int = 0  # in the sampled files
    short: int = 0  # of those, under SHORT_WORDS words
    words: list[int] = field(default_factory=list)
    per_file: list[int] = field(default_factory=list)

    def estimate(self) -> int:
        if self.sampled_bytes == 0:
            return 0
        return round(self.documents * self.bytes / self.sampled_bytes)


def survey(sources: list[Source], opts: ReadOptions) -> dict[str, RuleCount]:
    """Per rule, the ``.txt`` files it reads; the split rules' documents counted on a sample."""
    by_rule: dict[str, list[Source]] = {}
    for source in sources:
        if source.kind == "txt":
            by_rule.setdefault(txt_rule(source, opts.txt_mode), []).append(source)
    counts = {}
    for rule, files in by_rule.items():
        c = counts[rule] = RuleCount(files=len(files), bytes=sum(s.bytes for s in files))
        if rule == "file":
            continue
        step = max(1, len(files) // SAMPLE_FILES)
        for source in files[::step][:SAMPLE_FILES]:
            if is_url(source.path) or c.sampled_bytes >= SAMPLE_BYTES:
                continue
            n = 0
            for text in iter_source(source, opts):
                words = len(text.split())
                c.words.append(words)
                c.short += words < SHORT_WORDS
                n += 1
            c.per_file.append(n)
            c.documents += n
            c.sampled_files += 1
            c.sampled_bytes += source.bytes
    return counts


def describe(counts: dict[str, RuleCount], txt_mode: str) -> tuple[str, list[str]]:
    """The line saying how the files were read, and the warnings."""
    total = sum(c.files for c in counts.values())
    rule = (
        f"auto: a file under {TXT_DOCUMENT_BYTES >> 10} KiB is one document, a larger one is split at blank lines"
        if txt_mode == "auto"
        else txt_mode
    )
    parts = []
    for name, c in counts.items():
        part = f"{c.files:,} {_SAID[name]}"
        if name != "file" and c.sampled_files:
            part += (
                f" into ~{c.estimate():,} documents (counted in {c.sampled_files:,} of them, "
                f"median {statistics.median(c.words) if c.words else 0:.0f} words a document)"
            )
        parts.append(part)
    line = f"reading {total:,} .txt file(s) (--txt-mode {rule}): {'; '.join(parts)}"
    return line, _warnings(counts)


def _warnings(counts: dict[str, RuleCount]) -> list[str]:
    out = []
    for name, c in counts.items():
        if name == "file" or c.documents < 20:
            continue
        pieces = "blank-line blocks" if name == "blocks" else "lines"
        if c.short >= 0.4 * c.documents:
            out.append(
                f"{c.short / c.documents:.0%} of the {pieces} read are under {SHORT_WORDS} words (headlines, "
                f"single paragraphs or sentences?): if each file is one document, use --txt-mode file"
                + ("; if blank lines separate documents, --txt-mode blocks" if name == "lines" else "")
            )
        elif len(c.per_file) >= 10 and statistics.median(c.per_file) <= 10:
            out.append(
                f"the files split into {pieces} hold a median of {statistics.median(c.per_file):.0f} each: if "
                "each file is one document, use --txt-mode file"
            )
    return out


def log_txt_survey(sources: list[Source], opts: ReadOptions, log: logging.Logger) -> None:
    """Say how the ``.txt`` inputs become documents (nothing when there are none)."""
    counts = survey(sources, opts)
    if not counts:
        return
    line, warnings = describe(counts, opts.txt_mode)
    log.info("%s", line)
    for warning in warnings:
        log.warning("WARNING: %s", warning)
