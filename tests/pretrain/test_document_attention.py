"""``model.attention_scope: document``: attention that stays inside each document of a packed row, with
positions restarting per document (pretrain/model/documents.py), on both architectures and every
attention the CPU runs; the export scores a document alone as the trained model scored it.

Time: 65 s under the full suite's load (35 s of CPU): FlexAttention's compile for its CPU check, and
four short training jobs (a resume across layouts, a refused resume, a new phase)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForMaskedLM

from pretrain.config.schema import ImplConfig, ModelConfig
from pretrain.model import documents as docs
from pretrain.model.mlm import build_model
from test_faults import ok, train
from test_resume_across_layouts import SAME as NO_DROPOUT_LOGGED_EVERY_STEP
from test_resume_across_layouts import losses
from tests.pretrain.test_masking import SPECIAL

CLS, SEP, PAD = SPECIAL.cls, SPECIAL.sep, SPECIAL.pad
SEQ = 64
ARCHS = {
    "bert": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=SEQ),
    # a window narrower than the documents, so the local layers' mask is the window and the document
    "modernbert": dict(
        arch="modernbert",
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        intermediate_size=96,
        max_position_embeddings=SEQ,
        local_attention=8,
    ),
}


def model(arch: str, scope: str, attention: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(**ARCHS[arch], attention_scope=scope)
    return build_model(cfg, SPECIAL.vocab_size, SPECIAL, ImplConfig(attention=attention)).eval()


@pytest.fixture(scope="module")
def documents(wiki_articles, bert_uncased_dir) -> list[list[int]]:
    """Real text: the first 7 to 30 tokens of successive articles, documents of uneven lengths."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bert_uncased_dir / "tokenizer.json"))
    tok.no_truncation()
    encoded = tok.encode_batch([text for _, text in wiki_articles[:12]], add_special_tokens=False)
    return [enc.ids[: 7 + (i * 5) % 24] for i, enc in enumerate(encoded)]


def pack(documents: list[list[int]], seq_len: int = SEQ) -> torch.Tensor:
    """One row as data prep packs it: [CLS] d0 [SEP] d1 [SEP] ... [SEP] [PAD]..."""
    body = [t for d in documents for t in (*d, SEP)][:-1]
    row = [CLS, *body, SEP]
    assert len(row) <= seq_len
    return torch.tensor([row + [PAD] * (seq_len - len(row))])


def spans(row: torch.Tensor) -> list[range]:
    """Each document's positions in a row made by ``pack``: from after the previous [SEP] to its own."""
    seps = (row[0] == SEP).nonzero().flatten().tolist()
    return [range(0 if i == 0 else seps[i - 1] + 1, end + 1) for i, end in enumerate(seps)]


# ------------------------------------------------------------------------------ the packing rule


def test_documents_and_positions_follow_the_packing_rule():
    a, b, c, d, e, f = 1000, 1001, 1002, 1003, 1004, 1005
    # a document ending one token before the body's end leaves [SEP] [SEP] (data_prep/packing.py)
    row = torch.tensor([[CLS, a, b, SEP, c, d, e, SEP, f, SEP, SEP, PAD, PAD]])
    ids = docs.document_ids(row, SEP)
    assert ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 4]]
    # [CLS] 0, the first document's text from 1; every later document's text from 1 too
    assert docs.document_positions(ids).tolist() == [[0, 1, 2, 3, 1, 2, 3, 4, 1, 2, 1, 1, 2]]
    allowed = docs.same_document(ids)[0, 0]
    assert allowed[1].tolist() == [True] * 4 + [False] * 9  # a sees [CLS] a b [SEP]
    assert allowed[11].tolist() == [False] * 11 + [True] * 2  # padding sees only padding
    windowed = docs.same_document(ids, window=1)[0, 0]
    assert windowed[5].tolist() == [False] * 4 + [True] * 3 + [False] * 6  # d sees c d e


def test_masking_never_moves_a_boundary(documents):
    """Boundaries are read from the masked ids: a [SEP] is never masked and never drawn."""
    from pretrain.config.schema import MaskingConfig
    from pretrain.model.masking import mask_batch, mask_generator

    rows = torch.cat([pack(documents[i : i + 3]) for i in range(0, 9, 3)])
    cfg = MaskingConfig(rate=0.5)
    m = mask_batch(rows, torch.ones_like(rows, dtype=torch.bool), SPECIAL, cfg, mask_generator(1, 0, 0, 0))
    assert torch.equal(docs.document_ids(m.input_ids, SEP), docs.document_ids(rows, SEP))


# ----------------------------------------------------------------------------- the model


def hidden(net, row: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net.encode(row, row != PAD)[0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_document_attention_sees_only_its_document(documents, arch, attention):
    """Changing one document's tokens leaves every other document's outputs as they were (fp32
    round-off) with ``document``, and changes them with ``row``."""
    row = pack(documents[:4])
    changed = row.clone()
    second = spans(row)[1]
    changed[0, second.start : second.stop - 1] = torch.arange(2000, 2000 + len(second) - 1)
    others = [p for span in spans(row) if span != second for p in span]
    for scope in ("document", "row"):
        net = model(arch, scope, attention)
        before, after = hidden(net, row), hidden(net, changed)
        moved = (after[others] - before[others]).abs().max().item()
        if scope == "document":
            assert moved <= 1e-5, (scope, moved)
            assert (after[list(second)] - before[list(second)]).abs().max() > 1e-2
        else:
            assert moved > 1e-3, (scope, moved)


def test_training_with_keyed_attention_dropout_keeps_to_the_document(documents):
    """In training with dropout on the attention probabilities (BERT's 0.1), attention runs our keyed
    eager kernel; it takes the boolean document mask too, and the dropout draws do not depend on
    the other documents."""
    from pretrain.model import keyed_dropout

    row = pack(documents[:4])
    changed = row.clone()
    second = spans(row)[1]
    changed[0, second.start : second.stop - 1] = torch.arange(2000, 2000 + len(second) - 1)
    others = [p for span in spans(row) if span != second for p in span]
    torch.manual_seed(0)
    cfg = ModelConfig(**ARCHS["bert"], attention_scope="document", attention_dropout=0.1, hidden_dropout=0.1)
    net = build_model(cfg, SPECIAL.vocab_size, SPECIAL, ImplConfig(attention="sdpa")).train()
    keyed_dropout.install(net.hf_model, seed=3).set(torch.tensor([17]), step=2)
    assert net.config._attn_implementation == keyed_dropout.KEYED_ATTENTION
    with torch.no_grad():
        before, after = net.encode(row, row != PAD)[0], net.encode(changed, changed != PAD)[0]
    assert (after[others] - before[others]).abs().max() <= 1e-5
    assert (after[list(second)] - before[list(second)]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_a_documents_outputs_do_not_depend_on_where_it_lies_in_the_row(documents, arch):
    """Positions restart at each document: the same document after a short or a long neighbour (or
    two) has the same outputs; BERT's learned absolute positions would move them otherwise."""
    net = model(arch, "document")
    placed = [documents[:1] + [documents[5]], documents[1:3] + [documents[5]], [documents[4], documents[5]]]
    outputs = []
    for order in placed:
        row = pack(order)
        outputs.append(hidden(net, row)[list(spans(row)[-1])])
    assert len({spans(pack(order))[-1].start for order in placed}) == 3  # three different offsets
    for other in outputs[1:]:
        assert torch.allclose(other, outputs[0], atol=1e-5)


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_the_kernels_agree_in_document_scope(documents, arch):
    """SDPA (boolean masks) and Hugging Face's eager attention (additive masks) compute the same."""
    row = torch.cat([pack(documents[:4]), pack(documents[4:7])])
    with torch.no_grad():
        sdpa = model(arch, "document", "sdpa").encode(row, row != PAD)
        eager = model(arch, "document", "eager").encode(row, row != PAD)
    assert torch.allclose(sdpa, eager, atol=1e-5)


def test_auto_times_the_kernels_under_document_masks(tmp_path, monkeypatch):
    """``impl.attention: auto`` in document scope times every candidate under a block-diagonal mask
    (with ModernBERT's window on its local layers), cached apart from the row-scope timings."""
    from pretrain.runtime import attention

    asked, time_candidates = [], attention.time_candidates
    monkeypatch.setattr(attention, "time_candidates", lambda *a, **k: asked.append(k) or {"sdpa_math": 1e-3})
    monkeypatch.setattr(attention, "cache_path", lambda: tmp_path / "attention.json")
    for scope in ("row", "document"):
        attention.resolve(model("modernbert", scope), "auto", torch.device("cpu"), torch.float32, 8, SEQ)
    assert [k["documents"] for k in asked] == [False, True] and all(k["window"] == 8 for k in asked)
    keys = sorted(json.loads((tmp_path / "attention.json").read_text()))
    assert len(keys) == 2 and keys[1] == keys[0] + "|documents"

    inside = attention.document_mask(SEQ, 3, torch.device("cpu"))
    assert inside.shape == (3, 1, SEQ, SEQ) and not inside[0, 0, 0, -1] and inside[0, 0, 0, 0]
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    timed = time_candidates(
        torch.device("cpu"), torch.float32, (3, 4, SEQ, 16), ("sdpa_math",), 1, 8, 2 / 3, documents=True
    )
    assert timed["sdpa_math"] > 0
    window = attention.window_mask(SEQ, 8, 3, torch.device("cpu"))
    assert all(m is not None for m in seen)
    assert any(torch.equal(m, inside) for m in seen) and any(torch.equal(m, inside & window) for m in seen)


def test_the_gpu_runs_document_scope_through_flexattention(monkeypatch):
    """Where flash-attn would run full rows, document scope takes FlexAttention (its block mask built on
    the device); rows keep flash-attn."""
    from pretrain.model import mlm

    monkeypatch.setattr(mlm, "_attention_for_rows", lambda impl: "flash_attention_2")
    assert mlm.attention_implementation(ImplConfig(), "row") == "flash_attention_2"
    assert mlm.attention_implementation(ImplConfig(), "document") == "flex_attention"
    monkeypatch.setattr(mlm, "_attention_for_rows", lambda impl: "sdpa")
    assert mlm.attention_implementation(ImplConfig(), "document") == "sdpa"


@pytest.mark.slow  # torch.compile's FlexAttention kernel, and inductor's compile workers
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_flexattentions_block_mask_computes_what_sdpa_does(documents, arch):
    """The GPU's document kernel, forward only (FlexAttention has no CPU backward): the same outputs
    as SDPA's boolean mask, ModernBERT's windowed local layers included."""
    rows = torch.cat([pack(documents[:4]), pack(documents[4:7])])
    net = model(arch, "document")
    with torch.no_grad():
        sdpa = net.encode(rows, rows != PAD)
        net.config._attn_implementation = "flex_attention"
        flex = net.encode(rows, rows != PAD)
    assert torch.allclose(flex, sdpa, atol=1e-4), (flex - sdpa).abs().max()


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_the_export_scores_a_document_alone_as_training_scored_it(documents, arch, tmp_path):
    """The exported Hugging Face model, given ``[CLS] document [SEP]``, has the trained model's logits
    at that document's positions in a packed row (where it came first): document scope trained it on
    exactly that input, whatever followed it in the row."""
    net = model(arch, "document")
    row = pack(documents[:4])
    first = spans(row)[0]
    with torch.no_grad():
        in_row = net.head(net.encode(row, row != PAD))[0, : first.stop]
    net.hf_model.save_pretrained(tmp_path)
    exported = AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    alone = row[:, : first.stop]
    with torch.no_grad():
        logits = exported(input_ids=alone).logits[0]
    assert torch.allclose(logits, in_row, atol=1e-4), (logits - in_row).abs().max()


# ---------------------------------------------------------------------------- the trainer
# A run in document scope through the trainer: resumed at another world size and ZeRO stage it logs
# the uninterrupted run's losses, the scope is refused when changed on resume, and the export records it.
DOC_RUN = [
    *NO_DROPOUT_LOGGED_EVERY_STEP,
    "model.attention_scope=document",
    "train.max_steps=6",
    "train.eval_every=0",
    "train.eval_sequences=32",
]


@pytest.fixture(scope="module")
def document_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("document_straight")
    proc = ok(train(shards, out, *DOC_RUN, "impl.zero_stage=2", ranks=2))
    return out, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_document_run_resumed_at_another_layout_logs_the_uninterrupted_losses(document_run, shards, tmp_path):
    straight, output = document_run
    assert "within each document" in output and "(attention within each document)" in output  # start, eval
    ok(train(shards, tmp_path, *DOC_RUN, "impl.zero_stage=2", "train.halt_at_step=3", ranks=2))
    ok(train(shards, tmp_path, *DOC_RUN, "impl.zero_stage=0", "impl.micro_batch_size=4", ranks=1))
    want, got = losses(straight), losses(tmp_path)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    config = json.loads((tmp_path / "hf_final" / "config.json").read_text())
    assert config["pretrain_attention_scope"] == "document"


@pytest.mark.slow
def test_the_scope_is_refused_when_changed_on_resume_and_a_new_phase_may_change_it(shards, tmp_path):
    ok(train(shards, tmp_path, *DOC_RUN, "train.max_steps=2", "impl.zero_stage=0"))
    proc = train(shards, tmp_path, *DOC_RUN, "train.max_steps=4", "model.attention_scope=row", "impl.zero_stage=0")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model.attention_scope: the checkpoint step00000002 was trained with 'document', now 'row'" in proc.stderr
    # a new phase from that checkpoint is a new run: it may change the scope
    phase = ok(
        train(
            shards,
            tmp_path / "phase2",
            *DOC_RUN,
            "train.max_steps=2",
            "model.attention_scope=row",
            "impl.zero_stage=0",
            f"train.init_from_checkpoint={tmp_path / 'checkpoints'}",
        )
    )
    assert "within each row" in phase.stdout + phase.stderr


@pytest.mark.parametrize("scope", ["row", "document"])
def test_a_padded_micro_batch_gets_a_padding_mask_only_in_row_scope(scope):
    """Issue 84, item 0b: in document scope padding is a group of its own (the model ignores the
    padding mask), so a micro-batch holding a padded row goes to the engine without one and runs the
    compiled graph (``engine.eager_forward`` runs a masked micro-batch eagerly); the tokens it counts
    leave the padding out in both scopes."""
    from types import SimpleNamespace

    from pretrain.config.objective import MaskingConfig
    from pretrain.step import mask_micro_batches

    ids = torch.tensor([[CLS, 7, 8, SEP, 9, 10, SEP, PAD], [CLS, 11, 12, 13, 14, 15, 16, SEP]])
    batch = {
        "input_ids": ids,
        "word_starts": torch.ones_like(ids, dtype=torch.bool),
        "sample_ids": torch.tensor([5, 6]),
        "has_padding": True,
    }
    full = {**batch, "input_ids": ids[1:], "word_starts": batch["word_starts"][1:], "sample_ids": torch.tensor([7])}
    full["has_padding"] = False
    parts = SimpleNamespace(
        device=torch.device("cpu"),
        special=SPECIAL,
        masking=MaskingConfig(),
        max_steps=10,
        model=SimpleNamespace(attention_scope=scope),
    )
    (padded, attention_mask, tokens, _), (_, no_mask, full_tokens, _) = mask_micro_batches(parts, 0, [batch, full])[0]
    assert int(tokens) == 15 and int(full_tokens) == 8
    assert no_mask is None
    if scope == "document":
        assert attention_mask is None
    else:
        assert attention_mask.tolist() == (ids != PAD).tolist()
