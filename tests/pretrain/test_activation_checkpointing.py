"""``impl.activation_checkpointing``: the encoder layers run again in the backward instead of keeping
their activations, and nothing a run computes changes: the same losses and gradients to the bit,
keyed dropout included, in a model and in a trainer run at ZeRO 3 on two ranks."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.config.schema import ImplConfig, ModelConfig
from pretrain.model import keyed_dropout
from pretrain.model.masking import SpecialIds
from pretrain.model.mlm import build_model
from test_faults import ok, train

SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=200)
DROPOUTS = {
    "bert": {"hidden_dropout": 0.1, "attention_dropout": 0.0},
    "modernbert": {"embedding_dropout": 0.1, "mlp_dropout": 0.1, "attention_dropout": 0.0},
}


def forward_backward(arch: str, checkpointed: bool, scope: str = "row"):
    """A 4-layer model's loss, its gradients and the bytes autograd kept for the backward."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch,
        hidden_size=32,
        num_layers=4,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        attention_scope=scope,
        **DROPOUTS[arch],
    )
    impl = ImplConfig(attention="sdpa_math", precision="fp32", activation_checkpointing=checkpointed)
    model = build_model(cfg, SPECIAL.vocab_size, SPECIAL, impl).train()
    key = keyed_dropout.install(model.hf_model, seed=7)
    ids = torch.randint(5, SPECIAL.vocab_size, (8, 48), generator=torch.Generator().manual_seed(1))
    ids[:, 20] = SPECIAL.sep  # two documents a row
    positions = torch.arange(0, ids.numel(), 5)
    key.set(torch.arange(8) * 3, step=2)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, _ = model(ids, None, positions, ids.reshape(-1)[positions])
    with model.recompute_context():
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved)


@pytest.mark.parametrize("scope", ["row", "document"])
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_checkpointed_layers_give_the_same_loss_and_gradients_keeping_less(arch, scope):
    loss, grads, kept = forward_backward(arch, checkpointed=False, scope=scope)
    loss_c, grads_c, kept_c = forward_backward(arch, checkpointed=True, scope=scope)
    assert torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys()
    different = [name for name in grads if not torch.equal(grads[name], grads_c[name])]
    assert different == [], different
    # the layers' activations (every layer's norms, attention and FFN inputs) are no longer kept:
    # what autograd holds is the embeddings' and the head's, and each layer's input (held by checkpoint)
    assert kept_c < kept / 3, (kept_c, kept)


@pytest.mark.slow
def test_a_checkpointed_run_logs_the_losses_of_a_plain_one(shards, tmp_path):
    """Two ranks at ZeRO 3 (the weights gathered again for the recompute), hidden dropout 0.1: every
    step's loss and gradient norm as without checkpointing, to the bit."""
    common = [
        "impl.zero_stage=3",
        "model.hidden_dropout=0.1",
        "train.max_steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
    ]
    logged = {}
    for checkpointed in (False, True):
        out = tmp_path / f"checkpointed-{checkpointed}"
        ok(train(shards, out, *common, f"impl.activation_checkpointing={str(checkpointed).lower()}", ranks=2))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        logged[checkpointed] = [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]
    assert len(logged[False]) == 4
    assert logged[True] == logged[False]
