"""Shared fixtures. Area-specific fixtures live next to their tests."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Two cores on CI: one thread per process keeps multi-rank tests from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def wiki_articles():
    from data_prep.sample_corpus import wiki_articles

    return wiki_articles()


@pytest.fixture(scope="session")
def bert_uncased_dir() -> Path:
    from data_prep.sample_corpus import bert_uncased_dir

    return bert_uncased_dir()


@pytest.fixture(scope="session")
def wiki_txt_dir(tmp_path_factory, wiki_articles) -> Path:
    """~1,000 real articles as 4 blank-line-separated .txt files."""
    from data_prep.sample_corpus import write_sample_corpus

    out = tmp_path_factory.mktemp("wiki_txt")
    write_sample_corpus(out, "txt", num_files=4, max_docs=1000)
    return out
