"""Document quality rules (Gopher, C4, FineWeb): ``first_failure`` names the first rule a document
breaks, or returns None. Cheap rules run first; the report counts each document under one rule."""

from __future__ import annotations

import re
from collections import Counter

from .settings import QualitySettings

STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))  # Gopher's list
BULLETS = ("•", "-", "*", "·", "▪", "‣", "⁃", "◦", "–", "—", "●", "■")
TERMINAL = (".", "!", "?", '"', "'", "”", "’", "»", ":")
# C4's and common web phrases; a line counts only when short (a boilerplate line is not a paragraph).
BOILERPLATE_PHRASES = (
    "cookie",
    "javascript",
    "privacy policy",
    "terms of use",
    "terms of service",
    "terms and conditions",
    "all rights reserved",
    "skip to main content",
    "sign up",
    "log in",
    "subscribe to our newsletter",
    "share on facebook",
    "share on twitter",
    "click here",
    "back to top",
    "leave a comment",
    "posted by admin",
)
BOILERPLATE_LINE_WORDS = 25
SHORT_LINE_CHARS = 30
# Gopher's stop-word and repetition rules assume its 50-word minimum: below it, one repeated name
# ("the University of Copenhagen") or a one-sentence definition without "the" would fail them.
GOPHER_MIN_WORDS = 50
# A share of lines says little about one or two lines (a one-paragraph article ending in a citation).
LINE_RULES_MIN_LINES = 3
# a whitespace-delimited word without a letter (digits, symbols, punctuation only)
_NO_LETTER_WORD = re.compile(r"(?<!\S)(?:(?!\s)[\W\d_])+(?!\S)")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.split("\n") if line.strip()]


def _ngrams(words: list[str], n: int):
    return zip(*(words[i:] for i in range(n)))


def _duplicate_ngram_share(words: list[str], n: int, total_chars: int) -> float:
    """Gopher: the share of characters in words covered by an n-gram that occurs more than once."""
    if len(words) < n or total_chars == 0:
        return 0.0
    grams = list(_ngrams(words, n))
    counts = Counter(grams)
    if len(counts) == len(grams):
        return 0.0
    covered = bytearray(len(words))
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i : i + n] = b"\x01" * n
    return sum(len(w) for w, c in zip(words, covered) if c) / total_chars


def _top_ngram_share(words: list[str], n: int, total_chars: int) -> float:
    """Gopher: the share of characters in the most frequent n-gram (counting every occurrence)."""
    if len(words) < n or total_chars == 0:
        return 0.0
    gram, count = Counter(_ngrams(words, n)).most_common(1)[0]
    return count * sum(len(w) for w in gram) / total_chars if count > 1 else 0.0


def first_failure(text: str, q: QualitySettings, english: bool) -> str | None:
    words = text.split()
    n = len(words)
    if n < q.min_words:
        return "min_words"
    if q.max_words and n > q.max_words:
        return "max_words"
    lowered = text.lower()
    if q.lorem_ipsum and "lorem ipsum" in lowered:
        return "lorem_ipsum"
    chars = len("".join(words))
    mean = chars / n if n else 0.0
    if mean < q.min_mean_word_length or mean > q.max_mean_word_length:
        return "mean_word_length"
    if q.max_symbol_ratio < 1 and (text.count("#") + text.count("...") + text.count("…")) / n > q.max_symbol_ratio:
        return "symbol_ratio"
    if q.min_alpha_words and 1 - len(_NO_LETTER_WORD.findall(text)) / n < q.min_alpha_words:
        return "alpha_words"
    lines = _lines(text)
    nl = len(lines)
    if nl < LINE_RULES_MIN_LINES:
        return _repetition(lowered, words, chars, q, english)
    if q.max_bullet_lines < 1 and sum(1 for line in lines if line.startswith(BULLETS)) / nl > q.max_bullet_lines:
        return "bullet_lines"
    if q.max_ellipsis_lines < 1 and sum(1 for line in lines if line.endswith(("...", "…"))) / nl > q.max_ellipsis_lines:
        return "ellipsis_lines"
    if q.max_boilerplate_lines < 1:
        boiler = sum(
            1
            for line in lines
            if len(line.split()) <= BOILERPLATE_LINE_WORDS and any(p in line.lower() for p in BOILERPLATE_PHRASES)
        )
        if boiler / nl > q.max_boilerplate_lines:
            return "boilerplate_lines"
    if (
        q.min_terminal_punctuation_lines
        and sum(1 for line in lines if line.endswith(TERMINAL)) / nl < q.min_terminal_punctuation_lines
    ):
        return "terminal_punctuation"
    if q.max_short_lines < 1 and sum(1 for line in lines if len(line) <= SHORT_LINE_CHARS) / nl > q.max_short_lines:
        return "short_lines"
    if q.max_duplicate_lines < 1 or q.max_duplicate_line_chars < 1:
        seen: set[str] = set()
        dup_lines = dup_chars = 0
        for line in lines:
            if line in seen:
                dup_lines += 1
                dup_chars += len(line)
            seen.add(line)
        if dup_lines / nl > q.max_duplicate_lines:
            return "duplicate_lines"
        if dup_chars / max(1, sum(len(line) for line in lines)) > q.max_duplicate_line_chars:
            return "duplicate_line_chars"
    return _repetition(lowered, words, chars, q, english)


def _repetition(lowered: str, words: list[str], chars: int, q: QualitySettings, english: bool) -> str | None:
    """Gopher's stop-word and n-gram rules, for documents of at least ``GOPHER_MIN_WORDS`` words."""
    if len(words) < GOPHER_MIN_WORDS:
        return None
    lowered_words = lowered.split()
    if english and q.min_stop_words and sum(1 for w in lowered_words if w in STOP_WORDS) < q.min_stop_words:
        return "stop_words"
    for size, limit in sorted(q.max_top_ngram_chars.items()):
        if limit < 1 and _top_ngram_share(lowered_words, size, chars) > limit:
            return f"top_{size}gram"
    limits = sorted(q.max_duplicate_ngram_chars.items())
    for k, (size, limit) in enumerate(limits):
        share = _duplicate_ngram_share(lowered_words, size, chars)
        if limit < 1 and share > limit:
            return f"duplicate_{size}grams"
        # a word covered by a repeated (n+1)-gram is covered by a repeated n-gram: the shares only
        # fall as n grows, so once below every later limit none of them can fail
        if all(share <= later for _, later in limits[k + 1 :]):
            break
    return None
