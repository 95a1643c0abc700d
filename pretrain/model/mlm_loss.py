"""The MLM loss fused with the decoder: cross-entropy over the vocabulary in row chunks, never the
whole [N, V] log-softmax.

The plain way (``F.linear`` then ``F.cross_entropy``) keeps the fp32 logits, their log-softmax and,
in the backward, the gradient of each, all [N, V] with V = 30k: on a GPU batch of 300k predicted
tokens that is 37 GB apiece, and on every device it is four full passes over memory that a matmul
would not need. Here each chunk of rows goes from its logits to its loss, its argmax (on steps that
log the accuracy) and the gradient of its logits (softmax minus the one-hot label) while the chunk
is hot, and that gradient goes straight into the matmuls that give the input's and the decoder's
gradients: the technique of fused linear cross-entropy kernels (Liger's, Apple's cut cross-entropy),
in plain PyTorch so that the CPU and CUDA run the same code, and ``torch.compile`` traces it with its
chunks when the count of predicted tokens is fixed (``masking.fixed_count``), and leaves it eager
otherwise (see ``fused_linear_cross_entropy``).

The gradients are computed in the forward (no logits kept for the backward) for the unscaled sum
of the losses; the backward multiplies them by the incoming gradient, a scalar: the loss is a sum,
so the scale factor of the caller (1 / predicted tokens, a loss scale) applies to every row alike.
The decoder's gradient is summed over chunks in fp32, so the bf16 result differs from the plain
path's only by rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.model.masking import IGNORE_INDEX

# Rows per chunk so that a chunk's fp32 logits take about this many bytes: on a CPU, 128 to 614 rows
# of a 30k vocabulary measured alike and 64 slower (bench/mlm_loss.py); on a GPU, chunks large enough
# that the decoder's matmuls run at full speed, and no [N, V] tensor for a large batch.
CHUNK_BYTES = {"cpu": 32 * 2**20, "cuda": 512 * 2**20}


def rows_per_chunk(vocab_size: int, device: torch.device) -> int:
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * vocab_size))


def mask_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits`` [..., V] with the columns from ``vocab_size`` on (a padded decoder's rows,
    ``model.vocab_multiple``) set to -inf in place: outside the softmax and the argmax, no gradient."""
    if logits.size(-1) > vocab_size:
        logits[..., vocab_size:] = float("-inf")
    return logits


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, want_grad: bool, want_correct: bool, vocab_size: int):
    """(per-row losses, correct or None) of fp32 ``logits`` [c, V], which are overwritten: with
    ``want_grad``, by the gradient of the summed loss (zero rows where the label is IGNORE_INDEX).
    One max gives the softmax's shift and the argmax; everything after it is in place. Columns from
    ``vocab_size`` on (a padded decoder's) are outside the softmax: their gradient is 0."""
    mask_padding(logits, vocab_size)
    counted = labels != IGNORE_INDEX
    target = labels.clamp(min=0).unsqueeze(1)
    target_logit = logits.gather(1, target).squeeze(1)
    correct = None
    if want_correct:
        top, predicted = logits.max(dim=1)
        correct = (predicted == labels) & counted
    else:
        top = logits.amax(dim=1)
    total = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1)
    loss = (total.log() + top - target_logit) * counted
    if want_grad:
        logits.mul_((counted / total).unsqueeze(1))
        logits.scatter_add_(1, target, -counted.unsqueeze(1).to(logits.dtype))
    return loss, correct


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, want_correct: bool, chunk_rows: int, vocab_size: int):
        want_grad = any(ctx.needs_input_grad[:3])
        n = hidden.size(0)
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(n if want_correct else 0, dtype=torch.bool, device=hidden.device)
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad) if want_grad else None
        # Under torch.compile n is the same in every batch here (fused_linear_cross_entropy runs a
        # changing count eagerly): the chunks unroll into the graph, each one's logits freed after it.
        chunks = [slice(start, min(start + chunk_rows, n)) for start in range(0, n, chunk_rows)]
        for rows in chunks:
            x, y = hidden[rows], labels[rows]
            logits = F.linear(x, weight, bias).float()
            losses[rows], chunk_correct = _chunk_loss(logits, y, want_grad, want_correct, vocab_size)
            if want_correct:
                correct[rows] = chunk_correct
            if grads is not None:
                grads.add(rows, x, logits, weight)
        ctx.grads = grads
        ctx.mark_non_differentiable(losses, correct)
        return losses.sum(), losses, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_losses, _grad_correct):
        grads, ctx.grads = ctx.grads, None
        return (*grads.scaled(grad_loss), None, None, None, None)


class _Grads:
    """The unscaled gradients of the summed loss, built chunk by chunk; fp32 where they are sums of
    several chunks' 16-bit products."""

    def __init__(self, hidden, weight, bias, needs):
        self.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        self.needs = (needs[0], needs[1], bias is not None and needs[2])
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        # Built by the first chunk; zeros when there is none (a batch with nothing to predict): every
        # parameter gets a gradient, as ZeRO's per-parameter hooks expect on every rank alike.
        self.weight = torch.zeros_like(weight, dtype=torch.float32) if needs[1] and not len(hidden) else None
        self.bias = torch.zeros_like(bias, dtype=torch.float32) if self.needs[2] and not len(hidden) else None

    def add(self, rows: slice, x, grad_logits, weight) -> None:
        if self.needs[2]:
            part = grad_logits.sum(0)
            self.bias = part if self.bias is None else self.bias.add_(part)
        grad_logits = grad_logits.to(x.dtype)
        if self.needs[0]:
            torch.mm(grad_logits, weight, out=self.hidden[rows])
        if self.needs[1]:
            if self.weight is None:  # one chunk (the usual case on a CPU): no fp32 round trip
                self.weight = grad_logits.t() @ x
            elif self.weight.dtype == x.dtype == torch.float32:
                self.weight.addmm_(grad_logits.t(), x)
            else:  # chunks of 16-bit products summed in fp32
                self.weight = self.weight.float().add_(grad_logits.t() @ x)

    def scaled(self, factor: torch.Tensor):
        def scale(grad, dtype):
            return None if grad is None else grad.mul_(factor).to(dtype)

        return tuple(scale(g, d) for g, d in zip((self.hidden, self.weight, self.bias), self.dtypes))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    want_correct: bool = True,
    chunk_rows: int | None = None,
    vocab_size: int | None = None,
    fixed_rows: bool = False,
):
    """The MLM loss of ``hidden`` [N, H] under the decoder ``weight`` [V, H] and ``bias`` [V] against
    ``labels`` [N] (IGNORE_INDEX: not counted).

    Returns (loss_sum, per-row losses [N] fp32, correct [N] bool): the sum is differentiable, the
    per-row losses are not (evaluation's sums, under no_grad); ``correct`` is empty unless
    ``want_correct``. ``vocab_size``: rows of ``weight`` from there on are padding, never predicted.
    ``fixed_rows``: N is the same in every batch (``masking.fixed_count``); see below."""
    if torch.compiler.is_compiling() and not fixed_rows:
        # A count that changes from batch to batch (masking without fixed_count) is a symbol to the
        # compiler: chunking by it would trace a graph per count, one chunk would make the whole
        # [N, V] logits live again. This call then runs eagerly (one graph break, at the loss).
        return _eager(hidden, weight, bias, labels, want_correct, chunk_rows, vocab_size)
    return _fused(hidden, weight, bias, labels, want_correct, chunk_rows, vocab_size)


def _fused(hidden, weight, bias, labels, want_correct: bool, chunk_rows: int | None, vocab_size: int | None):
    rows = chunk_rows or rows_per_chunk(weight.size(0), hidden.device)
    vocab_size = vocab_size or weight.size(0)
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, want_correct, rows, vocab_size)
    # Under autocast the decoder computes in autocast's dtype, as F.linear would: the inputs are cast
    # here, where autograd sees the casts (an fp32 weight gets an fp32 gradient), and the matmuls that
    # build the gradients inside the forward, which autocast does not reach (out=), get equal dtypes.
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        return _FusedLinearCrossEntropy.apply(
            hidden.to(dtype),
            weight.to(dtype),
            None if bias is None else bias.to(dtype),
            labels,
            want_correct,
            rows,
            vocab_size,
        )


_eager = torch.compiler.disable(_fused)
