"""Results that do not depend on the layout (issue 18, items 1 and 2): dropout keyed by each
sequence's identity, and an evaluation set that is a fixed count of held-out sequences, whose
eval/loss is bit-identical at any world size and micro-batch given identical weights.

Time: about a minute under the whole suite: torch.compile traces the keyed dropout sites (dynamo,
several graphs), and the held-out evaluation runs at five layouts, two of them on 2 spawned ranks."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from data_prep.common.manifest import load_manifest
from pretrain.config.schema import ImplConfig, ModelConfig, load_config
from pretrain.eval.heldout import eval_set_batches, evaluate
from pretrain.model import keyed_dropout
from pretrain.model.masking import SpecialIds
from pretrain.model.mlm import build_model

SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=200)


def tiny(arch: str, **dropouts):
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        **dropouts,
    )
    return build_model(cfg, SPECIAL.vocab_size, SPECIAL, ImplConfig(attention="sdpa", precision="fp32"))


@pytest.mark.parametrize(
    "arch,dropouts",
    [
        ("bert", {"hidden_dropout": 0.1, "attention_dropout": 0.1}),
        ("modernbert", {"embedding_dropout": 0.1, "mlp_dropout": 0.1, "attention_dropout": 0.1}),
    ],
)
def test_dropout_of_a_row_is_the_same_in_any_batch(arch, dropouts):
    model = tiny(arch, **dropouts).eval()
    ids = torch.randint(5, SPECIAL.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids, dtype=torch.bool)
    attention[3, 12:] = False  # one padded row
    before = model.encode(ids, attention)
    key = keyed_dropout.install(model.hf_model, seed=42)
    sites = [m for m in model.modules() if isinstance(m, keyed_dropout.KeyedDropout)]
    assert len(sites) >= 7 and not any(m.training for m in model.modules())  # eval mode kept
    assert model.hf_model.config._attn_implementation == keyed_dropout.KEYED_ATTENTION
    assert torch.equal(model.encode(ids, attention), before)  # evaluation: no dropout, SDPA's numbers

    model.train()
    sample_ids = torch.tensor([70, 71, 72, 73])
    key.set(sample_ids, step=5)
    whole = model.encode(ids, attention)
    key.set(sample_ids[[3, 0]], step=5)  # the same rows, another batch and order
    part = model.encode(ids[[3, 0]], attention[[3, 0]])
    assert torch.equal(part, whole[[3, 0]])
    assert (whole - before).abs().max() > 0.1  # dropout did act
    key.set(sample_ids, step=6)
    assert (model.encode(ids, attention) - whole).abs().max() > 0.1  # a new mask every step
    key.set(sample_ids + 100, step=5)
    assert (model.encode(ids, attention) - whole).abs().max() > 0.1  # and for every sequence


@pytest.mark.parametrize(
    "arch,others",
    [
        ("bert", {"hidden_dropout": 0.0}),
        ("modernbert", {"mlp_dropout": 0.0, "embedding_dropout": 0.0, "local_attention": 8}),
    ],
)
def test_keyed_eager_attention_computes_what_sdpa_does(arch, others):
    """With (almost) nothing dropped, the eager path that training takes for attention-probability
    dropout gives SDPA's numbers: padding and ModernBERT's sliding window masked alike."""
    model = tiny(arch, attention_dropout=1e-9, **others)
    ids = torch.randint(5, SPECIAL.vocab_size, (3, 32), generator=torch.Generator().manual_seed(2))
    attention = torch.ones_like(ids, dtype=torch.bool)
    attention[2, 20:] = False
    sdpa = model.eval().encode(ids, attention)
    keyed_dropout.install(model.hf_model, seed=1).set(torch.arange(3), step=0)
    eager = model.train().encode(ids, attention)
    assert torch.allclose(eager[attention], sdpa[attention], atol=1e-5)


def test_keyed_dropout_keeps_one_minus_p_and_rescales():
    key = keyed_dropout.DropoutKey(seed=3)
    drop = keyed_dropout.KeyedDropout(0.25, "probe", key).train()
    key.set(torch.arange(64), step=0)
    out = drop(torch.ones(64, 32, 32))
    kept = (out > 0).double().mean().item()
    # 65,536 Bernoulli(0.75) draws: standard error 0.0017, so 0.01 is ~6 sigma
    assert abs(kept - 0.75) < 0.01
    assert torch.allclose(out[out > 0], torch.tensor(1 / 0.75))  # 0.25 is exact in 16 bits
    with pytest.raises(RuntimeError, match="sample ids were not set"):
        drop(torch.ones(3, 4))  # 3 rows but 64 ids set


@pytest.mark.parametrize(
    "arch,dropouts",
    [
        ("bert", {"hidden_dropout": 0.1, "attention_dropout": 0.1}),
        ("modernbert", {"embedding_dropout": 0.1, "mlp_dropout": 0.1, "attention_dropout": 0.0}),
    ],
)
def test_keyed_dropout_traces_once_without_graph_breaks(arch, dropouts):
    """Under torch.compile the dropout sites are part of the one graph (fused with what surrounds
    them), and a new step or batch of sample ids does not trace it again (issue 49, item 1)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny(arch, **dropouts).train()
    key = keyed_dropout.install(model.hf_model, seed=1)
    model.fixed_predictions = True  # the same positions every step: the loss is in the graph too
    compiled = torch.compile(model, backend="eager")  # dynamo's tracing alone: no inductor build
    ids = torch.randint(5, SPECIAL.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(0, 64, 5)
    losses = []
    for step in range(3):
        key.set(torch.arange(4) + 10 * step, step)
        loss = compiled(ids, None, positions, ids.reshape(-1)[positions])[0]
        loss.backward()
        losses.append(loss.item())
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert len(set(losses)) == 3  # the masks did change per step


@pytest.mark.parametrize("per_element", [False, True])
def test_keyed_dropouts_units_are_those_runs_before_2026_11_28_dropped(per_element):
    """The masks' bits are part of a run's results: a run resumed across a change of how they are
    computed must drop the same units. Pinned to what the code before the key's per-row and
    per-position tables (2026-11-28) dropped for one site, three sample ids and one step."""
    import zlib

    key = keyed_dropout.DropoutKey(seed=42, column_count=4096, per_element=per_element)
    drop = keyed_dropout.KeyedDropout(0.1, "bert.encoder.layer.3.output.dropout", key).train()
    key.set(torch.tensor([5, 123456789, 2**40 + 7]), step=1000)
    kept = drop(torch.ones(3, 16, 33)) != 0  # odd rows: the last pair's high half unused
    assert (int(kept.sum()), zlib.crc32(kept.numpy().tobytes())) == (1407, 1744775608)


@pytest.mark.slow
@pytest.mark.parametrize("per_element", [False, True])
def test_compiled_keyed_dropout_drops_the_same_units_as_eager(per_element):
    """Inductor's fused kernel computes the same int64 hash bits as the eager ops: a run resumed with
    compile where it ran eager (impl.compile: auto) drops the same units, either impl.dropout_hash."""
    torch._dynamo.reset()
    key = keyed_dropout.DropoutKey(seed=3, column_count=64, per_element=per_element)  # 8 x 16 x 33: 264 a row
    drop = keyed_dropout.KeyedDropout(0.1, "probe", key).train()
    compiled = torch.compile(drop)
    x = torch.randn(8, 16, 33)  # odd row length: the last half-hash split
    for step in range(2):
        key.set(torch.arange(8) * 7 + step, step)
        eager, fused = drop(x), compiled(x)
        assert torch.equal(eager, fused)
        assert abs((eager == 0).double().mean().item() - 0.1) < 0.02


def _saved_for_backward(forward, key) -> tuple[int, list]:
    """Bytes autograd keeps for the backward of ``forward()`` (compiled regions included), the key's
    own tables aside (made once, shared by every site and step), and the shapes and dtypes of the
    bool tensors among them."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    tables = {t.untyped_storage().data_ptr() for t in (key.columns, *key.bounds.values()) if t is not None}
    kept = [t for t in saved if t.untyped_storage().data_ptr() not in tables]
    return sum(t.numel() * t.element_size() for t in kept), [
        (tuple(t.shape), t.dtype) for t in saved if t.dtype == torch.bool
    ]


@pytest.mark.parametrize("per_element", [False, True])
@pytest.mark.parametrize("backend", [None, pytest.param("inductor", marks=pytest.mark.slow)])
def test_keyed_dropout_keeps_only_its_keys_for_the_backward(backend, per_element):
    """Issue 60, item 3: a dropout site's backward recomputes its mask from the [B] row keys; before,
    each site kept a bool mask of its input's size (and, compiled, the partitioner saved it too, since
    the backward's mask and the forward's were one expression). The gradients are those of
    ``where(keep, x * scale, 0)`` through autograd, bit for bit."""
    torch._dynamo.reset()
    ids = torch.randint(5, SPECIAL.vocab_size, (16, 64), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(0, 16 * 64, 7)

    def saved(dropout: float) -> int:
        model = tiny("bert", hidden_dropout=dropout, attention_dropout=0.0).train()
        key = keyed_dropout.install(model.hf_model, seed=1, per_element=per_element)
        model.fixed_predictions = True
        forward = torch.compile(model, backend=backend) if backend else model
        key.set(torch.arange(16), step=1)
        total, bools = _saved_for_backward(lambda: forward(ids, None, positions, ids.reshape(-1)[positions])[0], key)
        assert bools == [], bools
        return total

    # 5 sites of 16 x 64 x 32 would keep 163,840 bytes of masks; the keys are 16 int64 per site
    assert saved(0.1) - saved(0.0) <= 5 * 16 * 8, (saved(0.1), saved(0.0))

    key = keyed_dropout.DropoutKey(seed=3, per_element=True)  # its tables, which keep_mask takes
    drop = keyed_dropout.KeyedDropout(0.1, "probe", key).train()
    key.set(torch.arange(8) * 7, step=2)
    x = torch.randn(8, 16, 33, requires_grad=True)
    upstream = torch.randn(8, 16, 33)
    (ours,) = torch.autograd.grad(drop(x), x, upstream)
    half = (x.shape[1:].numel() + 1) // 2
    keep = keyed_dropout.keep_mask(key.site_keys[drop.index], key.columns_for(half), key.bounds[drop.dropped], x.shape)
    scale = 65536.0 / (65536 - drop.dropped)
    (theirs,) = torch.autograd.grad(torch.where(keep, x * scale, torch.zeros(())), x, upstream)
    assert torch.equal(ours, theirs)


def _eval_worker(rank, world, port, shards, layouts, out):
    """Evaluates the same initial weights with each (micro-batch, sequences) of ``layouts``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        manifest = load_manifest(shards)
        special = SpecialIds.from_manifest(manifest)
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64),
            manifest.tokenizer.vocab_size,
            special,
            ImplConfig(attention="sdpa", precision="fp32"),
        )
        info = SimpleNamespace(rank=rank, world=world, device=torch.device("cpu"))
        results = []
        for micro, sequences in layouts:
            cfg = load_config(
                "configs/tiny.yaml",
                [
                    f"data.dir={shards}",
                    f"impl.micro_batch_size={micro}",
                    f"train.eval_sequences={sequences}",
                    f"train.global_batch_size={micro}",
                ],
            )
            results.append(evaluate(model, cfg, special, info))
        if rank == 0:
            out.write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def eval_at(shards, tmp_path, world, layouts) -> list[dict]:
    out = tmp_path / f"eval_{world}.json"
    if world == 1:  # in this process: a spawn costs its imports
        _eval_worker(0, 1, free_port(), shards, layouts, out)
    else:
        mp.spawn(_eval_worker, args=(world, free_port(), shards, layouts, out), nprocs=world)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_eval_loss_is_bit_identical_at_any_world_size_and_micro_batch(shards, tmp_path):
    """13 sequences: uneven parts per rank, partial last batches and a filler batch on one rank."""
    one = eval_at(shards, tmp_path, 1, [(3, 13), (4, 12)])
    two = eval_at(shards, tmp_path, 2, [(4, 13), (5, 13), (13, 13)])
    assert one[0]["eval/loss"] > 1.0
    assert all(r == one[0] for r in two), (one, two)
    assert one[1] != one[0]  # another set, another loss


def test_eval_set_is_the_first_sequences_split_across_ranks(shards):
    manifest = load_manifest(shards)
    for world, micro in [(1, 4), (2, 4), (3, 2)]:
        seen, counts = [], set()
        for rank in range(world):
            batches = list(eval_set_batches(shards, manifest, "validation", rank, world, micro, 13))
            counts.add(len(batches))
            seen += [i for b in batches if not b["filler"] for i in b["sample_ids"].tolist()]
        assert sorted(seen) == list(range(13)) and len(counts) == 1, (world, micro)
    whole = sum(s.sequences for s in manifest.shards_of("validation"))
    everything = list(eval_set_batches(shards, manifest, "validation", 0, 1, 1000, 0))
    assert sum(len(b["sample_ids"]) for b in everything) == whole


def test_deprecated_eval_batches_becomes_a_sequence_count_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "manifest.json").write_text("{}")  # load_config checks only that there is one
    with pytest.warns(FutureWarning, match="eval_sequences=48"):
        cfg = load_config("configs/tiny.yaml", [f"data.dir={tmp_path}", "train.eval_batches=3"])
    assert (cfg.train.eval_sequences, cfg.train.eval_batches) == (48, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config("configs/tiny.yaml", [f"data.dir={tmp_path}"]).train.eval_sequences == 64


@pytest.mark.slow
@pytest.mark.parametrize("hash_per", ["element", "pair"])
def test_compiled_keyed_dropout_writes_no_mask_and_per_element_no_hash_to_memory(hash_per):
    """Issue 84, item 3: the H200 profile of 2026-11-28 found each dropout site's hash a kernel of its
    own (56-67 us at BERT-base's shape), an int64 hash a pair of elements and a bool mask written out
    and read back, forward and backward. Inductor decides what to write out while lowering, the same
    on any device but for two limits, set here to a GPU's: compiled on the CPU, a BERT model's forward
    and backward allocate no bool buffer of a site's size; with ``impl.dropout_hash=per_element`` no
    int64 one either, with ``per_pair`` one int32 a pair (half a site's size: the hash's first round,
    4 bytes, not 8). Either way they drop the units eager drops."""
    import math
    import re

    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    rows, length, hidden = 8, 64, 32
    ids = torch.randint(5, SPECIAL.vocab_size, (rows, length), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(0, rows * length, 7)
    model = tiny("bert", hidden_dropout=0.1, attention_dropout=0.0).train()
    key = keyed_dropout.install(model.hf_model, seed=1, per_element=hash_per == "element")
    model.fixed_predictions = True
    key.set(torch.arange(rows), step=1)
    eager = model(ids, None, positions, ids.reshape(-1)[positions])[0]
    compiled = torch.compile(model)

    def step():
        loss = compiled(ids, None, positions, ids.reshape(-1)[positions])[0]
        loss.backward()
        return loss

    with inductor_config.patch(realize_opcount_threshold=30, realize_acc_reads_threshold=8, fx_graph_cache=False):
        loss, codes = run_and_get_code(step)
    assert len(codes) == 2 and torch.allclose(loss, eager, rtol=1e-5), (len(codes), loss, eager)
    written = []
    for code in codes:  # forward, backward
        for size, dtype in re.findall(r"empty_strided_cpu\(\((.*?)\), \(.*?\), torch\.(\w+)\)", code):
            numel = math.prod(int(v) for v in size.split(",") if v.strip())
            if dtype in ("int64", "int32", "bool") and numel >= rows * length * hidden // 2:
                written.append((numel, dtype))
    if hash_per == "element":
        assert written == []
    else:  # the forward's sites and their recomputation in the backward
        assert written and set(written) == {(rows * length * hidden // 2, "int32")}, written
