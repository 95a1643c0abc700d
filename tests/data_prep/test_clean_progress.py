"""Cleaning, step 5 (issue 83, item 1): every stage that reads the corpus says how far along it is, and
a stopped ``clean`` stops its workers."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import command_of
from data_prep.cli import main

REPO = Path(__file__).resolve().parents[2]
READ = re.compile(r"([\d,.]+) of ([\d,.]+) MiB read \((\d+)%, [\d,.]+ MiB/s\), \d+m\d\ds left")


def lines(caplog, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def test_each_reading_stage_says_how_much_of_its_input_it_has_read(tmp_path, wiki_article_files, caplog):
    """A line every log_every seconds (0 here: at every update) with the documents, the input's MiB read
    of its total, the rate and the time left; the last one at 100%."""
    caplog.set_level("INFO", logger="data_prep")
    argv = ["clean", "--input", str(wiki_article_files), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert main([*argv, "--set", "log_every=0"]) == 0
    total = sum(p.stat().st_size for p in wiki_article_files.glob("*.txt")) / (1 << 20)
    for stage in ("signatures", "filter"):
        said = lines(caplog, f"clean {stage}: task 0/1: ")
        assert len(said) >= 5, said
        shares = [int(READ.search(line).group(3)) for line in said]
        assert shares == sorted(shares) and shares[-1] == 100 and shares[0] < 50, said
        assert f"of {total:,.1f} MiB read" in said[-1] and "600 documents (" in said[-1]


STEPS = re.compile(r"(\d+) of (\d+) (key ranges|band units|files read) \((\d+)%, [\d,.]+/s\), \d+m\d\ds left")


def test_the_stages_between_say_how_many_of_their_pieces_are_done(tmp_path, wiki_article_files, caplog):
    """exact (its key ranges), pairs (its band units) and clusters (the files it reads): done of the
    total, the rate and the time left, counting up to all of them."""
    caplog.set_level("INFO", logger="data_prep")
    argv = ["clean", "--input", str(wiki_article_files), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert main([*argv, "--set", "log_every=0", "--set", "slice_keys=100"]) == 0
    for prefix, unit in (("clean exact: task 0/1: ", "key ranges"), ("clean pairs: task 0/1: ", "band units")):
        said = [STEPS.search(line).groups() for line in lines(caplog, prefix)]
        done = [int(d) for d, total, u, _ in said]
        assert {u for _, _, u, _ in said} == {unit} and len(set(total for _, total, _, _ in said)) == 1, said
        assert done == sorted(done) and done[-1] == int(said[-1][1]) > 1 and said[-1][3] == "100", said
    said = [STEPS.search(line).groups() for line in lines(caplog, "clean clusters: ")]
    assert said[-1][0] == said[-1][1] and said[-1][2] == "files read", said


def test_shard_says_how_much_of_its_input_it_has_read(tmp_path, wiki_txt_dir, bert_uncased_dir, caplog):
    caplog.set_level("INFO", logger="data_prep")
    argv = ["shard", "--input", str(wiki_txt_dir), "--tokenizer", str(bert_uncased_dir), "--out", str(tmp_path / "o")]
    assert main([*argv, "--log-every", "0", "--batch-chars", "50000"]) == 0
    said = lines(caplog, "task 0/1: ")
    shares = [int(m.group(3)) for line in said if (m := READ.search(line))]
    assert len(shares) >= 4 and shares == sorted(shares) and shares[-1] == 100, said


@pytest.mark.slow
def test_a_stopped_clean_stops_its_workers(tmp_path, wiki_articles):
    """SIGTERM to `data_prep clean --workers 2` in its signatures stage: no process of it is left."""
    import psutil

    corpus = tmp_path / "big.jsonl"
    with corpus.open("w") as f:
        for copy in range(6):
            for title, text in wiki_articles:
                f.write(json.dumps({"text": f"{title} {copy}. {text}"}) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_prep", "clean", "--input", str(corpus), "--out", str(tmp_path / "out")]
        + ["--workers", "2"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 120
    workers = []
    while time.time() < deadline and proc.poll() is None:
        workers = [c for c in parent.children(recursive=True) if "spawn_main" in " ".join(command_of(c))]
        if len(workers) == 2:
            break
        time.sleep(0.1)
    assert len(workers) == 2, "the workers never started"
    time.sleep(1.0)  # at work
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.pid for p in alive]


def test_the_quality_model_says_each_epoch_and_trial(caplog, wiki_articles):
    from data_prep.clean.quality_model import Settings, autotune, train
    from data_prep.sample_corpus import low_quality_documents

    caplog.set_level("INFO", logger="data_prep")
    examples = [(t, True) for _, t in wiki_articles[:150]] + [(t, False) for t in low_quality_documents(150)]
    train(examples, Settings(epochs=3))
    epochs = lines(caplog, "quality model: epoch ")
    assert [e.split(",")[0] for e in epochs] == [f"quality model: epoch {i}/3" for i in (1, 2, 3)]
    assert all(re.search(r"300 documents, \d+ documents/s, \d+m\d\ds left$", e) for e in epochs), epochs
    caplog.clear()
    tuned = autotune(examples, Settings(), epochs=True, lr=False, budget=10_000)
    trials = lines(caplog, "quality model: trial ")
    assert len(trials) == len(tuned.tried) >= 1 and "validation accuracy" in trials[0]
