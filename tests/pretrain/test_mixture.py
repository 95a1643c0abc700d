"""Data mixtures (``data.sources``, pretrain.data.mixture) over real shards of two slices of the corpus.

Loader-level: the sources' shares, each source's own epochs, resume at another world size and
micro-batch. Entry points: the ``plan`` verb, refusals before any process group starts (exit 2),
and one 2-rank DeepSpeed run whose per-source metrics reach metrics.jsonl and a real MLflow server.
"""

from __future__ import annotations

import os
import sys
from collections import Counter, defaultdict

import numpy as np
import pytest

from conftest import REPO, _run, free_port, rank_pool, run_module, trainer_env
from data_prep.common.manifest import load_manifest
from mlflow_server import mlflow_server  # noqa: F401  (a fixture)
from pretrain.data.mixture import MixtureStream, Source, apportion
from pretrain.data.stream import DataError

PY = sys.executable
G, SEED = 32, 11


def mixture(two_sources, rank=0, world=1, micro_batch=G, weights=(0.8, 0.2), num_workers=0) -> MixtureStream:
    sources = [Source(name, str(two_sources[name]), w) for name, w in zip(("big", "small"), weights)]
    manifests = [load_manifest(s.dir) for s in sources]
    return MixtureStream(sources, manifests, "train", rank, world, micro_batch, G, SEED, num_workers)


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_apportionment_is_within_one_sequence_and_never_steps_back():
    rng = np.random.default_rng(0)
    for _ in range(20):
        shares = rng.dirichlet(np.ones(rng.integers(2, 6)))
        g = int(np.ceil(1 / shares.min()))  # every source >= 1 sequence a step
        previous = np.asarray(apportion(shares, 0))
        for step in range(1, 300):
            counts = np.asarray(apportion(shares, step * g))
            assert counts.sum() == step * g
            assert np.all(np.abs(counts - shares * step * g) < 1)
            assert np.all(counts >= previous)
            previous = counts


def test_token_shares_follow_the_weights_and_the_small_source_repeats(two_sources):
    s = mixture(two_sources)
    steps = 3 * s.source_sequences()[1] // (G // 5) // 2 + 1  # the small source: about 1.5 epochs
    tokens, seen = defaultdict(int), defaultdict(list)
    for batch in take(s, steps):
        nonpad = (batch["input_ids"] != 0).sum(1)
        for src, n, sid in zip(batch["source"].tolist(), nonpad.tolist(), batch["sample_ids"].tolist()):
            tokens[src] += n
            seen[src].append(sid)
    total = tokens[0] + tokens[1]
    assert abs(tokens[0] / total - 0.8) < 0.01 and abs(tokens[1] / total - 0.2) < 0.01, dict(tokens)
    assert len(seen[0]) == s.consumed(steps)[0] and abs(len(seen[1]) - 0.2 * steps * G) < 1
    small = s.source_sequences()[1]
    assert len(seen[1]) > small  # the small source went round again,
    times = Counter(seen[1])  # each sequence once before any twice
    assert len(times) == small and set(times.values()) == {1, 2}
    assert sum(v == 2 for v in times.values()) == len(seen[1]) - small
    assert not set(seen[0]) & set(seen[1])  # sample ids unique over the mixture
    assert s.epochs(steps)[1] == pytest.approx(len(seen[1]) / small)


def run_job(two_sources, world, micro_batch, steps, state=None, num_workers=0):
    """Every rank of one job for ``steps`` global steps; ({step: sorted sample ids}, {id: row bytes}, state)."""
    per_step, row_bytes, states = defaultdict(list), {}, []
    for rank in range(world):
        s = mixture(two_sources, rank, world, micro_batch, num_workers=num_workers)
        if state is not None:
            s.load_state_dict(state)
        for batch in take(s, steps * s.grad_accum):
            per_step[batch["global_step"]].append(batch["sample_ids"].numpy())
            row_bytes.update(zip(batch["sample_ids"].tolist(), (r.tobytes() for r in batch["input_ids"].numpy())))
        states.append(s.state_dict())
    return {k: np.sort(np.concatenate(v)) for k, v in per_step.items()}, row_bytes, states[0]


def test_resume_at_other_world_sizes_gives_the_same_samples_step_by_step(two_sources):
    leg = 7
    reference, reference_rows, _ = run_job(two_sources, 1, G, 3 * leg)
    legs, rows, state = {}, {}, None
    for world, micro, workers in ((2, 8, 0), (1, 8, 2), (4, 4, 0)):  # accumulation 2, 4, 2
        got, got_rows, state = run_job(two_sources, world, micro, leg, state, workers)
        assert sorted(got) == list(range(len(legs), len(legs) + leg))
        legs.update(got)
        rows.update(got_rows)
    assert legs.keys() == reference.keys()
    for k in reference:
        assert np.array_equal(legs[k], reference[k]), f"global step {k} holds other samples"
    assert all(rows[i] == reference_rows[i] for i in reference_rows)
    assert np.sort(mixture(two_sources).step_sample_ids(5)).tolist() == reference[5].tolist()


def test_a_changed_weight_or_source_is_refused_by_name(two_sources):
    s = mixture(two_sources)
    take(s, 2)
    state = s.state_dict()
    with pytest.raises(DataError, match=r"source 'small': weight share changed"):
        mixture(two_sources, weights=(0.7, 0.3)).load_state_dict(state)
    swapped = {**state, "sources": {"big": state["sources"]["big"], "books": state["sources"]["small"]}}
    with pytest.raises(DataError, match=r"source 'books': only in the checkpoint.*source 'small': not in"):
        mixture(two_sources).load_state_dict(swapped)


def sources_override(two_sources, extra: str = "") -> str:
    return (
        f"data.sources=[{{name: big, dir: {two_sources['big']}, weight: 0.8}}, "
        f"{{name: small, dir: {two_sources['small']}, weight: 0.2}}{extra}]"
    )


@pytest.mark.slow
def test_plan_prints_each_sources_share_and_epochs(two_sources):
    out = _run(
        [
            PY,
            "-m",
            "pretrain.data",
            "plan",
            "--config",
            "configs/mixture.yaml",
            "data.dir=",
            sources_override(two_sources),
            "train.max_steps=400",
            "train.global_batch_size=32",
        ]
    ).stdout
    small = sum(s.sequences for s in load_manifest(two_sources["small"]).shards_of("train"))
    assert "400 steps of 32 sequences of 64 tokens" in out
    assert (
        f"small: {small} sequences, share of the steps 0.200 (2560 sequences by step 400), "
        f"epochs at step 400: {2560 / small:.3f}" in out
    ), out


@pytest.fixture(scope="module")
def odd_sources(shards, wiki_txt_dir, tmp_path_factory):
    """Sources the mixture must refuse: another tokenizer, another sequence length."""
    root = tmp_path_factory.mktemp("odd_sources")
    text = f"{wiki_txt_dir}/wiki-03.txt"
    _run(
        [
            PY,
            "-m",
            "data_prep",
            "tokenizer",
            "--input",
            text,
            "--out",
            str(root / "tok"),
            "--vocab-size",
            "2048",
            "--lowercase",
        ]
    )
    for name, tok, seq_len in (("othertok", root / "tok", "64"), ("short", shards.parent / "tok", "32")):
        _run(
            [
                PY,
                "-m",
                "data_prep",
                "shard",
                "--input",
                text,
                "--tokenizer",
                str(tok),
                "--out",
                str(root / name),
                "--seq-len",
                seq_len,
                "--shard-size",
                "400",
                "--block-size",
                "64",
                "--validation-fraction",
                "0.05",
            ]
        )
        _run([PY, "-m", "data_prep", "finalize", str(root / name)])
    return root


@pytest.mark.slow
def test_another_tokenizer_or_sequence_length_is_refused_by_name(two_sources, odd_sources, tmp_path):
    extra = (
        f", {{name: othertok, dir: {odd_sources / 'othertok'}, weight: 0.2}}"
        f", {{name: short, dir: {odd_sources / 'short'}, weight: 0.2}}"
    )
    proc = run_module(
        "pretrain.train",
        "--config",
        "configs/tiny.yaml",
        sources_override(two_sources, extra),
        f"train.out_dir={tmp_path / 'run'}",
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "data.sources[othertok]: tokenizer sha256" in err and "data.sources[othertok]: vocab_size 2048" in err
    assert "data.sources[short]: seq_len 32 differs from the first source 'big' (64)" in err
    assert "data.sources[big]" not in err and "data.sources[small]" not in err
    assert "process group" not in proc.stdout + err and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_mixture_trains_with_per_source_metrics_in_jsonl_and_mlflow(two_sources, tmp_path, mlflow_server):  # noqa: F811
    """One 2-rank DeepSpeed launch; then a resume with another weight is refused by source name."""
    from mlflow.tracking import MlflowClient

    from pretrain.tracking.jsonl import read_metrics

    out = tmp_path / "run"
    args = [
        "--config",
        "configs/tiny.yaml",
        sources_override(two_sources),
        f"train.out_dir={out}",
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=3",
        "train.eval_sequences=32",
        "train.checkpoint_every=0",
        "model.max_position_embeddings=64",
        "tracking.backend=mlflow",
        f"tracking.tracking_uri={mlflow_server.uri}",
        "tracking.experiment=mixture",
    ]
    proc = rank_pool().run("pretrain.train", args, trainer_env(), 2, free_port(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    small = sum(s.sequences for s in load_manifest(two_sources["small"]).shards_of("train"))
    assert f"small: {small} sequences, share of the steps 0.200 (19 sequences by step 6)" in proc.stdout

    rows = defaultdict(dict)  # the training and the evaluation rows of a step together
    for row in read_metrics(out / "metrics.jsonl"):
        rows[row["step"]].update(row)
    last = rows[6]
    # 6 steps of 16: 76.8 / 19.2 sequences -> 77 and 19 (largest remainder), of 64 tokens each
    assert last["data/big/tokens"] == 77 * 64 and last["data/small/tokens"] == 19 * 64
    assert last["data/small/epochs_at_max_steps"] == pytest.approx(19 / small)
    assert rows[2]["data/big/tokens"] + rows[2]["data/small/tokens"] == rows[2]["train/tokens_seen"]
    for step in (3, 6):
        for name in ("big", "small"):
            assert 0 <= rows[step][f"eval/{name}/accuracy"] < 1 and 4 < rows[step][f"eval/{name}/loss"] < 12
        assert (
            min(rows[step]["eval/big/loss"], rows[step]["eval/small/loss"])
            <= rows[step]["eval/loss"]
            <= max(rows[step]["eval/big/loss"], rows[step]["eval/small/loss"])
        )

    client = MlflowClient(mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("mixture").experiment_id])
    for key in ("eval/big/loss", "eval/small/accuracy", "data/small/tokens", "data/big/epochs_at_max_steps"):
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert logged == sorted((s, pytest.approx(r[key])) for s, r in rows.items() if key in r), key

    params = run.data.params  # each source's data, not the first one's alone
    trains = {name: load_manifest(two_sources[name]).totals["train"] for name in ("big", "small")}
    for name, train in trains.items():
        assert params[f"data.sources.{name}.train_sequences"] == str(train["sequences"])
        assert params[f"data.sources.{name}.train_tokens"] == str(train["tokens"])
        assert params[f"data.sources.{name}.tokenizer_sha256"] == load_manifest(two_sources[name]).tokenizer.sha256
    assert params["data.sources.small.share"] == "0.2"
    assert params["data.train_tokens"] == str(sum(t["tokens"] for t in trains.values()))

    heavier = sources_override(two_sources).replace("weight: 0.2", "weight: 0.4")
    again = run_module("pretrain.train", *args, heavier, "train.max_steps=8", "tracking.backend=none", timeout=300)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-3000:]
    assert "data.sources[small]: weight share 0.2 in checkpoint" in again.stderr
    assert "data.sources[big]: weight share 0.8 in checkpoint" in again.stderr


def test_config_problems_of_sources_are_all_reported_by_name(two_sources, monkeypatch):
    from pretrain.config.schema import ConfigError, load_config
    from pretrain.data.mixture import min_share_problems

    monkeypatch.setenv("WORLD_SIZE", "1")
    twice = sources_override(two_sources).replace("name: small", "name: big").replace("weight: 0.2", "weight: 0")
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", [twice, "data.dir=/elsewhere"])
    text = str(err.value)
    assert "data.sources: name 'big' used twice" in text and "data.sources[1].weight: must be positive" in text
    assert "data.dir: '/elsewhere' with sources" in text
    cfg = load_config("configs/tiny.yaml", [sources_override(two_sources).replace("weight: 0.2", "weight: 0.05")])
    assert cfg.data.dir == str(two_sources["big"])  # the first source's folder: the run's tokenizer
    assert min_share_problems(cfg) == [
        (
            "data.sources[small]: weight share 0.05882 x train.global_batch_size 16 < 1 "
            "sequence per step; raise its weight or the global batch"
        )
    ]
