"""The attention kernel chosen by timing (pretrain.runtime.attention) and run by the model (use_attention)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from pretrain.config.schema import ImplConfig
from pretrain.model import keyed_dropout
from pretrain.runtime import attention
from tests.model_checks import masked
from tests.pretrain.test_masking import SPECIAL
from tests.pretrain.test_model import TINY, VOCAB, build_model, rows  # noqa: F401  (rows: a fixture)

SHAPE = (4, 2, 64, 16)


def test_every_cpu_candidate_is_timed_and_the_fastest_is_cached(tmp_path):
    path = tmp_path / "attention.json"
    choice, why = attention.choose(torch.device("cpu"), torch.float32, SHAPE, path)
    assert why.endswith("measured now") and choice in attention.CPU_CANDIDATES
    timed = next(iter(json.loads(path.read_text()).values()))["ms"]
    assert sorted(timed) == sorted(attention.CPU_CANDIDATES) and all(v > 0 for v in timed.values())
    # the cache writes its keys sorted: a tie at the recorded digits is settled by the candidates'
    # order (the next test), not by the file's
    assert timed[choice] == min(timed.values())
    again, why = attention.choose(torch.device("cpu"), torch.float32, SHAPE, path)
    assert again == choice and f"cached in {path}" in why
    _, why = attention.choose(torch.device("cpu"), torch.float32, (2, *SHAPE[1:]), path)  # another shape
    assert why.endswith("measured now") and len(json.loads(path.read_text())) == 2


def test_the_choice_is_the_fastest_candidate(tmp_path, monkeypatch):
    monkeypatch.setattr(
        attention, "time_candidates", lambda *a, **k: {"sdpa_flash": 0.030, "sdpa_math": 0.010, "eager": 0.020}
    )
    choice, why = attention.choose(torch.device("cpu"), torch.bfloat16, SHAPE, tmp_path / "a.json")
    assert choice == "sdpa_math" and why.startswith("forward+backward sdpa_math 10.0 ms, eager 20.0 ms")
    monkeypatch.setattr(  # a tie at the recorded digits: the first candidate in order, sdpa_flash
        attention, "time_candidates", lambda *a, **k: {"sdpa_flash": 0.0200001, "sdpa_math": 0.030, "eager": 0.020}
    )
    choice, _ = attention.choose(torch.device("cpu"), torch.float32, SHAPE, tmp_path / "b.json")
    assert choice == "sdpa_flash"


def attention_ops(model, m, ids) -> tuple[torch.Tensor, set]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss, _, _ = model(m.input_ids, None, m.positions, m.labels)
        loss.backward()
    names = {e.key for e in prof.key_averages()}
    return loss.detach(), {n for n in names if "scaled_dot_product" in n}


def test_each_choice_runs_its_kernel_with_the_same_loss_and_gradients(rows):  # noqa: F811
    ids, m = masked(rows)
    full = (ids != SPECIAL.pad).all(dim=1)
    ids, m = masked((rows[0][full], rows[1][full]))
    runs = {}
    for name in ("sdpa_flash", "sdpa_math", "eager"):
        torch.manual_seed(0)
        model = build_model(
            dataclasses.replace(TINY, hidden_dropout=0.0, attention_dropout=0.0),
            VOCAB,
            SPECIAL,
            ImplConfig(attention=name),
        )
        assert model.attention == name
        loss, ops = attention_ops(model, m, ids)
        runs[name] = (loss, ops, {n: p.grad.clone() for n, p in model.named_parameters()})
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in runs["sdpa_flash"][1]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in runs["sdpa_math"][1]
    assert "aten::scaled_dot_product_attention" in runs["sdpa_math"][1] and not runs["eager"][1]
    loss, _, grads = runs["sdpa_flash"]
    for name in ("sdpa_math", "eager"):
        assert torch.allclose(runs[name][0], loss, rtol=1e-5), name
        for key, grad in grads.items():
            assert (runs[name][2][key] - grad).norm() <= 1e-4 * grad.norm() + 1e-8, (name, key)


def test_resolve_times_only_auto_and_keeps_keyed_dropouts_attention(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "cache_path", lambda: tmp_path / "attention.json")
    model = build_model(TINY, VOCAB, SPECIAL, ImplConfig())
    cpu = torch.device("cpu")
    assert attention.resolve(model, "sdpa_math", cpu, torch.float32, 4, 64) == ("sdpa_math", "impl.attention")
    name, why = attention.resolve(model, "auto", cpu, torch.float32, 4, 64)
    assert name in attention.CPU_CANDIDATES and why.endswith("measured now")
    dropped = build_model(dataclasses.replace(TINY, attention_dropout=0.1), VOCAB, SPECIAL, ImplConfig())
    keyed_dropout.install(dropped.hf_model, seed=0)
    assert attention.resolve(dropped, "auto", cpu, torch.float32, 4, 64) == (keyed_dropout.KEYED_ATTENTION, "as built")
    dropped.use_attention(keyed_dropout.KEYED_ATTENTION)
    assert dropped.config._attn_implementation == keyed_dropout.KEYED_ATTENTION
    with pytest.raises(ValueError, match="unknown attention"):
        model.use_attention("flash_attention_3")


@pytest.mark.slow
def test_the_trainer_times_attention_once_and_a_resume_keeps_the_runs_choice(shards, tmp_path):
    from conftest import explain, train

    env = {"MLM_PRETRAIN_CACHE": str(tmp_path / "cache")}
    run = tmp_path / "run"
    common = ("train.max_steps=4", "model.attention_dropout=0")  # dropout on the probabilities: eager
    first = train(shards, run, *common, "train.halt_at_step=2", "train.checkpoint_every=2", env=env)
    assert first.returncode == 0, explain(first)
    chosen = re.search(r"attention: (\w+) \(forward\+backward .* measured now\)", first.stdout).group(1)
    assert chosen in attention.CPU_CANDIDATES and f"attention {chosen} within each row, ZeRO" in first.stdout
    cache = tmp_path / "cache" / "attention.json"
    entries = json.loads(cache.read_text())
    ((key, entry),) = entries.items()
    other = next(name for name in attention.CPU_CANDIDATES if name != chosen)
    cache.write_text(json.dumps({key: {**entry, "choice": other}}))  # this machine now times another fastest

    resumed = train(shards, run, *common, env=env)
    assert resumed.returncode == 0, explain(resumed)
    assert f"attention: {chosen}, as this run started (timed here: {other})" in resumed.stdout
    assert f"attention {chosen} within each row, ZeRO" in resumed.stdout and "start: step 2 (resumed" in resumed.stdout


def test_a_resume_where_flash_attn_is_missing_continues_with_the_timed_choice(caplog):
    """A run that started with flash_attention_2 and is requeued onto a node without flash-attn:
    one warning, then the attention timed here (the same maths up to rounding), recorded as the run's."""
    import logging
    from types import SimpleNamespace

    from pretrain.run import keep_attention

    model = build_model(TINY, VOCAB, SPECIAL, ImplConfig(attention="flash_attention_2"))  # sdpa on the CPU
    model.use_attention("sdpa_math")
    run = SimpleNamespace(
        model=model,
        state=SimpleNamespace(attention="flash_attention_2"),
        cfg=SimpleNamespace(impl=ImplConfig(attention="auto")),
    )
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        keep_attention(run)
    assert "started with flash_attention_2, which cannot run here" in caplog.text
    assert model.attention == run.state.attention == "sdpa_math"
    # and the other way: a flash-attn build resuming a run that chose an SDPA backend runs that backend
    flash_built = build_model(TINY, VOCAB, SPECIAL, ImplConfig())
    flash_built.config._attn_implementation = "flash_attention_2"  # as built on a GPU with flash-attn
    flash_built.use_attention("sdpa_flash")
    assert flash_built.config._attn_implementation == "sdpa" and flash_built.attention == "sdpa_flash"


def test_the_probe_baseline_is_built_with_sdpa_in_fp32_whatever_the_run_uses():
    """flash-attn refuses fp32, and keyed dropout's attention is the trainer's: the random-weights
    baseline of the downstream probe is an fp32 SDPA encoder."""
    from pretrain.eval.downstream import random_like

    model = build_model(TINY, VOCAB, SPECIAL, ImplConfig())
    config = model.config
    config._attn_implementation = "flash_attention_2"
    baseline = random_like(config)
    assert baseline.config._attn_implementation == "sdpa" and config._attn_implementation == "flash_attention_2"
    assert next(baseline.parameters()).dtype == torch.float32
    with torch.no_grad():
        out = baseline(input_ids=torch.randint(5, VOCAB, (2, 16))).last_hidden_state
    assert out.shape == (2, 16, TINY.hidden_size) and torch.isfinite(out).all()


@pytest.mark.parametrize("wanted, scope", [("flash_attention_2", "row"), ("flex_attention", "document")])
def test_a_kernel_named_where_it_cannot_run_falls_back_to_sdpa_and_trains(wanted, scope, caplog):
    """``impl.attention=flash_attention_2`` (or ``flex_attention``) on a machine without it: one warning,
    the model built with SDPA, and the run goes on with it (it used to stop at start-up with
    "unknown attention 'flash_attention_2'")."""
    import logging

    with caplog.at_level(logging.WARNING, logger="pretrain"):
        model = build_model(
            dataclasses.replace(TINY, attention_scope=scope), VOCAB, SPECIAL, ImplConfig(attention=wanted)
        )
    assert f"impl.attention={wanted} cannot run here" in caplog.text and "using sdpa" in caplog.text
    name, why = attention.resolve(model, wanted, torch.device("cpu"), torch.float32, 2, 16)
    assert (name, why) == ("sdpa", f"impl.attention={wanted} cannot run here")
    model.use_attention(name)
    ids = torch.randint(5, VOCAB, (2, 16))
    ids[:, 7] = SPECIAL.sep  # two documents a row
    hidden = model.encode(ids, None)
    hidden.float().sum().backward()
    assert torch.isfinite(hidden).all() and model.config._attn_implementation == "sdpa"


def test_flex_attention_is_for_document_scope(shards):
    from pretrain.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="impl.attention=flex_attention runs document scope's block mask"):
        load_config("configs/tiny.yaml", ["impl.attention=flex_attention", f"data.dir={shards}"])
    cfg = load_config(
        "configs/tiny.yaml", ["impl.attention=flex_attention", "model.attention_scope=document", f"data.dir={shards}"]
    )
    assert cfg.impl.attention == "flex_attention"
