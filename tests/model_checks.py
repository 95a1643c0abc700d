"""Checks both architectures' tests make of the model with the sparse MLM head."""

from __future__ import annotations

import torch

from pretrain.config.schema import MaskingConfig
from pretrain.model.masking import IGNORE_INDEX, mask_batch, mask_generator
from tests.pretrain.test_masking import SPECIAL


def assert_sparse_head_equals_dense(sparse, dense, ids, m, pad: int) -> None:
    """One forward and backward of the same masked batch: the same loss, counts and gradients."""
    attn = ids != pad
    results = []
    for model in (sparse, dense):
        model.train()
        torch.manual_seed(5)  # same dropout in both
        loss, correct, count = model(m.input_ids, attn, m.positions, m.labels)
        loss.backward()
        results.append((loss.detach(), correct, count, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l1, c1, n1, g1), (l2, c2, n2, g2) = results
    assert l1.dtype == torch.float32 and int(n1) == m.positions.numel() == int(n2)
    assert torch.allclose(l1, l2, rtol=1e-5) and int(c1) == int(c2)
    for name in g1:  # summation order differs: compare norms
        assert (g1[name] - g2[name]).norm() <= 1e-5 * g2[name].norm() + 1e-8, name


def dense_labels(ids, m) -> torch.Tensor:
    """The masked batch's labels as Hugging Face's dense [B, L] (IGNORE_INDEX where nothing is predicted)."""
    labels = torch.full_like(ids, IGNORE_INDEX).reshape(-1)
    labels[m.positions] = m.labels
    return labels.view_as(ids)


@torch.no_grad()
def sparse_mean_loss(sparse, ids, m, pad: int) -> torch.Tensor:
    sparse.eval()
    loss_sum, _, count = sparse(m.input_ids, ids != pad, m.positions, m.labels)
    return loss_sum / count


def masked(rows, **cfg):
    """The rows masked by a fixed generator: (ids, MaskedBatch)."""
    ids, starts = rows
    cfg = MaskingConfig(**cfg)
    return ids, mask_batch(ids, starts, SPECIAL, cfg, mask_generator(cfg.seed, 0, 0, 0))
