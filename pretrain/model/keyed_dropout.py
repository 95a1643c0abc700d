"""Dropout keyed by each sequence's identity, so that a step's result does not depend on the layout.

torch's dropout draws from the global generator: which numbers a row gets depends on the rank and
micro-batch it lands in and on the rows before it, so a run resumed at another world size or
micro-batch dropped other units (~2e-3 in loss). Here every dropout mask of a row is the counter-based
hash of (train.seed, step, the site's name, the row's sample id, the element's position in the row),
the same mixing function that keys the MLM masks (``pretrain.model.masking._mix32``). A row then gets
the same mask in any batch, at any world size or micro-batch: results match up to summation order.

Cost: per element one 32-bit hash (three multiply/xor-shift rounds) gives two 16-bit draws. Eagerly
that is ~20 passes over memory per site; under ``torch.compile`` the whole site (hash, compare, scale,
multiply) is one fused kernel with the bias, residual and LayerNorm around it. Nothing here is a
Python number that changes per step: the step and the batch's sample ids enter as one device tensor,
``DropoutKey.row_keys``, set once per micro-batch, so the compiled graph is traced once and has no
break at a dropout site. The arithmetic is int64 with explicit 32-bit masks rather than wrapping int32,
whose overflow PyTorch leaves undefined: eager and compiled give the same bits (tested against inductor
on the CPU), so a resume that compiles where the first run did not (``impl.compile: auto``) drops the
same units.

Sites: every ``nn.Dropout`` with p > 0 of the Hugging Face model (BERT: embeddings, attention output,
FFN output; ModernBERT: embeddings, attention output, MLP) becomes a :class:`KeyedDropout` (p = 0 sites
stay torch's, an identity), and dropout on the attention probabilities (``model.attention_dropout`` > 0,
both architectures) is applied by the ``keyed_sdpa`` attention function registered here. SDPA and flash
attention draw their dropout inside the kernel, which cannot be keyed, so with attention-probability
dropout on, *training* runs the attention eagerly (the probabilities materialised: slower and L^2
memory); evaluation, and any run with ``attention_dropout: 0`` (ModernBERT's and MosaicBERT's choice,
the GPU recipes here), keeps SDPA or flash attention.
"""

from __future__ import annotations

import logging
import zlib

import torch
from torch import nn

from pretrain.config.seeds import derive_seed
from pretrain.model.masking import _absorb, _mix32

log = logging.getLogger("pretrain")
KEYED_ATTENTION = "keyed_sdpa"
ATTENTION_CLASSES = ("BertSelfAttention", "ModernBertAttention")  # those that call the attention function
_COLUMN_SALT = 0x2F1D7A3B


class DropoutKey:
    """The current micro-batch's key, shared by all dropout sites of one model.

    Set by ``train_step`` once per micro-batch: the sites sit deep inside Hugging Face layers, whose
    forward arguments cannot carry the batch's sample ids. ``row_keys`` [B] int64 (values < 2**32) on
    the batch's device folds (seed, step, sample id) together; each site mixes its own name in."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.row_keys: torch.Tensor | None = None

    def set(self, sample_ids: torch.Tensor, step: int) -> None:
        head = _absorb(0x9E3779B9, derive_seed("dropout", self.seed, int(step)))  # a Python int
        ids = sample_ids.long()
        self.row_keys = _absorb(torch.full_like(ids, head), ids)


_column_cache: dict = {}


def _column_hashes(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64: the hash of each position in a row, the same for every row, site and step."""
    if torch.compiler.is_compiling():  # traced: computed inside the fused kernel
        return _mix32(torch.arange(n, device=device) + _COLUMN_SALT)
    key = (n, device)
    if key not in _column_cache:
        if len(_column_cache) > 64:
            _column_cache.clear()
        _column_cache[key] = _mix32(torch.arange(n, device=device) + _COLUMN_SALT)
    return _column_cache[key]


def keep_mask(row_keys: torch.Tensor, site_id: int, shape: torch.Size, dropped: int) -> torch.Tensor:
    """Bool mask of ``shape`` (rows first): True where an element is kept, i.e. where its 16-bit draw
    is at least ``dropped`` (= round(p * 65536)). Each 32-bit hash gives two draws, its low and its
    high half: half the hashing, p to within 2**-16."""
    rows, per_row = shape[0], shape[1:].numel()
    half = (per_row + 1) // 2
    site_keys = _mix32(row_keys ^ site_id)  # [B]
    h = _mix32(site_keys[:, None] ^ _column_hashes(half, row_keys.device)[None, :])
    # (h >> 16) >= d  <=>  h >= d << 16: one comparison fewer
    keep = torch.stack([(h & 0xFFFF) >= dropped, h >= dropped << 16], dim=-1).reshape(rows, 2 * half)
    return keep[:, :per_row].reshape(shape)


def _scaled_where(keep: torch.Tensor, t: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.where(keep, t * scale, torch.zeros((), dtype=t.dtype, device=t.device))


class _KeyedDropoutFunction(torch.autograd.Function):
    """``where(keep, x * scale, 0)`` whose backward recomputes ``keep`` from the row keys instead of
    keeping it: autograd's own ``where`` saves the bool mask (and, compiled, the int64 hash it came
    from) per site for the backward; here only the [B] keys are saved. Recomputing costs one more hash
    per element in the backward, on data already in registers when fused."""

    @staticmethod
    def forward(ctx, x, row_keys, site_id: int, dropped: int, scale: float):
        ctx.save_for_backward(row_keys)
        ctx.site_id, ctx.dropped, ctx.scale = site_id, dropped, scale
        return _scaled_where(keep_mask(row_keys, site_id, x.shape, dropped), x, scale)

    @staticmethod
    def backward(ctx, grad):
        (row_keys,) = ctx.saved_tensors
        # Compiled, the forward and the backward are one joint graph whose common subexpressions are
        # merged: the same ops on the same keys would be the forward's mask, which the partitioner
        # then saves. `| 0` (the same keys, another op) keeps the recomputation apart.
        keep = keep_mask(row_keys | 0, ctx.site_id, grad.shape, ctx.dropped)
        return _scaled_where(keep, grad, ctx.scale), None, None, None, None


class KeyedDropout(nn.Module):
    """``nn.Dropout`` whose mask for row b is a function of the row's sample id (see the module doc)."""

    def __init__(self, p: float, site: str, key: DropoutKey):
        super().__init__()
        self.p, self.site, self.key = float(p), site, key
        self.site_id = zlib.crc32(site.encode())
        self.dropped = round(self.p * 65536)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        keys = self.key.row_keys
        if keys is None or keys.shape[0] != x.shape[0]:
            raise RuntimeError(
                f"dropout site {self.site}: the batch's sample ids were not set for this input "
                f"of {x.shape[0]} rows (DropoutKey.set before the forward)"
            )
        scale = 65536.0 / (65536 - self.dropped)  # unbiased for the p drawn
        return _KeyedDropoutFunction.apply(x, keys, self.site_id, self.dropped, scale)


def keyed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA, except in training with attention-probability dropout: then eager attention whose
    probabilities go through the module's keyed dropout (``keyed_prob_dropout``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    drop = getattr(module, "keyed_prob_dropout", None)
    if not module.training or dropout == 0.0 or drop is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:  # the SDPA mask format: True where a query may attend
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
    attention_dropout = float(
        getattr(config, "attention_probs_dropout_prob", None) or getattr(config, "attention_dropout", 0.0) or 0.0
    )
    key = DropoutKey(seed)
    for name, parent in list(hf_model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Dropout) and child.p > 0:  # p = 0: an identity, left to torch
                keyed = KeyedDropout(child.p, f"{name}.{child_name}", key)
                keyed.train(child.training)  # a swapped module must not switch eval mode off
                setattr(parent, child_name, keyed)
        if attention_dropout > 0 and type(parent).__name__ in ATTENTION_CLASSES:
            prob = KeyedDropout(attention_dropout, f"{name}.attention_probs", key)
            prob.train(parent.training)
            parent.keyed_prob_dropout = prob
    if attention_dropout > 0:
        _register_attention()
        if config._attn_implementation != KEYED_ATTENTION:
            log.info(
                "model.attention_dropout=%g: training attention runs eagerly with keyed dropout on the "
                "probabilities (SDPA and flash kernels cannot key theirs); evaluation keeps SDPA",
                attention_dropout,
            )
        config._attn_implementation = KEYED_ATTENTION
    return key
