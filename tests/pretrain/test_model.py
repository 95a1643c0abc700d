"""The model with a sparse MLM head, its Hugging Face export, and the FLOP counter."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM

from pretrain.config.schema import ImplConfig, ModelConfig
from pretrain.model.flops import measure_matmul_peak_tflops, mlm_flops_per_sequence
from pretrain.model.masking import IGNORE_INDEX
from pretrain.model.mlm import MLMModel, build_model
from tests.model_checks import assert_sparse_head_equals_dense, dense_labels, masked, sparse_mean_loss
from tests.pretrain.test_masking import SPECIAL, pack_rows

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=128)
VOCAB = SPECIAL.vocab_size


@pytest.fixture(scope="module")
def rows(wiki_articles, bert_uncased_dir):
    ids, starts = pack_rows(wiki_articles[:200], bert_uncased_dir, min_tokens=4000)
    assert ids[-1, -1] == SPECIAL.pad
    return ids[-8:], starts[-8:]  # 8 rows, the last one padded


def tiny(seed=0, **impl) -> MLMModel:
    torch.manual_seed(seed)
    return build_model(TINY, VOCAB, SPECIAL, ImplConfig(**impl))


def test_sparse_head_equals_dense_head_and_hf_loss(rows):
    ids, m = masked(rows)
    sparse = tiny(sparse_head=True)
    assert_sparse_head_equals_dense(sparse, tiny(sparse_head=False), ids, m, SPECIAL.pad)
    with torch.no_grad():  # Hugging Face's softmax includes the padding rows: pushed out of it
        sparse.hf_model.cls.predictions.bias[VOCAB:] = -1e4
    mine = sparse_mean_loss(sparse, ids, m, SPECIAL.pad)
    with torch.no_grad():  # Hugging Face's own (dense, mean) loss
        hf = sparse.hf_model(input_ids=m.input_ids, attention_mask=ids != SPECIAL.pad, labels=dense_labels(ids, m)).loss
    assert torch.allclose(mine, hf, rtol=1e-5)
    assert 0.8 * math.log(VOCAB) < float(hf) < 1.2 * math.log(VOCAB)  # untrained: about ln(V)


def test_unused_fixed_count_slots_do_not_count(rows):
    ids, m = masked(rows, fixed_count=True)
    model = tiny().eval()
    used = m.labels != IGNORE_INDEX
    assert not used.all()
    attn = ids != SPECIAL.pad
    with torch.no_grad():
        loss, _, count = model(m.input_ids, attn, m.positions, m.labels)
        only_used, _, count_used = model(m.input_ids, attn, m.positions[used], m.labels[used])
    assert int(count) == int(count_used) == int(m.num_masked) == int(used.sum())
    assert torch.allclose(loss, only_used, rtol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_that_does_not_log_runs_no_argmax_and_has_the_same_loss(rows, fused):
    """The training accuracy's argmax over the vocabulary is only computed on logged steps (the fused
    loss takes it from the max that shifts its softmax: aten::max with indices)."""
    ids, m = masked(rows)
    model, attn = tiny(fused_mlm_loss=fused).eval(), ids != SPECIAL.pad
    runs = {}
    for want in (True, False):
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runs[want] = model(m.input_ids, attn, m.positions, m.labels, want_correct=want)
        runs[want] += (sum(e.count for e in prof.key_averages() if e.key in ("aten::argmax", "aten::max")),)
    (loss, correct, count, argmaxes), (loss_off, correct_off, count_off, argmaxes_off) = runs[True], runs[False]
    assert argmaxes == 1 and argmaxes_off == 0
    assert torch.equal(loss, loss_off) and int(count) == int(count_off) == int(m.num_masked)
    assert int(correct_off) == 0 and 0 <= int(correct) <= int(count)


def test_padding_is_masked_out_and_sdpa_equals_eager(rows):
    ids, m = masked(rows)
    last_ids = m.input_ids[-1:]
    real = int((last_ids != SPECIAL.pad).sum())
    assert real < last_ids.shape[1]
    in_last = m.positions >= (len(ids) - 1) * ids.shape[1]
    pos, labels = m.positions[in_last] - (len(ids) - 1) * ids.shape[1], m.labels[in_last]
    model = tiny(attention="sdpa").eval()
    eager = tiny(attention="eager").eval()
    assert eager.hf_model.config._attn_implementation == "eager"
    with torch.no_grad():
        padded, _, _ = model(last_ids, last_ids != SPECIAL.pad, pos, labels)
        trimmed, _, _ = model(last_ids[:, :real], None, pos, labels)  # no padding at all
        full_sdpa, _, _ = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
        full_eager, _, _ = eager(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    assert torch.allclose(padded, trimmed, rtol=1e-5)
    assert torch.allclose(full_sdpa, full_eager, rtol=1e-5)


def test_tied_weights_survive_training_and_export(rows, tmp_path):
    ids, m = masked(rows)
    model = tiny()
    hf = model.hf_model
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):  # overfit one batch: the loss must fall
        loss, _, count = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
        (loss / count).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach() / count))
    assert losses[-1] < losses[0] - 1.0, losses
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    hf.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert isinstance(loaded, BertForMaskedLM)
    assert loaded.cls.predictions.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
    hf.eval()
    loaded.eval()
    with torch.no_grad():
        a = hf(input_ids=m.input_ids, attention_mask=ids != SPECIAL.pad).logits
        b = loaded(input_ids=m.input_ids, attention_mask=ids != SPECIAL.pad).logits
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_padded_vocabulary_is_never_predicted(rows, fused):
    """model.vocab_multiple (issue 49, item 4): 30,522 rows become 30,528; a large bias on the six
    extra rows changes neither the loss nor the predictions."""
    ids, m = masked(rows)
    model = tiny(fused_mlm_loss=fused).eval()
    assert model.config.vocab_size == 30528 and model.vocab_size == VOCAB == 30522
    with torch.no_grad():
        before = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels, per_token=True)
        model.hf_model.cls.predictions.bias[VOCAB:] = 1e4
        after = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels, per_token=True)
        summed = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    assert torch.allclose(after[0], before[0]) and torch.equal(after[1], before[1])
    assert torch.allclose(summed[0], after[0].sum(), rtol=1e-5) and int(summed[1]) == int(after[1].sum())
    unpadded = dataclasses.replace(TINY, vocab_multiple=1)
    assert build_model(unpadded, VOCAB, SPECIAL, ImplConfig()).config.vocab_size == VOCAB


def test_init_from_pretrained_encoder(rows, bert_uncased_dir, tmp_path):
    from safetensors.torch import load_file

    cfg = ModelConfig(init_from=str(bert_uncased_dir))
    model = build_model(cfg, VOCAB, SPECIAL, ImplConfig(), seq_len=128)
    hf = model.hf_model
    assert (hf.config.num_hidden_layers, hf.config.hidden_size) == (6, 384)  # its architecture wins
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    encoder = hf.bert.state_dict()
    stored = {
        k: v
        for k, v in load_file(bert_uncased_dir / "model.safetensors").items()
        if not k.startswith("pooler.") and not k.endswith("position_ids")
    }
    assert len(stored) > 90
    assert hf.config.vocab_size == 30528 and model.vocab_size == VOCAB  # padded to a multiple of 64
    for name, tensor in stored.items():
        assert torch.equal(encoder[name][: len(tensor)], tensor), name  # the padding rows follow
    ids, m = masked(rows)
    with torch.no_grad():
        loss, correct, count = model.eval()(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    assert math.isfinite(float(loss)) and int(count) == m.positions.numel()

    with pytest.raises(ValueError, match=r"vocab_size 30522, but the data's manifest says 32000"):
        build_model(cfg, 32000, SPECIAL, ImplConfig())
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        build_model(cfg, VOCAB, SPECIAL, ImplConfig(), seq_len=1024)
    with pytest.raises(ValueError, match="config.json unreadable"):
        build_model(ModelConfig(init_from=str(tmp_path)), VOCAB, SPECIAL, ImplConfig())


def test_flops_by_hand():
    small = ModelConfig(hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16)
    # L=4: projections 4*2*4*64 = 2048, scores + weighted sum 2 * 2*16*8 = 512, FFN 2 * 2*4*8*16 = 2048;
    # head per predicted token 2*64 + 2*8*20 = 448; training = 3 x forward
    assert mlm_flops_per_sequence(small, 4, 2, sparse_head=True, vocab_size=20) == 3 * (4608 + 2 * 448)
    assert mlm_flops_per_sequence(small, 4, 2, sparse_head=False, vocab_size=20) == 3 * (4608 + 4 * 448)
    with pytest.raises(ValueError, match="vocab_size"):
        mlm_flops_per_sequence(small, 4, 2)


def test_flops_match_torch_flop_counter(rows):
    from torch.utils.flop_counter import FlopCounterMode

    ids, m = masked(rows)
    for sparse in (True, False):
        model = tiny(attention="eager", sparse_head=sparse)
        with FlopCounterMode(display=False) as counter:
            loss, _, _ = model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
            loss.backward()
        predicted = m.positions.numel() / len(ids)
        ours = len(ids) * mlm_flops_per_sequence(model.config, ids.shape[1], predicted, sparse)
        assert counter.get_total_flops() == pytest.approx(ours, rel=1e-9)


def test_flops_near_six_params_tokens_for_bert_base():
    cfg = BertConfig()  # bert-base: 12 x 768, vocab 30522
    with torch.device("meta"):
        params = sum(p.numel() for p in BertForMaskedLM(cfg).parameters())
    dense = mlm_flops_per_sequence(cfg, 128, 128 * 0.15, sparse_head=False)
    # the decoder's H x V matmul stands for the embedding parameters; attention adds L / 6H ~ 3%
    assert 1.0 < dense / (6 * params * 128) < 1.06
    sparse = mlm_flops_per_sequence(cfg, 128, 128 * 0.15, sparse_head=True)
    saved = 3 * 128 * 0.85 * (2 * 768**2 + 2 * 768 * 30522)
    assert dense - sparse == pytest.approx(saved) and sparse / dense < 0.85


def test_measured_matmul_peak_is_the_timed_matmuls_flops_per_second_of_its_clock(monkeypatch):
    """The peak is 2 n^3 FLOPs per matmul over the CPU seconds per thread they took: exact under a
    clock that each matmul moves by 10 ms; and on this CPU's real clock within 5x of the same
    matmuls timed here, independently (5x: another test process may load the cores between the two)."""
    import time

    import pretrain.model.flops as flops

    clock = [0.0]
    real_matmul = torch.matmul

    def matmul_taking_10_ms(*args, **kwargs):
        clock[0] += 0.01
        return real_matmul(*args, **kwargs)

    monkeypatch.setattr(flops.torch, "matmul", matmul_taking_10_ms)
    monkeypatch.setattr(time, "process_time", lambda: clock[0])
    threads = torch.get_num_threads()
    peak = measure_matmul_peak_tflops("cpu", torch.float32, seconds=0.2, size=64)
    assert peak == pytest.approx(2 * 64**3 * threads / 0.01 / 1e12, rel=1e-9)
    monkeypatch.undo()

    torch.manual_seed(0)
    measured = measure_matmul_peak_tflops("cpu", torch.float32, seconds=0.2, size=256)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start = time.process_time()
    for _ in range(40):
        torch.matmul(a, b)
    independent = 2 * 256**3 * 40 / ((time.process_time() - start) / threads) / 1e12
    assert independent / 5 < measured < independent * 5, (measured, independent)


def test_compiled_model_keeps_one_graph_for_padded_and_eval_batches(rows):
    """A compiled run traces full rows in training mode once; the padded batch and evaluation run
    eagerly (``engine.eager_forward``) instead of compiling more graphs, with the same losses."""
    from torch._dynamo.utils import counters

    from pretrain.runtime.engine import eager_forward

    ids, m = masked(rows)
    full = slice(0, len(ids) - 1)  # rows packed full: no mask
    n = (len(ids) - 1) * ids.shape[1]
    full_pos, full_labels = m.positions[m.positions < n], m.labels[m.positions < n]
    torch.manual_seed(0)  # no dropout: equal losses to compare
    model = build_model(
        dataclasses.replace(TINY, hidden_dropout=0.0, attention_dropout=0.0), VOCAB, SPECIAL, ImplConfig()
    )
    model.fixed_predictions = True  # the same positions each time: the loss is traced too
    reference = [
        model(m.input_ids[full], None, full_pos, full_labels)[0].detach(),
        model(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)[0].detach(),
    ]

    class CompiledEngine(torch.nn.Module):  # what DeepSpeed's engine.compile() leaves
        is_compiled = True

        def __init__(self, module):
            super().__init__()
            self.module = module
            self.module.compile(backend="aot_eager")  # graph capture without inductor's codegen

        def forward(self, *args):
            return self.module(*args)

    torch._dynamo.reset()
    counters.clear()
    engine = CompiledEngine(model)
    for _ in range(2):
        loss, _, _ = engine(m.input_ids[full], None, full_pos, full_labels)
        loss.backward()
    assert counters["stats"]["unique_graphs"] == 1
    with eager_forward(engine, eager=True):  # the padded batch
        padded, _, _ = engine(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    padded.backward()
    engine.eval()
    with torch.no_grad(), eager_forward(engine, eager=True):  # evaluation
        engine(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.allclose(loss.detach(), reference[0], rtol=1e-5)
    assert torch.allclose(padded.detach(), reference[1], rtol=1e-5)
    with eager_forward(engine, eager=False):  # without the stance: a second graph
        engine(m.input_ids, ids != SPECIAL.pad, m.positions, m.labels)
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_the_zero0_grad_norm_is_the_global_l2_norm():
    from types import SimpleNamespace

    from pretrain.runtime.engine import local_grad_norm

    module = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 1, bias=False))
    module(torch.randn(4, 30)).pow(2).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in module.parameters()]).norm().item()
    assert local_grad_norm(SimpleNamespace(module=module)) == pytest.approx(expected, rel=1e-6)


def test_lamb_is_the_papers_update_unclamped_and_bias_corrected():
    """Our LAMB, the one optimiser for LAMB on every device (issue 33): three steps against the update
    written out from You et al. (2019) in float64, on a tensor whose trust ratio is far above 10
    (DeepSpeed's FusedLamb clamps it to [0.01, 10] and leaves out the bias correction)."""
    from pretrain.model.optim import Lamb

    torch.manual_seed(0)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.999), 1e-6, 0.01
    w0 = torch.randn(8, 16) * 100  # ||w|| / ||update|| ~ 100 / 1
    grads = [torch.randn(8, 16) for _ in range(3)]
    param = torch.nn.Parameter(w0.clone())
    opt = Lamb([{"params": [param], "weight_decay": wd}], lr=lr, betas=(b1, b2), eps=eps)
    w, m, v, ratios = w0.double(), torch.zeros(8, 16, dtype=torch.float64), torch.zeros(8, 16, dtype=torch.float64), []
    for t, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        g = g.double()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * w
        ratios.append((w.norm() / update.norm()).item())
        w = w - lr * ratios[-1] * update
        assert torch.allclose(param.detach().double(), w, rtol=1e-5, atol=1e-5), t
    assert min(ratios) > 10
