"""Negatives made from the user's own positives (``quality-model train --negative generated``).

A classifier learns whatever tells its two labels apart most cheaply. Junk built from other text
(the bundled Wikipedia words, English boilerplate) differs from a user's news or forum posts by
vocabulary first, so the model learned "not like the generator's source" and let through junk made
of the user's own words (issue 83: 99% of news word salad kept). Here every kind of junk is made
of the positives' own words, sentences and openings, so vocabulary is no shortcut and the model
has to learn what makes text bad: words without sentences, keywords without prose, navigation,
loops.

The kinds (``KINDS``), in turn, spam twice as often:

- ``salad``: the words of one to three positives, shuffled (the words of good text without its
  sentences); half of them cut into sentence-like pieces with a capital and a full stop.
- ``spam``: a handful of the positives' frequent longer words repeated in any order, with
  separators, prices and counts (keyword stuffing).
- ``menus``: navigation and listings made of the positives' openings (their first line when
  short, else their first words): one item a line, or breadcrumbs.

Not a kind: text that repeats itself (a sentence looped, machine translation's stutters). The
classifier sees the average of a document's word and bigram embeddings, and a document said three
times has the average of the document said once: loops of the user's sentences taught as negatives
only taught the model to doubt its positives (held-out articles kept fell from 0.994 to 0.969,
removing 4% of the repeats). Gopher's repetition rules, which count repeated n-grams, remove them
(0.95 of held-out repeats: benchmarks/2026-11-27-a-learned-quality-filter.md).

Seeded: the same positives and seed give the same negatives.
"""

from __future__ import annotations

import random

KINDS = ("salad", "spam", "menus")
# Spam twice in four: a keyword known from the positives leans positive unless spam uses it as often
# as the articles do (spam one in three kept 0.27 of the held-out spam; one in two, 0.05).
_TURNS = ("salad", "spam", "menus", "spam")
_SEPARATORS = (" ", " ", ", ", " | ", " - ", " / ", " · ")
KEYWORD_MIN_CHARS = 4  # a keyword is a longer word: stop words are not what a spammer repeats
KEYWORD_SOURCE = 5000  # the positives whose longer words are drawn, by their frequency, as keywords
_PUNCTUATION = ".,;:!?\"'()"  # stripped from a word's ends before it is counted


class NegativeMaker:
    """Junk of each kind from ``positives``: ``make(n)`` gives ``n`` (text, kind) pairs."""

    def __init__(self, positives: list[str], seed: int = 0):
        if not positives:
            raise ValueError("no positives to make negatives from")
        self.positives = positives
        self.rng = random.Random(seed)
        words = (w.strip(_PUNCTUATION) for text in positives[:KEYWORD_SOURCE] for w in text.split())
        self.keywords = [w for w in words if len(w) >= KEYWORD_MIN_CHARS] or ["text"]

    def make(self, n: int) -> list[tuple[str, str]]:
        makers = {"salad": self.salad, "spam": self.spam, "menus": self.menus}
        return [(makers[_TURNS[i % len(_TURNS)]](), _TURNS[i % len(_TURNS)]) for i in range(n)]

    def _positive(self) -> str:
        return self.rng.choice(self.positives)

    def salad(self) -> str:
        words = [w for _ in range(self.rng.randint(1, 3)) for w in self._positive().split()]
        self.rng.shuffle(words)  # whole documents' words: shorter salad looked like short definitions
        if self.rng.random() < 0.5:
            return " ".join(words)
        out, i = [], 0
        while i < len(words):
            k = self.rng.randint(6, 18)
            piece = [w.strip(".!?") for w in words[i : i + k]]
            out.append(" ".join([piece[0][:1].upper() + piece[0][1:], *piece[1:]]) + ".")
            i += k
        return " ".join(out)

    def spam(self) -> str:
        keys = self.rng.sample(self.keywords, min(len(self.keywords), self.rng.randint(3, 10)))
        sep = self.rng.choice(_SEPARATORS)
        out = []
        for _ in range(self.rng.randint(15, 80)):
            word = self.rng.choice(keys)
            roll = self.rng.random()
            if roll < 0.15:
                word = f"{word} {self.rng.randint(1, 999)}"
            elif roll < 0.25:
                word = f"{word} ${self.rng.randint(1, 99)}.{self.rng.randint(0, 99):02d}"
            elif roll < 0.35:
                word = word.upper()
            out.append(word)
        return sep.join(out)

    def _opening(self) -> str:
        text = self._positive().strip()
        first = text.split("\n", 1)[0].strip()
        if 1 <= len(first.split()) <= 12:
            return first
        return " ".join(text.split()[: self.rng.randint(2, 6)]).rstrip(".,;:")

    def menus(self) -> str:
        items = [self._opening() for _ in range(self.rng.randint(5, 30))]
        style = self.rng.random()
        if style < 0.4:
            return "\n".join(items)
        if style < 0.7:
            return self.rng.choice((" | ", " > ", " » ", " · ")).join(items)
        return "\n".join(f"{self.rng.choice(('', '• ', '- ', '* '))}{item}" for item in items)
