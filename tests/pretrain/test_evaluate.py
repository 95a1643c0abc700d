"""Downstream evaluation: real tasks from the embedded Wikipedia text, the bundled pretrained encoder
against random init, the trainer's probe API on shards, held-out MLM numbers, and bad task files.

Time: about 1 minute: the downstream fine-tune and probe train real classifiers on the
bundled 6-layer encoder (in this process)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import PY, REPO, _run
from pretrain.config.schema import DownstreamTaskConfig, load_config
from pretrain.eval.intervals import wilson
from pretrain.eval.tasks import (
    TaskError,
    labelled_task,
    load_task,
    read_texts,
    sample_article_task,
    split_sentences,
    word_order_task,
)


@pytest.fixture(scope="module")
def articles_csv(tmp_path_factory):
    """Sentences of the 10 longest articles, labelled by article (~130 sentences)."""
    return sample_article_task(tmp_path_factory.mktemp("tasks") / "articles.csv", num_articles=10)


@pytest.mark.slow
def test_pretrained_encoder_beats_random_init_on_both_tasks(articles_csv, wiki_txt_dir, bert_uncased_dir, tmp_path):
    out = tmp_path / "metrics.json"
    proc = _run(
        [
            PY,
            "-m",
            "pretrain.evaluate",
            str(bert_uncased_dir),
            "--task",
            str(articles_csv),
            "--task",
            "word_order",
            "--data",
            str(wiki_txt_dir),
            "--max-length",
            "48",
            "--max-examples",
            "600",
            "--json",
            str(out),
        ]
    )
    lines = proc.stdout.splitlines()
    assert [c.strip() for c in lines[0].split(" | ")[:6]] == [
        "task",
        "protocol",
        "accuracy",
        "95% interval",
        "test examples",
        "macro-F1",
    ], proc.stdout
    assert any(line.startswith("articles ") for line in lines) and any(line.startswith("word_order") for line in lines)
    m = json.loads(out.read_text())
    print(json.dumps(m, indent=1))
    # Each accuracy with the interval its number of test examples gives (600 of the word-order sentences
    # for training, a quarter of the 800 as many for testing)
    assert m["downstream/word_order/test_examples"] == 200
    for line in lines[2:]:
        task, _, accuracy, interval, examples = (c.strip() for c in line.split(" | ")[:5])
        assert int(examples.replace(",", "")) == m[f"downstream/{task}/test_examples"]
        low, high = wilson(m[f"downstream/{task}/accuracy"], int(examples.replace(",", "")))
        assert interval == f"{low:.4f}-{high:.4f}" and low < float(accuracy) < high
    # 10 articles: a sentence encoder separates them; random weights keep only word overlap.
    a = "downstream/articles/"
    assert m[a + "accuracy"] > 0.85 and m[a + "accuracy"] > m[a + "random_init_accuracy"] + 0.15
    assert m[a + "macro_f1"] > m[a + "random_init_macro_f1"] + 0.15
    assert m[a + "majority_accuracy"] < 0.2
    # word order: chance is 0.5; the pretrained encoder reads order, the random one does not.
    w = "downstream/word_order/"
    assert m[w + "accuracy"] > 0.6 and m[w + "accuracy"] > m[w + "random_init_accuracy"] + 0.08
    assert abs(m[w + "random_init_accuracy"] - 0.5) < 0.1
    assert m[w + "majority_accuracy"] < 0.6


def test_bag_of_words_stays_at_chance_on_word_order(wiki_articles, articles_csv):
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    def bow_accuracy(task):
        vec = CountVectorizer(token_pattern=r"\S+").fit(task.train_texts)
        clf = LogisticRegression(max_iter=2000).fit(vec.transform(task.train_texts), task.train_labels)
        return float(np.mean(clf.predict(vec.transform(task.test_texts)) == task.test_labels))

    task = word_order_task([t for _, t in wiki_articles[:2000]], max_examples=3000, seed=3)
    assert len(task.test_texts) >= 900 and abs(np.mean(task.train_labels) - 0.5) < 0.05
    for text, y in zip(task.test_texts[:50], task.test_labels[:50]):  # same words, other order
        assert y in (0, 1) and len(text.split()) >= 6
    # Chance: 0.5 +- 3 standard errors of ~1000 test examples.
    assert abs(bow_accuracy(task) - 0.5) < 0.05
    # The same model is no weakling: on the article task words are what matters.
    assert bow_accuracy(labelled_task(DownstreamTaskConfig(path=str(articles_csv)))) > 0.6


def test_word_order_task_is_seeded_and_shuffles_locally(wiki_articles):
    texts = [t for _, t in wiki_articles[:300]]
    a, b = word_order_task(texts, max_examples=200, seed=1), word_order_task(texts, max_examples=200, seed=1)
    assert a.train_texts == b.train_texts and a.test_texts == b.test_texts
    c = word_order_task(texts, max_examples=200, seed=2)
    assert c.train_texts != a.train_texts
    originals = {s for t in texts for s in split_sentences(t)}
    for text, y in zip(a.train_texts, a.train_labels):
        assert (text in originals) == (y == 0)


def test_probe_api_on_the_trainers_held_out_shards(shards, tmp_path):
    """What the trainer calls: tasks prepared once from data.dir; a probe that is deterministic,
    restores the model's mode and leaves the global RNG alone; baselines computed separately."""
    from transformers import BertConfig, BertModel

    from data_prep.common.manifest import load_manifest
    from data_prep.common.tokenizer_cache import tokenizer_dir
    from pretrain.eval.downstream import baseline_metrics, prepare_tasks, probe_due, probe_metrics
    from pretrain.eval.tasks import held_out_sentences

    manifest = load_manifest(shards)
    spec = DownstreamTaskConfig(path="word_order", max_examples=150, max_length=32)
    tasks = prepare_tasks([spec], tokenizer_dir(manifest, shards), data_dir=str(shards), manifest=manifest)
    # 5% of 1,000 articles in rows of 64 tokens: about 75 whole sentences survive the cuts.
    sentences = held_out_sentences(shards, manifest)
    assert len(sentences) > 50 and all(s[-1] in ".!?" and len(s.split()) >= 3 for s in sentences)
    assert tasks[0].name == "word_order" and len(tasks[0].train_ids) >= 40 and len(tasks[0].test_ids) >= 12
    assert max(len(x) for x in tasks[0].train_ids) <= 32
    torch.manual_seed(0)
    encoder = BertModel(
        BertConfig(
            vocab_size=manifest.tokenizer.vocab_size,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        ),
        add_pooling_layer=False,
    )
    encoder.train()
    rng_before = torch.get_rng_state()
    first = probe_metrics(encoder, tasks, "cpu", batch_size=16)
    second = probe_metrics(encoder, tasks, "cpu", batch_size=16)
    assert first == second
    assert set(first) == {"downstream/word_order/accuracy", "downstream/word_order/macro_f1"}
    assert 0.2 < first["downstream/word_order/accuracy"] < 0.85
    assert encoder.training and torch.equal(torch.get_rng_state(), rng_before)
    # when the trainer probes: every downstream_every steps, else with each periodic evaluation
    assert [s for s in range(1, 101) if probe_due(s, 30, 25, s == 100)] == [30, 60, 90, 100]
    assert [s for s in range(1, 101) if probe_due(s, 0, 25, s == 100)] == [25, 50, 75, 100]
    base = baseline_metrics(encoder.config, tasks, "cpu")
    assert set(base) == {
        f"downstream/word_order/{k}"
        for k in (
            "random_init_accuracy",
            "random_init_macro_f1",
            "majority_accuracy",
            "majority_macro_f1",
            "test_examples",
        )
    }
    assert base["downstream/word_order/test_examples"] == len(tasks[0].test_ids)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_eval_config_takes_a_list_of_tasks(tmp_path, articles_csv, shards):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        f"base: {json.dumps(str(REPO / 'configs' / 'tiny.yaml'))}\n"
        f"data: {{dir: {shards}}}\n"
        f"eval:\n  downstream_every: 50\n  downstream:\n    - {{path: word_order}}\n"
        f"    - {{path: {articles_csv}, name: articles, label_column: label}}\n"
    )
    cfg = load_config(str(cfg_path))
    assert [t.path for t in cfg.eval.downstream] == ["word_order", str(articles_csv)]
    assert cfg.eval.downstream_every == 50 and cfg.eval.downstream[1].name == "articles"
    with pytest.raises(Exception) as err:
        load_config(
            str(cfg_path), ["eval.downstream=[{path: nowhere.csv, colour: 1}, {path: word_order, test_fraction: 1.5}]"]
        )
    text = str(err.value)
    assert "eval.downstream[0].colour: unknown key" in text and "eval.downstream[1].test_fraction" in text


def test_mlm_eval_of_a_random_export_sits_at_uniform_loss(shards, tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from data_prep.common.manifest import load_manifest
    from pretrain.eval.cli import mlm_eval

    manifest = load_manifest(shards)
    vocab = manifest.tokenizer.vocab_size
    torch.manual_seed(0)
    BertForMaskedLM(
        BertConfig(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    ).save_pretrained(tmp_path / "hf")
    first = mlm_eval(tmp_path / "hf", shards, batch_size=16, max_batches=4)
    assert abs(first["loss"] - math.log(vocab)) < 0.5
    assert first["accuracy"] < 0.01 < 0.03 < first["unigram_accuracy"] < 0.2  # "the" is ~5% of English
    assert mlm_eval(tmp_path / "hf", shards, batch_size=16, max_batches=4) == first  # fixed masks


def test_finetune_protocol_reports_both_baselines(bert_uncased_dir, tmp_path):
    """Three articles apart after a short fine-tune (short inputs keep it to seconds); both
    baselines come from the same call."""
    from pretrain.eval.downstream import FinetuneSettings, finetune_metrics, prepare_tasks

    small = sample_article_task(tmp_path / "small.csv", num_articles=3)
    tasks = prepare_tasks([DownstreamTaskConfig(path=str(small), max_length=24, test_fraction=0.3)], bert_uncased_dir)
    rng_before = torch.get_rng_state()
    m = finetune_metrics(bert_uncased_dir, tasks, "cpu", FinetuneSettings(epochs=3, lr=1e-4, batch_size=8))
    print(m)
    p = "downstream/small/"
    assert set(m) == {
        p + k
        for k in (
            "finetune_accuracy",
            "finetune_macro_f1",
            "finetune_random_init_accuracy",
            "finetune_random_init_macro_f1",
            "majority_accuracy",
            "majority_macro_f1",
            "test_examples",
        )
    }
    assert m[p + "test_examples"] == len(tasks[0].test_ids)
    assert m[p + "finetune_accuracy"] >= 0.8 > m[p + "majority_accuracy"] + 0.2
    assert m[p + "finetune_accuracy"] > m[p + "finetune_random_init_accuracy"]
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_bad_task_files_get_named_errors(tmp_path, capsys, bert_uncased_dir):
    from pretrain.eval.cli import main

    no_label = tmp_path / "no_label.csv"
    no_label.write_text("text,category\nhello there,a\nbye now,b\n")
    with pytest.raises(TaskError, match=r"no_label\.csv: no column 'label'"):
        labelled_task(DownstreamTaskConfig(path=str(no_label)))
    one_class = tmp_path / "one.jsonl"
    one_class.write_text("".join(json.dumps({"text": f"sentence {i}", "label": "x"}) + "\n" for i in range(5)))
    with pytest.raises(TaskError, match=r"one\.jsonl: column 'label': only one class \('x'\)"):
        labelled_task(DownstreamTaskConfig(path=str(one_class)))
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b'{"text": "a", "label": 1}\n{"text": \xff\xfe not json\n')
    with pytest.raises(TaskError, match=r"broken\.jsonl: cannot be read"):
        labelled_task(DownstreamTaskConfig(path=str(broken)))
    empty_text = tmp_path / "empty.tsv"
    empty_text.write_text("text\tlabel\nfine\ta\n\tb\n")
    with pytest.raises(TaskError, match=r"empty\.tsv: column 'text', row 2"):
        labelled_task(DownstreamTaskConfig(path=str(empty_text)))
    with pytest.raises(TaskError, match=r"\.parquet"):
        labelled_task(DownstreamTaskConfig(path=str(tmp_path / "x.parquet")))
    flat = tmp_path / "flat"
    flat.mkdir()
    with pytest.raises(TaskError, match="one subfolder of .txt files per label"):
        labelled_task(DownstreamTaskConfig(path=str(flat)))
    with pytest.raises(TaskError, match="needs held-out text"):
        load_task(DownstreamTaskConfig(path="word_order"))
    with pytest.raises(TaskError, match="no .txt or .jsonl"):
        read_texts(flat)

    assert main([str(bert_uncased_dir), "--task", str(no_label)]) == 2
    assert "no_label.csv: no column 'label'" in capsys.readouterr().err
    assert main([str(tmp_path), "--task", str(one_class)]) == 2
    assert "neither a Hugging Face model folder" in capsys.readouterr().err
    assert main([str(bert_uncased_dir), "--task", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_label_folders_and_given_test_file(tmp_path):
    for label, texts in {
        "pos": ["good film", "great acting", "loved it"],
        "neg": ["bad film", "awful", "hated it"],
    }.items():
        (tmp_path / "train" / label).mkdir(parents=True)
        for i, t in enumerate(texts):
            (tmp_path / "train" / label / f"{i}.txt").write_text(t)
    task = labelled_task(DownstreamTaskConfig(path=str(tmp_path / "train"), test_fraction=0.34, seed=5))
    assert task.label_names == ["neg", "pos"] and len(task.test_texts) == 2 and len(task.train_texts) == 4
    assert sorted(task.test_labels.tolist()) == [0, 1]  # stratified
    (tmp_path / "test.csv").write_text("review,y\nsplendid,pos\nboring,meh\n")
    (tmp_path / "train.csv").write_text("review,y\ngood,pos\nbad,neg\n")
    with pytest.raises(TaskError, match=r"test\.csv: column 'y' has labels absent .*\['meh'\]"):
        labelled_task(
            DownstreamTaskConfig(
                path=str(tmp_path / "train.csv"),
                test_path=str(tmp_path / "test.csv"),
                text_column="review",
                label_column="y",
            )
        )


def test_cli_logs_to_an_mlflow_run(tmp_path, articles_csv, bert_uncased_dir, capsys):
    """Metrics land in the given run (a local sqlite store); an unknown run is refused before any work."""
    from mlflow import MlflowClient

    from pretrain.eval.cli import main
    from pretrain.tracking.mlflow_existing import log_metrics_to_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("eval", artifact_location=str(tmp_path / "art"))).info.run_id
    log_metrics_to_run({"downstream/a/accuracy": 0.75, "downstream/a/macro_f1": float("nan")}, run_id, uri, step=7)
    history = client.get_metric_history(run_id, "downstream/a/accuracy")
    assert [(m.value, m.step) for m in history] == [(0.75, 7)]
    assert "downstream/a/macro_f1" not in client.get_run(run_id).data.metrics
    # Without a step: the run's last one (a training run's final export is scored after its last step)
    for step in (1, 12, 5):
        client.log_metric(run_id, "train/loss", 5.0, step=step)
    assert log_metrics_to_run({"downstream/b/accuracy": 0.5}, run_id, uri) == 12
    assert [m.step for m in client.get_metric_history(run_id, "downstream/b/accuracy")] == [12]
    assert (
        main([str(bert_uncased_dir), "--task", str(articles_csv), "--mlflow-run-id", "0123abcd", "--tracking-uri", uri])
        == 2
    )
    assert "--mlflow-run-id 0123abcd: not usable" in capsys.readouterr().err


def test_a_given_test_file_is_the_test_split(tmp_path, articles_csv, bert_uncased_dir, capsys):
    """--test FILE after --task: its rows are scored, not a share of the task. A test file of the
    training data's most frequent label only: the majority class scores exactly 1.0 on it."""
    import csv

    from pretrain.eval.cli import main

    rows = list(csv.DictReader(articles_csv.open()))
    counts = {}
    for r in rows:
        counts[r["label"]] = counts.get(r["label"], 0) + 1
    top = max(counts, key=lambda k: (counts[k], k))
    test = tmp_path / "test.csv"
    with test.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([r["text"], r["label"]] for r in rows if r["label"] == top)
    argv = [str(bert_uncased_dir), "--task", str(articles_csv), "--max-length", "32"]
    assert main([*argv, "--test", str(test), "--json", str(tmp_path / "given.json")]) == 0
    assert main([*argv, "--json", str(tmp_path / "drawn.json")]) == 0
    given, drawn = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("given", "drawn"))
    assert given["downstream/articles/majority_accuracy"] == 1.0
    assert drawn["downstream/articles/majority_accuracy"] < 0.5
    assert given["downstream/articles/test_examples"] == counts[top]
    quarters = sum(min(n - 1, max(1, round(0.25 * n))) for n in counts.values())  # a quarter of every label
    assert drawn["downstream/articles/test_examples"] == quarters
    for bad, said in (
        (["--test", str(test), *argv[:1], "--task", str(articles_csv)], "give it after the --task"),
        ([*argv, "--test", str(test), "--test", str(test)], "already has --test"),
        ([str(bert_uncased_dir), "--task", "word_order", "--test", str(test)], "makes its own test split"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(bad)
        assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_a_finetune_says_how_far_along_it_is():
    import io

    from pretrain.eval.downstream import StepProgress

    out = io.StringIO()
    progress = StepProgress("fine-tune articles (the model)", total=4, every=0.0, stream=out)
    for _ in range(4):
        progress.step()
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("fine-tune articles (the model): step 1/4 (")
    assert lines[-1].endswith("steps/s), 0m00s left") and "step 4/4" in lines[-1]


def test_a_score_says_how_precise_it_is():
    """Wilson's 95% interval, as scipy computes it (an implementation of its own), from a single
    example to a probe's thousands; inside [0, 1] at 0 and 1 of n correct, where p +- 1.96 s.e. is
    not; no interval without examples."""
    from scipy.stats import binomtest

    from pretrain.eval.intervals import interval_text

    for correct, examples in ((0, 1), (1, 1), (3, 7), (0, 10), (10, 10), (50, 100), (114, 133), (1337, 2000)):
        reference = binomtest(correct, examples).proportion_ci(confidence_level=0.95, method="wilson")
        low, high = wilson(correct / examples, examples)
        assert math.isclose(low, reference.low, abs_tol=1e-12) and math.isclose(high, reference.high, abs_tol=1e-12)
        assert 0.0 <= low <= correct / examples <= high <= 1.0
    assert wilson(114 / 133, 133)[1] - wilson(114 / 133, 133)[0] > 0.1  # the demo's probe: +-0.06, not a point
    assert all(math.isnan(v) for v in wilson(0.5, 0))
    assert interval_text(114 / 133, 133.0, "held-out sentences") == "95% interval 0.788-0.907, 133 held-out sentences"
