"""ModernBERT as ``model.arch: modernbert``: the model with its sparse head, settings refused by name,
the FLOP counter, and the trainer end to end through ``deepspeed --module pretrain.train`` on 2 CPU
ranks (ZeRO 2 and 3, exact resume, export with equal logits, fill-mask, continued pretraining)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import _run as run  # python -m ... through the rank pool
from conftest import train as launch
from pretrain.config.schema import ConfigError, ImplConfig, ModelConfig, load_config
from pretrain.model.flops import attended_pairs, mlm_flops_per_sequence
from pretrain.model.masking import SpecialIds, eval_masking_config, mask_batch
from pretrain.model.mlm import attention_implementation, build_model
from tests.model_checks import assert_sparse_head_equals_dense, dense_labels, masked, sparse_mean_loss
from tests.pretrain.test_masking import SPECIAL, pack_rows

PY = sys.executable
CONFIG = "configs/modernbert-tiny.yaml"
VOCAB = SPECIAL.vocab_size
DROPOUTS = dict(embedding_dropout=0.1, mlp_dropout=0.1, attention_dropout=0.1)
TINY = dict(
    arch="modernbert",
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    intermediate_size=96,
    max_position_embeddings=128,
    local_attention=16,
)


@pytest.fixture(scope="module")
def rows(wiki_articles, bert_uncased_dir):
    ids, starts = pack_rows(wiki_articles[:200], bert_uncased_dir, min_tokens=4000)
    assert ids[-1, -1] == SPECIAL.pad
    return ids[-8:], starts[-8:]  # 8 rows of 128, the last one padded


def tiny(seed=0, impl=None, **model) -> "MLMModel":  # noqa: F821
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**TINY, **model}), VOCAB, SPECIAL, impl or ImplConfig())


# ----------------------------------------------------------------------------------- the model


def test_sparse_head_equals_dense_head_and_hf_loss(rows):
    from transformers import ModernBertForMaskedLM

    ids, m = masked(rows)
    sparse, dense = tiny(**DROPOUTS), tiny(impl=ImplConfig(sparse_head=False), **DROPOUTS)
    assert isinstance(sparse.hf_model, ModernBertForMaskedLM)
    hf = sparse.hf_model
    assert hf.decoder.weight is hf.model.embeddings.tok_embeddings.weight
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert (hf.config.embedding_dropout, hf.config.mlp_dropout, hf.config.attention_dropout) == (0.1, 0.1, 0.1)
    assert_sparse_head_equals_dense(sparse, dense, ids, m, SPECIAL.pad)
    with torch.no_grad():  # Hugging Face's softmax includes the padding rows: pushed out of it
        hf.decoder.bias[VOCAB:] = -1e4
    mine, attn, labels = sparse_mean_loss(sparse, ids, m, SPECIAL.pad), ids != SPECIAL.pad, dense_labels(ids, m)
    with torch.no_grad():  # Hugging Face's own loss: dense, then its sparse_prediction option
        hf_dense = hf(input_ids=m.input_ids, attention_mask=attn, labels=labels).loss
        hf.sparse_prediction = True
        hf_sparse = hf(input_ids=m.input_ids, attention_mask=attn, labels=labels).loss
        hf.sparse_prediction = False
    assert torch.allclose(mine, hf_dense, rtol=1e-5) and torch.allclose(hf_sparse, hf_dense, rtol=1e-5)
    assert 0.8 * math.log(VOCAB) < float(hf_dense) < 1.2 * math.log(VOCAB)  # untrained: about ln(V)


def test_no_mask_means_no_padding_and_sdpa_equals_eager(rows):
    ids, m = masked(rows)
    model, eager = tiny().eval(), tiny(impl=ImplConfig(attention="eager")).eval()
    assert eager.config._attn_implementation == "eager" and model.config._attn_implementation == "sdpa"
    last = m.input_ids[-1:]
    real = int((last != SPECIAL.pad).sum())
    in_last = m.positions >= (len(ids) - 1) * ids.shape[1]
    pos, labels = m.positions[in_last] - (len(ids) - 1) * ids.shape[1], m.labels[in_last]
    full = m.positions < (len(ids) - 1) * ids.shape[1]  # the first 7 rows have no padding
    with torch.no_grad():
        padded, _, _ = model(last, last != SPECIAL.pad, pos, labels)
        trimmed, _, _ = model(last[:, :real], None, pos, labels)
        no_mask, _, _ = model(m.input_ids[:-1], None, m.positions[full], m.labels[full])
        all_true, _, _ = model(
            m.input_ids[:-1], torch.ones_like(ids[:-1], dtype=torch.bool), m.positions[full], m.labels[full]
        )
        with_sdpa, _, _ = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
        with_eager, _, _ = eager(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    assert real < last.shape[1]
    assert torch.allclose(padded, trimmed, rtol=1e-5)
    assert torch.allclose(no_mask, all_true, rtol=1e-6)
    assert torch.allclose(with_sdpa, with_eager, rtol=1e-5)


def test_local_window_is_the_configured_one(rows):
    """The same weights (and one rotary base): local layers whose window covers the sequence are
    global layers; a 16-token window is not."""
    ids, _ = masked(rows)
    attn, theta = ids != SPECIAL.pad, dict(rope_theta=1e4, local_rope_theta=1e4)
    with torch.no_grad():
        all_global = tiny(global_attn_every_n_layers=1, **theta).eval().encode(ids, attn)
        wide = tiny(local_attention=2 * ids.shape[1], **theta).eval().encode(ids, attn)
        narrow = tiny(local_attention=16, **theta).eval().encode(ids, attn)
    assert torch.equal(wide, all_global)
    assert (narrow - all_global).abs().max() > 1e-3 * all_global.abs().mean()


def test_attention_switch_falls_back_to_sdpa_on_cpu(caplog):
    assert not torch.cuda.is_available()
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert attention_implementation(ImplConfig(attention="auto")) == "sdpa"
        assert not caplog.records  # auto: no warning, sdpa is the answer here
        assert attention_implementation(ImplConfig(attention="flash_attention_2")) == "sdpa"
    assert "flash_attention_2 cannot run here (no CUDA device" in caplog.text
    assert attention_implementation(ImplConfig(attention="eager")) == "eager"
    assert tiny(impl=ImplConfig(attention="flash_attention_2")).config._attn_implementation == "sdpa"


def test_attention_is_timed_with_the_local_layers_mask_the_model_passes(rows, tmp_path, monkeypatch):
    """ModernBERT's local layers hand SDPA a sliding-window mask, which flash cannot take on CUDA:
    each candidate is timed with that very mask on its share of the layers, and a chosen backend
    falls back to the memory-efficient and cuDNN kernels before the math path."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from pretrain.runtime import attention

    model = tiny(global_attn_every_n_layers=3, local_attention=16)
    ids, _ = masked(rows)
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model.encode(ids, None)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    local = [m for m in seen if m is not None]
    assert len(seen) == 3 and len(local) == 2  # layers 1 and 2 of 3 are local
    assert torch.equal(local[0], attention.window_mask(ids.shape[1], 16, ids.shape[0], ids.device))
    assert attention.local_layers(model.config) == (16, 2 / 3)

    asked, time_candidates = {}, attention.time_candidates
    monkeypatch.setattr(attention, "time_candidates", lambda *a, **k: asked.update(k) or {"sdpa_math": 1e-3})
    monkeypatch.setattr(attention, "cache_path", lambda: tmp_path / "attention.json")
    attention.resolve(model, "auto", torch.device("cpu"), torch.float32, 8, ids.shape[1])
    assert asked == {"window": 16, "local_share": 2 / 3, "documents": False}
    assert "|window=16@0.667" in next(iter(json.loads((tmp_path / "attention.json").read_text())))
    timed = time_candidates(
        torch.device("cpu"),
        torch.float32,
        (2, 4, 64, 16),
        attention.CPU_CANDIDATES,
        repeats=1,
        window=16,
        local_share=2 / 3,
    )
    assert sorted(timed) == sorted(attention.CPU_CANDIDATES) and all(t > 0 for t in timed.values())

    model.use_attention("sdpa_flash")
    assert model.sdpa_backends == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on a CUDA GPU only")
def test_flash_attention_matches_sdpa_on_gpu(rows):
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available() or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs flash-attn and an Ampere or newer GPU")
    ids, m = masked(rows)
    out = []
    for attention in ("flash_attention_2", "sdpa"):
        model = tiny(impl=ImplConfig(attention=attention, precision="bf16")).cuda().to(torch.bfloat16).eval()
        assert model.config._attn_implementation == attention
        with torch.no_grad():
            loss, _, count = model(m.input_ids.cuda(), (ids != SPECIAL.pad).cuda(), m.positions.cuda(), m.labels.cuda())
        out.append(float(loss / count))
    assert out[0] == pytest.approx(out[1], rel=2e-2)


# ------------------------------------------------------------------------------------- FLOPs


def test_attended_pairs_by_brute_force():
    for length in (1, 5, 64, 130):
        for half in (None, 0, 1, 8, 63, 64, 200):
            pos = torch.arange(length)
            within = (pos[:, None] - pos[None, :]).abs() <= (length if half is None else half)
            assert attended_pairs(length, half) == int(within.sum()), (length, half)


def test_flops_by_hand():
    one = ModelConfig(arch="modernbert", hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16)
    # L=4: projections 4*2*4*64 = 2048, scores + weighted sum 2 * 2*16*8 = 512,
    # GeGLU 3 * 2*4*8*16 = 3072; head per predicted token 2*64 + 2*8*20 = 448; training = 3 x forward
    assert mlm_flops_per_sequence(one, 4, 2, sparse_head=True, vocab_size=20) == 3 * (5632 + 2 * 448)
    # two local layers of window 2 (|i - j| <= 1: 4 + 2*3 = 10 pairs of 16) after the global one
    three = ModelConfig(
        arch="modernbert", hidden_size=8, num_layers=3, num_heads=2, intermediate_size=16, local_attention=2
    )
    local_layer = 2048 + 4 * 10 * 8 + 3072
    assert mlm_flops_per_sequence(three, 4, 2, vocab_size=20) == 3 * (5632 + 2 * local_layer + 2 * 448)


def test_flops_match_torch_flop_counter(rows):
    """Exact where attention is global; where SDPA/eager compute a local layer's masked-out scores,
    the counter sees exactly those on top (model FLOPs count only the window)."""
    from torch.utils.flop_counter import FlopCounterMode

    ids, m = masked(rows)
    batch, length = ids.shape
    for window, sparse in ((2 * length, True), (2 * length, False), (16, True)):
        model = tiny(impl=ImplConfig(attention="eager", sparse_head=sparse), local_attention=window)
        with FlopCounterMode(display=False) as counter:
            loss, _, _ = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
            loss.backward()
        ours = batch * mlm_flops_per_sequence(model.config, length, m.positions.numel() / batch, sparse)
        assert ours == batch * mlm_flops_per_sequence(
            ModelConfig(**{**TINY, "local_attention": window}),
            length,
            m.positions.numel() / batch,
            sparse,
            vocab_size=model.config.vocab_size,
        )  # padded: the rows computed
        skipped = batch * 3 * 4 * 64 * (length * length - attended_pairs(length, window // 2)) * 2
        # Rotary's angle table (positions x frequencies) is no model FLOP; transformers 5.17 (the GPU
        # lease's) builds it with a matmul the counter sees, 5.24 with a product it does not.
        rotary = sum(
            sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb")
        )
        assert counter.get_total_flops() - rotary == pytest.approx(ours + skipped, rel=1e-9), window


# -------------------------------------------------------------------------------- the config


def test_settings_of_the_other_arch_are_refused_by_name(tmp_path):
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    (tmp_path / "manifest.json").write_text("{}")
    data = f"data.dir={tmp_path}"
    cfg = load_config(CONFIG, [data])
    assert (cfg.model.arch, cfg.model.attention_dropout, cfg.model.layer_norm_eps, cfg.model.hidden_dropout) == (
        "modernbert",
        0.0,
        1e-5,
        None,
    )
    assert load_config("configs/tiny.yaml", [data]).model.hidden_dropout == 0.1  # BERT's defaults stay
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [data, "model.hidden_dropout=0.1", "model.local_attention=33"])
    assert "model.hidden_dropout: applies to arch bert only, not 'modernbert'" in str(err.value)
    assert "model.local_attention: must be even" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", [data, "model.mlp_dropout=0.1", "model.rope_theta=1e4"])
    assert "model.mlp_dropout: applies to arch modernbert only, not 'bert'" in str(err.value)
    assert "model.rope_theta: applies to arch modernbert only" in str(err.value)
    # continued pretraining: the folder's model type must be the arch asked for
    ids = dict(
        pad_token_id=SPECIAL.pad,
        bos_token_id=SPECIAL.cls,
        cls_token_id=SPECIAL.cls,
        eos_token_id=SPECIAL.sep,
        sep_token_id=SPECIAL.sep,
    )
    ModernBertForMaskedLM(
        ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, **ids
        )
    ).save_pretrained(tmp_path / "mb")
    with pytest.raises(ConfigError, match=r"init_from: .*mb holds a 'modernbert' model, but arch is 'bert'"):
        load_config("configs/tiny.yaml", [data, f"model.init_from={tmp_path / 'mb'}"])
    assert load_config(CONFIG, [data, f"model.init_from={tmp_path / 'mb'}"]).model.init_from


# ------------------------------------------------------------------- the trainer, end to end

STEPS = 12
COMMON = [
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "optim.warmup_steps=3",
    "optim.lr=3e-3",
    *(f"model.{k}={v}" for k, v in DROPOUTS.items()),
]


def train(data_dir, out_dir, *overrides, ranks=2, check=True):
    return launch(data_dir, out_dir, *overrides, ranks=ranks, config=CONFIG, check=check)


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in metrics(out_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """Uninterrupted 2-rank runs at ZeRO 2 and 3."""
    out = {}
    for stage in (2, 3):
        out[stage] = tmp_path_factory.mktemp(f"modernbert_zero{stage}")
        train(shards, out[stage], *COMMON, f"impl.zero_stage={stage}")
    return out


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("modernbert_hf") / "hf"
    run([PY, "-m", "pretrain.export", str(runs[3] / "checkpoints"), str(out)])
    return out


@pytest.mark.slow
def test_trains_on_two_ranks_at_zero_2_and_3(runs):
    curves = {stage: losses(d) for stage, d in runs.items()}
    for stage, curve in curves.items():
        assert sorted(curve) == list(range(1, STEPS + 1)), stage
        first, last = (curve[1] + curve[2]) / 2, (curve[STEPS - 1] + curve[STEPS]) / 2
        assert last < first - 0.3, f"ZeRO {stage}: loss did not fall ({first:.3f} -> {last:.3f})"
    for s in range(1, STEPS + 1):
        assert curves[3][s] == pytest.approx(curves[2][s], rel=2e-3, abs=2e-3), s


@pytest.mark.slow
def test_resume_is_exact(runs, shards, tmp_path):
    """Halt at N/2, resume to N: the same losses as N uninterrupted steps (fp32, dropout on, to 1e-6)."""
    half = STEPS // 2
    train(shards, tmp_path, *COMMON, "impl.zero_stage=3", f"train.halt_at_step={half}")
    assert sorted(losses(tmp_path)) == list(range(1, half + 1))
    train(shards, tmp_path, *COMMON, "impl.zero_stage=3")
    resumed, uninterrupted = losses(tmp_path), losses(runs[3])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert abs(resumed[s] - uninterrupted[s]) <= 1e-6, (s, resumed[s], uninterrupted[s])


@pytest.mark.slow
def test_export_has_the_trained_models_logits_and_fills_masks(runs, exported, shards):
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer, ModernBertForMaskedLM, pipeline

    from data_prep.common.manifest import load_manifest
    from pretrain.eval.heldout import eval_set_batches

    model = AutoModelForMaskedLM.from_pretrained(exported).eval()
    assert isinstance(model, ModernBertForMaskedLM)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    final = load_file(runs[3] / "hf_final" / "model.safetensors")  # the trainer's own end-of-run export
    assert all(torch.equal(final[k], v) for k, v in load_file(exported / "model.safetensors").items())

    # The trainer evaluated its ZeRO-3 engine at the last step (train.eval_sequences=32: the first
    # 32 sequences, 15% masks keyed by sequence id);
    # the exported model on the same sequences gives the same loss.
    manifest = load_manifest(shards)
    special = SpecialIds.from_manifest(manifest)
    mcfg = eval_masking_config()
    loss_sum, count = 0.0, 0
    for rank in range(1):
        for i, batch in enumerate(eval_set_batches(shards, manifest, "validation", rank, 1, 8, 32)):
            ids = batch["input_ids"]
            mb = mask_batch(ids, batch["word_starts"], special, mcfg, sample_ids=batch["sample_ids"], step=0)
            with torch.no_grad():
                logits = model(input_ids=mb.input_ids, attention_mask=ids != special.pad).logits
            loss_sum += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1))[mb.positions], mb.labels, reduction="sum"
                )
            )
            count += mb.positions.numel()
            if rank == 0 and i == 0:
                probe = (mb, ids != special.pad, logits.reshape(-1, logits.size(-1))[mb.positions])
    trained = [r["eval/loss"] for r in metrics(runs[3]) if "eval/loss" in r][-1]
    assert loss_sum / count == pytest.approx(trained, rel=1e-5)

    # Continued pretraining loads the folder: our sparse head gives Hugging Face's dense logits.
    ours = build_model(
        ModelConfig(arch="modernbert", init_from=str(exported)), manifest.tokenizer.vocab_size, special, ImplConfig()
    ).eval()
    mb, attn, hf_logits = probe
    with torch.no_grad():
        sparse = ours.head(ours.encode(mb.input_ids, attn).reshape(-1, 64).index_select(0, mb.positions))
    assert torch.allclose(sparse, hf_logits, atol=1e-5)

    answers = pipeline("fill-mask", model=str(exported))("the city is in the [MASK] of france.")
    assert len(answers) == 5 and all(0.0 <= a["score"] <= 1.0 for a in answers)
    tok = AutoTokenizer.from_pretrained(exported)
    enc = tok("the city is in the [MASK] of france.", return_tensors="pt")
    assert "token_type_ids" not in enc
    with torch.no_grad():
        logits = model(**enc).logits[0, enc["input_ids"][0].tolist().index(tok.mask_token_id)]
    assert answers[0]["token"] == int(logits.argmax())


@pytest.mark.slow
def test_continued_pretraining_from_a_local_modernbert_folder(runs, exported, shards, tmp_path):
    train(
        shards,
        tmp_path,
        "train.max_steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "optim.warmup_steps=0",
        "optim.lr=1e-4",
        f"model.init_from={exported}",
        "impl.zero_stage=2",
        ranks=1,
    )
    continued, fresh = losses(tmp_path), losses(runs[3])
    # starts where the exported run ended (seen: 7.1 without its dropout, against 7.65 with it),
    # well below a fresh start (about ln V = 8.3)
    assert continued[1] < fresh[1] - 0.6, (continued, fresh)
    assert continued[1] < fresh[STEPS] + 0.3, (continued, fresh)


@pytest.mark.slow
def test_bert_only_setting_refused_before_any_process_group(shards, tmp_path):
    proc = train(shards, tmp_path, "model.hidden_dropout=0.1", "model.layer_norm_eps=1e-6", ranks=1, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model.hidden_dropout: applies to arch bert only, not 'modernbert'" in proc.stderr
    assert "layer_norm_eps" not in proc.stderr  # shared by both archs
    assert "init_distributed" not in proc.stdout + proc.stderr
