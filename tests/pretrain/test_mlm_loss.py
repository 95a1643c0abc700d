"""The fused MLM loss (decoder + cross-entropy in row chunks) against the plain F.linear + F.cross_entropy."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.masking import IGNORE_INDEX
from pretrain.model.mlm_loss import fused_linear_cross_entropy

N, H, V = 50, 24, 997


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    bias = torch.randn(V, generator=g) * 0.1
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::6] = IGNORE_INDEX
    labels[1] = int((hidden[1] @ weight.t() + bias).argmax())  # at least one right guess
    return [t.to(dtype).requires_grad_() for t in (hidden, weight, bias)] + [labels]


def plain(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    correct = (logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)
    return losses.sum(), losses, correct


def loss_and_grads(fn, tensors, scale=0.37):
    loss, losses, correct = fn(*tensors)
    (loss * scale).backward()
    grads = [t.grad.float().clone() for t in tensors[:3]]
    for t in tensors[:3]:
        t.grad = None
    return loss.detach(), losses.detach(), correct, grads


@pytest.mark.parametrize("chunk_rows", [1, 7, N, 4 * N])
def test_fused_loss_equals_plain_in_fp32(chunk_rows):
    tensors = inputs()
    loss, losses, correct, grads = loss_and_grads(plain, tensors)
    fused = loss_and_grads(lambda *t: fused_linear_cross_entropy(*t, chunk_rows=chunk_rows), tensors)
    assert torch.allclose(fused[0], loss, rtol=1e-6)
    assert torch.allclose(fused[1], losses, rtol=1e-5, atol=1e-6)
    assert (losses[::6] == 0).all() and (fused[1][::6] == 0).all()
    assert torch.equal(fused[2], correct) and int(correct.sum()) >= 1
    for mine, theirs in zip(fused[3], grads):
        assert (mine - theirs).norm() <= 1e-5 * theirs.norm()


@pytest.mark.parametrize("chunk_rows", [2, N])
def test_fused_bf16_gradients_are_within_bf16_rounding(chunk_rows):
    """Against fp32 arithmetic on the same bf16 inputs, the fused path errs no more than the plain
    bf16 path does (its decoder gradient is summed over chunks in fp32)."""
    low = inputs(torch.bfloat16)
    exact = loss_and_grads(plain, [t.detach().float().requires_grad_() for t in low[:3]] + low[3:])
    plain_low = loss_and_grads(plain, low)
    fused_low = loss_and_grads(lambda *t: fused_linear_cross_entropy(*t, chunk_rows=chunk_rows), low)
    assert abs(float(fused_low[0] - exact[0])) <= 1e-3 * float(exact[0])
    for name, mine, theirs, truth in zip(("hidden", "weight", "bias"), fused_low[3], plain_low[3], exact[3]):
        assert (mine - truth).norm() <= 1.25 * (theirs - truth).norm(), name
        assert (mine - truth).norm() <= 2**-7 * truth.norm(), name


def test_under_autocast_fp32_weights_get_fp32_gradients_within_bf16_rounding():
    """A bare loop's bf16 (torch.autocast over fp32 weights): the decoder runs in bf16 as F.linear
    would, and every gradient comes back in its parameter's dtype, as close to fp32 arithmetic as the
    plain path's under the same autocast. The hidden states arrive in bf16, as the encoder's output
    under autocast does."""
    tensors = inputs()
    tensors[0] = tensors[0].detach().to(torch.bfloat16).requires_grad_()
    exact = loss_and_grads(plain, [tensors[0].detach().float().requires_grad_(), *tensors[1:]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_low = loss_and_grads(plain, tensors)
        fused_low = loss_and_grads(lambda *t: fused_linear_cross_entropy(*t, chunk_rows=7), tensors)
        loss, _, _ = fused_linear_cross_entropy(*tensors, chunk_rows=7)
    loss.backward()
    assert [t.grad.dtype for t in tensors[:3]] == [torch.bfloat16, torch.float32, torch.float32]
    assert abs(float(fused_low[0] - exact[0])) <= 1e-2 * float(exact[0])
    for name, mine, theirs, truth in zip(("hidden", "weight", "bias"), fused_low[3], plain_low[3], exact[3]):
        assert (mine - truth).norm() <= 1.25 * (theirs - truth).norm() + 1e-6 * truth.norm(), name
        assert (mine - truth).norm() <= 2**-6 * truth.norm(), name


def test_without_grad_no_gradient_is_built_and_want_correct_off_gives_none():
    tensors = inputs()
    with torch.no_grad():
        loss, losses, correct = fused_linear_cross_entropy(*tensors, want_correct=False, chunk_rows=7)
        ref = plain(*tensors)
    assert not loss.requires_grad and correct.numel() == 0
    assert torch.allclose(losses, ref[1], rtol=1e-5, atol=1e-6)


def kept_full_logits(fn, tensors) -> int:
    """How many [N, V] tensors stay alive between the forward and the backward: saved for autograd's
    backward, or held by Python objects (such as a Function's ctx)."""
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(*tensors)[0]
    gc.collect()
    held = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == N * V)
    loss.backward()
    return saved.count(N * V) + held


def test_no_full_logits_are_kept_for_the_backward():
    tensors = inputs()
    assert kept_full_logits(plain, tensors) >= 1  # the check sees the plain path's
    assert kept_full_logits(lambda *t: fused_linear_cross_entropy(*t, chunk_rows=7), tensors) == 0


def test_compiled_keeps_its_chunks_for_a_fixed_count_and_runs_eagerly_for_a_changing_one():
    """Under torch.compile the full [N, V] logits are never live (issue 49, item 5): a fixed token
    count (masking.fixed_count) unrolls the chunks into the graph, one decoder matmul per chunk; a
    count that changes from batch to batch is a symbol, and the loss then runs eagerly in its chunks
    rather than whole in the graph. Either way the results are the eager ones."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def loss_and_correct(hidden, weight, bias, labels, fixed_rows=False):
        return fused_linear_cross_entropy(hidden, weight, bias, labels, chunk_rows=7, fixed_rows=fixed_rows)

    def decoder_matmuls():  # the autograd.Function's forward is a subgraph of the captured one
        return sum(
            1
            for gm in graphs
            for sub in gm.modules()
            if isinstance(sub, torch.fx.GraphModule)
            for node in sub.graph.nodes
            if node.op == "call_function" and "linear" in str(node.target)
        )

    torch._dynamo.reset()
    compiled = torch.compile(loss_and_correct, backend=recording)
    full = inputs()
    for n in (N, N - 9, N - 20):
        tensors = [t.detach()[:n].requires_grad_() if i == 0 else t for i, t in enumerate(full[:3])] + [full[3][:n]]
        eager = loss_and_grads(loss_and_correct, tensors)
        for fixed in (True, False) if n == N else (False,):
            traced = loss_and_grads(lambda *t: compiled(*t, fixed_rows=fixed), tensors)
            assert torch.allclose(traced[0], eager[0], rtol=1e-6) and torch.equal(traced[2], eager[2])
            for mine, theirs in zip(traced[3], eager[3]):
                assert (mine - theirs).norm() <= 1e-5 * theirs.norm()
        if n == N:  # fixed: 8 chunks of at most 7 rows unrolled; not fixed: none in the graph
            assert decoder_matmuls() == -(-N // 7)
            graphs.clear()
    assert decoder_matmuls() == 0  # changing counts: the loss ran eagerly


def test_padding_rows_of_the_decoder_are_never_predicted():
    """model.vocab_multiple pads the decoder (issue 49, item 4): rows past the tokenizer's take no
    part in the softmax or the argmax, even with a large bias, and get no gradient."""
    hidden, weight, bias, labels = inputs()
    pad = 27
    padded_weight = torch.cat([weight.detach(), torch.randn(pad, H)]).requires_grad_()
    padded_bias = torch.cat([bias.detach(), torch.full((pad,), 50.0)]).requires_grad_()
    for chunk_rows in (7, None):
        want = loss_and_grads(
            lambda *t: fused_linear_cross_entropy(*t, chunk_rows=chunk_rows), [hidden, weight, bias, labels]
        )
        got = loss_and_grads(
            lambda *t: fused_linear_cross_entropy(*t, chunk_rows=chunk_rows, vocab_size=V),
            [hidden, padded_weight, padded_bias, labels],
        )
        assert torch.allclose(got[0], want[0], rtol=1e-6) and torch.equal(got[2], want[2])
        assert torch.allclose(got[3][0], want[3][0], atol=1e-6)
        assert torch.allclose(got[3][1][:V], want[3][1], atol=1e-6) and not got[3][1][V:].any()
        assert torch.allclose(got[3][2][:V], want[3][2], atol=1e-6) and not got[3][2][V:].any()


def test_a_batch_with_nothing_to_predict_gives_zero_gradients():
    """Every parameter gets a gradient, zeros here: ZeRO's hooks expect one from every rank alike."""
    hidden, weight, bias, labels = inputs()
    empty = hidden.detach()[:0].requires_grad_()
    loss, losses, _ = fused_linear_cross_entropy(empty, weight, bias, labels[:0])
    loss.backward()
    assert float(loss.detach()) == 0.0 and losses.numel() == 0 and empty.grad.shape == (0, H)
    assert weight.grad is not None and bias.grad is not None
    assert not weight.grad.any() and not bias.grad.any()
