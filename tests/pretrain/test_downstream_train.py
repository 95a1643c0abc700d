"""The downstream probe inside training, through the real launcher: 2 ranks log
downstream/<task>/{accuracy,macro_f1} at the configured steps (the baselines and test_examples once,
at step 0), and a run halted and resumed logs exactly the numbers of the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_module
from pretrain.eval.tasks import sample_article_task
from test_faults import ok, train

pytestmark = pytest.mark.slow


def probe_rows(out_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith("downstream/")}
        for r in rows
        if any(k.startswith("downstream/") for k in r)
    }


def test_probe_during_training_is_logged_and_resumes_exactly(shards, tmp_path):
    articles = sample_article_task(tmp_path / "articles.csv", num_articles=4)
    tasks = f"eval.downstream=[{{path: word_order, max_examples: 200}}, {{path: {articles}, max_examples: 200}}]"
    common = [tasks, "train.max_steps=6", "eval.downstream_every=3", "impl.zero_stage=3", "train.eval_every=0"]
    proc = ok(train(shards, tmp_path / "straight", *common, ranks=2))
    # reading the CSV task (through datasets) draws no progress bar on the training console
    assert "Generating train split" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    ok(train(shards, tmp_path / "resumed", *common, "train.halt_at_step=3", ranks=2))
    ok(train(shards, tmp_path / "resumed", *common, ranks=2))
    straight, resumed = probe_rows(tmp_path / "straight"), probe_rows(tmp_path / "resumed")
    assert sorted(straight) == [0, 3, 6]
    assert set(straight[0]) == {
        f"downstream/{t}/{b}_{m}"
        for t in ("word_order", "articles")
        for b in ("random_init", "majority")
        for m in ("accuracy", "macro_f1")
    } | {f"downstream/{t}/test_examples" for t in ("word_order", "articles")}
    assert all(straight[0][f"downstream/{t}/test_examples"] >= 10 for t in ("word_order", "articles"))
    for step in (3, 6):
        assert set(straight[step]) == {
            f"downstream/{t}/{m}" for t in ("word_order", "articles") for m in ("accuracy", "macro_f1")
        }
        assert all(0.0 <= v <= 1.0 for v in straight[step].values())
    assert resumed == straight  # the same weights give the same probe, to the bit


def test_a_runs_probe_and_the_evaluate_cli_on_its_checkpoint_give_the_same_numbers(shards, tmp_path):
    """A metric's name is its identity: ``python -m pretrain.evaluate`` on a run's checkpoint reports
    every downstream/<task>/... number the run logged, to the bit, the random-init baseline included.
    The embedding is padded (4,096 tokens to 5,000 rows): a run's model has the padding rows, its
    export the tokenizer's, and a baseline drawn at either size is another random model."""
    tasks = "eval.downstream=[{path: word_order, max_examples: 200}]"
    out = tmp_path / "run"
    common = ["train.max_steps=2", "eval.downstream_every=2", "train.checkpoint_every=2", "train.eval_every=0"]
    ok(train(shards, out, tasks, *common, "model.vocab_multiple=1000"))
    logged = probe_rows(out)
    assert sorted(logged) == [0, 2]
    cli = ok(
        run_module(
            "pretrain.evaluate",
            out / "checkpoints" / "step00000002",
            *("--task", "word_order", "--data", shards, "--max-examples", 200, "--json", tmp_path / "cli.json"),
        )
    )
    assert "random-init acc" in cli.stdout
    assert json.loads((tmp_path / "cli.json").read_text()) == {**logged[0], **logged[2]}
