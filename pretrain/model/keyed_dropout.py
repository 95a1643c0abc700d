"""Dropout keyed by each sequence's identity, so that a step's result does not depend on the layout.

torch's dropout draws from the global generator: which numbers a row gets depends on the rank and
micro-batch it lands in and on the rows before it, so a run resumed at another world size or
micro-batch dropped other units (~2e-3 in loss). Here every dropout mask of a row is the counter-based
hash of (train.seed, step, the site's name, the row's sample id, the element's position in the row),
the same primitive that keys the MLM masks (``pretrain.masking._HashDraws``). A row then gets the same
mask in any batch, at any world size or micro-batch: results match up to summation order.

Sites: every ``nn.Dropout`` of the Hugging Face model (BERT: embeddings, attention output, FFN output;
ModernBERT: embeddings, attention output, MLP) becomes a :class:`KeyedDropout`, and dropout on the
attention probabilities (``model.attention_dropout`` > 0, both architectures) is applied by the
``keyed_sdpa`` attention function registered here. SDPA and flash attention draw their dropout inside
the kernel, which cannot be keyed, so with attention-probability dropout on, *training* runs the
attention eagerly (the probabilities materialised: slower and L^2 memory); evaluation, and any run with
``attention_dropout: 0`` (ModernBERT's default, ``configs/mini.yaml``), keeps SDPA.
"""
from __future__ import annotations

import logging
import zlib

import torch
from torch import nn

from pretrain.model.masking import _HashDraws
from pretrain.seeds import derive_seed

log = logging.getLogger("pretrain")
KEYED_ATTENTION = "keyed_sdpa"
ATTENTION_CLASSES = ("BertSelfAttention", "ModernBertAttention")     # those that call the attention function


class DropoutKey:
    """The current micro-batch's sample ids and step, shared by all dropout sites of one model.

    Set by ``train_step`` once per micro-batch: the sites sit deep inside Hugging Face layers, whose
    forward arguments cannot carry the batch's sample ids."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.sample_ids: torch.Tensor | None = None
        self.step = 0

    def set(self, sample_ids: torch.Tensor, step: int) -> None:
        self.sample_ids, self.step = sample_ids, int(step)


class KeyedDropout(nn.Module):
    """``nn.Dropout`` whose mask for row b is a function of the row's sample id (see the module doc)."""

    def __init__(self, p: float, site: str, key: DropoutKey):
        super().__init__()
        self.p, self.site, self.key = float(p), site, key
        self.site_id = zlib.crc32(site.encode())

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}"

    # Dynamo would guard on the step (a Python int) and recompile every step: this runs eagerly.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        ids = self.key.sample_ids
        if ids is None or ids.numel() != x.shape[0]:
            raise RuntimeError(f"dropout site {self.site}: the batch's sample ids were not set for this input "
                               f"of {x.shape[0]} rows (DropoutKey.set before the forward)")
        rows, per_row = x.shape[0], x[0].numel()
        draws = _HashDraws(derive_seed("dropout", self.key.seed, self.key.step, self.site_id),
                           ids.to(x.device, torch.long), per_row)
        # Each 32-bit hash gives two 16-bit draws: half the hashing, and p to within 2**-16.
        h = draws._hash(0, torch.arange(rows, device=x.device)[:, None],
                        torch.arange((per_row + 1) // 2, device=x.device)[None, :])
        bits = torch.stack([h & 0xFFFF, h >> 16], dim=-1).reshape(rows, -1)[:, :per_row]
        dropped = round(self.p * 65536)
        keep = bits.reshape(x.shape) >= dropped
        return x * keep.to(x.dtype) * (65536.0 / (65536 - dropped))     # unbiased for the p drawn


def keyed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA, except in training with attention-probability dropout: then eager attention whose
    probabilities go through the module's keyed dropout (``keyed_prob_dropout``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    drop = getattr(module, "keyed_prob_dropout", None)
    if not module.training or dropout == 0.0 or drop is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:        # the SDPA mask format: True where a query may attend
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = drop(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype))
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(KEYED_ATTENTION, keyed_attention)
    AttentionMaskInterface.register(KEYED_ATTENTION, sdpa_mask)


def install(hf_model: nn.Module, seed: int) -> DropoutKey:
    """Replace every dropout of ``hf_model`` by a keyed one; returns the key to set per micro-batch."""
    config = hf_model.config
    attention_dropout = float(getattr(config, "attention_probs_dropout_prob", None) or
                              getattr(config, "attention_dropout", 0.0) or 0.0)
    key = DropoutKey(seed)
    for name, parent in list(hf_model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Dropout):
                keyed = KeyedDropout(child.p, f"{name}.{child_name}", key)
                keyed.train(child.training)        # a swapped module must not switch eval mode off
                setattr(parent, child_name, keyed)
        if attention_dropout > 0 and type(parent).__name__ in ATTENTION_CLASSES:
            prob = KeyedDropout(attention_dropout, f"{name}.attention_probs", key)
            prob.train(parent.training)
            parent.keyed_prob_dropout = prob
    if attention_dropout > 0:
        _register_attention()
        if config._attn_implementation != KEYED_ATTENTION:
            log.info("model.attention_dropout=%g: training attention runs eagerly with keyed dropout on the "
                     "probabilities (SDPA and flash kernels cannot key theirs); evaluation keeps SDPA",
                     attention_dropout)
        config._attn_implementation = KEYED_ATTENTION
    return key
