"""The documents inside a packed row (``model.attention_scope: document``): which tokens see which,
and where each document's positions start.

Data prep packs documents back to back (``data_prep/packing.py``): a row is ``[CLS] body [SEP]
[PAD]...`` and the bodies, concatenated, are the stream ``d0 [SEP] d1 [SEP] d2 ...``. So the
separators alone say where each document ends, in every shard written so far, and they survive
masking (a [SEP] is never chosen, and no random replacement is special): the boundaries are derived
here, on the device, from the ids the model gets, with no host sync and nothing new in the shards.

The rule, for each row:

- a token belongs to the document numbered by the [SEP]s before it in the row: the row's [CLS] to
  the row's first document, each [SEP] to the document it ends, and the padding after the row's
  last [SEP] to a group of its own, which no real token sees (so the document mask is also the
  padding mask, and no query is left with nothing to attend to);
- a token attends only to tokens of its own document (ModernBERT's local layers: and within their
  window);
- positions restart at each document: the first keeps the row's (0 for [CLS], then 1, 2, ...), and
  every later document starts at 1, as if a [CLS] stood before it. A document's text therefore
  always sits at positions 1, 2, ..., as in a row ``[CLS] document [SEP]`` that holds it alone, which
  is what the exported model is given (docs/evaluating.md).

A document cut by a row boundary is two documents to the model, one in each row, as with ``row``.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask


def document_ids(input_ids: torch.Tensor, sep_id: int) -> torch.Tensor:
    """[B, L] int32: the document each token belongs to, counted from 0 in its row."""
    is_sep = (input_ids == sep_id).to(torch.int32)
    return is_sep.cumsum(dim=1, dtype=torch.int32) - is_sep  # [SEP]s strictly before the token


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, L] int64 position ids: restarting at each document, at 1 after the row's first."""
    length = documents.size(1)
    index = torch.arange(length, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first_of_document = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first_of_document + (documents > 0).long()


def same_document(documents: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, 1, L, L] bool, True where query i may attend to key j: the same document (and, with a
    ``window``, ``|i - j| <= window``, ModernBERT's local layers as Hugging Face masks them)."""
    allowed = documents[:, None, :, None] == documents[:, None, None, :]
    return allowed if window is None else within_window(allowed, window)


def within_window(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """A [B, 1, L, L] mask narrowed to ``|i - j| <= window`` (ModernBERT's local layers)."""
    index = torch.arange(allowed.size(-1), device=allowed.device)
    return allowed & ((index[:, None] - index[None, :]).abs() <= window)


def as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias that Hugging Face's eager attention adds to its scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def block_mask(documents: torch.Tensor, window: int | None = None):
    """``same_document`` as FlexAttention's BlockMask: built on the device, and the blocks that hold
    no pair of one document (most, in long rows of short documents) are skipped, not computed."""

    def inside(batch, head, q, kv):
        return documents[batch, q] == documents[batch, kv]

    def inside_window(batch, head, q, kv):
        return (documents[batch, q] == documents[batch, kv]) & ((q - kv).abs() <= window)

    batch, length = documents.shape
    return create_block_mask(
        inside if window is None else inside_window, batch, None, length, length, device=documents.device
    )
