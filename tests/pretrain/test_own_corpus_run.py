"""Continued pretraining as people run it on their own corpus (issue 82): what a resumed run keeps,
and what a run says about where it started."""

from __future__ import annotations

import pytest

from conftest import train


@pytest.mark.slow
def test_a_resumed_auto_run_keeps_its_checkpoints_precision(shards, tmp_path):
    """impl.precision=auto on a resume takes the checkpoint's precision, without timing the step again
    (a new timing at another world size on a busy machine had switched a bf16 run to fp32)."""
    out = tmp_path / "run"
    train(shards, out, "train.max_steps=2", "train.checkpoint_every=2", "impl.precision=fp32", check=True)
    proc = train(shards, out, "train.max_steps=4", "train.checkpoint_every=2", "impl.precision=auto", check=True)
    text = proc.stdout + proc.stderr
    assert "precision fp32 (auto: fp32, as checkpoint step00000002 was trained" in text, text[-3000:]
    assert "timing this model's step" not in text


@pytest.mark.slow
def test_a_run_from_init_from_states_what_it_trains_and_where_it_started(shards, tmp_path):
    """model.init_from: a 2 x 48 encoder (tiny.yaml says 2 x 64): the MLflow params and the checkpoint's
    resolved config say 48 and 96; step 0's probe rows hold that encoder's own score beside random
    weights and the majority class; the same command resumes (the shape fields are the folder's)."""
    import json
    import re
    import shutil

    import mlflow
    from transformers import BertConfig, BertModel

    manifest = json.loads((shards / "manifest.json").read_text())
    encoder = tmp_path / "encoder"
    BertModel(
        BertConfig(
            vocab_size=manifest["tokenizer"]["vocab_size"],
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=96,
            max_position_embeddings=128,
        )
    ).save_pretrained(encoder)
    for p in (shards.parent / "tok").iterdir():
        shutil.copy(p, encoder / p.name)
    out = tmp_path / "run"
    common = [
        f"model.init_from={encoder}",
        "train.checkpoint_every=2",
        "train.eval_every=0",
        "tracking.backend=mlflow",
        "eval.downstream=[{path: word_order, max_examples: 120, max_length: 32}]",
    ]
    first = train(shards, out, "train.max_steps=2", *common, check=True)
    proc = train(shards, out, "train.max_steps=4", *common, check=True)
    assert "resumed from step00000002" in proc.stdout + proc.stderr
    # the MLM head the encoder lacks starts fresh: said when it does, not on the resume that loads it
    assert "weight tensors are not in" in first.stdout + first.stderr
    assert "weight tensors are not in" not in proc.stdout + proc.stderr
    # a plain stop and resume ran no step twice: nothing to say about re-run points
    assert "re-run points" not in proc.stdout + proc.stderr
    # the end line gives the run's time, both jobs, and this job's beside it
    seconds = [
        json.loads((out / "checkpoints" / f"step0000000{s}" / "train_state.json").read_text())["seconds"]
        for s in (2, 4)
    ]
    assert 0 < seconds[0] < seconds[1]
    assert re.search(r"done: 4 steps, [\d,]+ tokens in \dm\d\ds \(this job: \dm\d\ds\)", proc.stdout + proc.stderr)
    assert not re.search(r"this job", first.stdout + first.stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (step0,) = [r for r in rows if "downstream/word_order/init_from_accuracy" in r]
    assert step0["step"] == 0 and "downstream/word_order/random_init_accuracy" in step0
    assert 0.0 < step0["downstream/word_order/init_from_accuracy"] <= 1.0
    saved = (out / "checkpoints" / "step00000004" / "config.yaml").read_text()
    assert "hidden_size: 48" in saved and "intermediate_size: 96" in saved and "hidden_size: 64" not in saved
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    params = client.get_run((out / "mlflow_run_id").read_text().strip()).data.params
    assert params["model.hidden_size"] == "48" and params["model.num_layers"] == "2"
    assert params["model.intermediate_size"] == "96"
