"""Dropout keyed by each sequence's identity, so that a step's result does not depend on the layout.

torch's dropout draws from the global generator: which numbers a row gets depends on the rank and
micro-batch it lands in and on the rows before it, so a run resumed at another world size or
micro-batch dropped other units (~2e-3 in loss). Here every dropout mask of a row is the counter-based
hash of (train.seed, step, the site's name, the row's sample id, the element's position in the row),
the same mixing function that keys the MLM masks (``pretrain.model.masking._mix32``). A row then gets
the same mask in any batch, at any world size or micro-batch: results match up to summation order.

Cost: one 32-bit hash (three multiply/xor-shift rounds) gives a pair of elements their two 16-bit
draws. Eagerly that is ~20 passes over memory per site; under ``torch.compile`` the site (compare,
scale, multiply) fuses with the bias, residual and LayerNorm around it, and the hash either is written
out once a pair and read back (``impl.dropout_hash: per_pair``) or is computed by each element inside
that kernel (``per_element``, see ``DropoutKey``); no mask is written, and the bits are the same
either way. Nothing here is a Python number that changes per step: the step and the batch's sample
ids enter as device tensors (``DropoutKey.row_keys``, and ``site_keys`` per element), set once per
micro-batch, so the compiled graph is traced once and has no break at a dropout site. The arithmetic is int64 with explicit 32-bit masks rather than wrapping int32,
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
from pretrain.model.masking import _M32, _absorb, _mix32, mix32_after_first_shift

log = logging.getLogger("pretrain")
KEYED_ATTENTION = "keyed_sdpa"
ATTENTION_CLASSES = ("BertSelfAttention", "ModernBertAttention")  # those that call the attention function
_COLUMN_SALT = 0x2F1D7A3B


class DropoutKey:
    """The current micro-batch's keys, shared by all dropout sites of one model.

    Set by ``train_step`` once per micro-batch: the sites sit deep inside Hugging Face layers, whose
    forward arguments cannot carry the batch's sample ids. ``row_keys`` [B] int64 (values < 2**32) on
    the batch's device folds (seed, step, sample id) together; ``site_keys`` [sites, B] mixes in each
    registered site's name, and ``columns`` holds the hash of each position in a row (the same for
    every row, site and step), at least ``column_count`` of them. An element's hash is
    ``_mix32(site key ^ column)``, whose first xor-shift both carry already (``prepared``).

    They are computed here, outside the model, so that a compiled site's hash starts from loads:
    computed inside, the hash's intermediates (each read twice by its xor-shifts) pass inductor's
    30-op limit for recomputing a value that has two users, and it writes one of them out, an int64
    (and a bool mask) a site's size, then reads it back (the H200 profile of 2026-11-28: 56-67 us a
    kernel at BERT-base's shape). ``backward_site_keys`` are the same values in another tensor: the
    backward's mask, made from them, is not merged with the forward's into one value to keep.

    ``per_element`` (``impl.dropout_hash``): the sites take these tables, and compiled each element
    hashes in the kernel around it (twice the hashing, ~60 32-bit integer instructions an element on
    a GPU, and no memory); otherwise each site computes its keys and columns in the graph as before,
    and inductor writes one int32 a pair out and reads it back (2 bytes an element each way). The same
    bits either way."""

    def __init__(self, seed: int, column_count: int = 0, per_element: bool = False):
        self.seed = int(seed)
        self.column_count = int(column_count)
        self.per_element = bool(per_element)
        self.site_ids: list[int] = []
        self.row_keys: torch.Tensor | None = None
        self.site_keys: torch.Tensor | None = None
        self.backward_site_keys: torch.Tensor | None = None
        self.columns: torch.Tensor | None = None
        self.bounds: dict[int, torch.Tensor] = {}  # ``keep_mask``'s comparisons, by the draw dropped below
        self._sites: torch.Tensor | None = None
        self._dropped: set[int] = set()

    def register(self, site_id: int, dropped: int) -> int:
        """A site's row in ``site_keys``; ``dropped`` its draws kept from (``KeyedDropout.dropped``)."""
        self.site_ids.append(site_id)
        self._dropped.add(dropped)
        return len(self.site_ids) - 1

    def prepare(self, device: torch.device) -> None:
        """The tables on ``device``, once: the only copies from the host (the trainer calls it before
        its first step; ``set`` does on a device it has none for)."""
        device = torch.empty(0, device=device).device  # "cuda" as the tensors name it: "cuda:0"
        self._sites = torch.tensor(self.site_ids, dtype=torch.int64, device=device)
        # an even element keeps where its hash's low half is >= dropped, an odd one its high half
        self.bounds = {
            d: torch.tensor([[0xFFFF, d], [_M32, d << 16]], dtype=torch.int64, device=device) for d in self._dropped
        }
        self.columns = _prepared_columns(self.column_count, device)

    def set(self, sample_ids: torch.Tensor, step: int) -> None:
        """The micro-batch's keys, written into the tensors of the one before where their shapes agree.

        A compiled model reaches these tensors through a module's attribute, which dynamo takes as a
        static input: a CUDA graph (``impl.cuda_graphs``) reads it at the address it was recorded
        with, and where the address changes inductor records the graph again, on every call, counting
        no skip (``StaticInputIdxMismatch`` in ``torch/_inductor/cudagraph_trees.py``; the H200 lease
        of 2026-11-28 ran graphs at 0.158x). Each micro-batch's forward and backward end before the
        next ``set``, so nothing still reads the values overwritten."""
        head = _absorb(0x9E3779B9, derive_seed("dropout", self.seed, int(step)))  # a Python int
        ids = sample_ids.long()
        self.row_keys = _write_over(self.row_keys, _absorb(torch.full_like(ids, head), ids))
        if self._sites is None or self._sites.device != ids.device or len(self._sites) != len(self.site_ids):
            self.prepare(ids.device)
        if self.per_element:
            site_keys = _prepared(_mix32(self.row_keys[None, :] ^ self._sites[:, None]))
            self.site_keys = _write_over(self.site_keys, site_keys)
            self.backward_site_keys = _write_over(self.backward_site_keys, site_keys.clone())  # apart

    def columns_for(self, half: int) -> torch.Tensor:
        """[half] int64: the first ``half`` positions' prepared hashes, from ``columns`` where it holds them."""
        if self.columns is not None and len(self.columns) >= half:
            return self.columns[:half]
        columns = _prepared_columns(half, self.row_keys.device)  # compiled: computed in the graph
        if not torch.compiler.is_compiling():
            self.columns = columns
        return columns


def _write_over(kept: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``new``'s values in ``kept`` (the same address) where shape and device agree, else ``new``."""
    if kept is None or kept.shape != new.shape or kept.device != new.device:
        return new
    return kept.copy_(new)


def _prepared(x: torch.Tensor) -> torch.Tensor:
    """``x ^ (x >> 16)``: ``_mix32``'s first xor-shift, linear, so taken of a site key and a column apart."""
    return x ^ (x >> 16)


def _prepared_columns(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64: the hash of each position in a row, prepared."""
    return _prepared(_mix32(torch.arange(n, device=device) + _COLUMN_SALT))


def keep_mask(
    site_keys: torch.Tensor, columns: torch.Tensor, bounds: torch.Tensor, shape: torch.Size, narrow: bool = False
) -> torch.Tensor:
    """Bool mask of ``shape`` (rows first): True where an element is kept, i.e. where its 16-bit draw
    is at least the site's ``dropped`` (= round(p * 65536)). ``site_keys`` [rows], ``columns``
    [>= half] and ``bounds`` (the site's) from ``DropoutKey``. Each 32-bit hash gives a pair of
    elements two draws, its low half to the even one, its high half to the odd one: half the hashing
    eagerly, p to within 2**-16.

    The pair's hash is broadcast over the pair, not computed once and read twice, so that compiled no
    mask is written to memory; from the key's tables (``DropoutKey.per_element``) the hash's ops, ~22,
    stay under inductor's 30 for writing a broadcast value out, and each element recomputes it inside
    the one fused kernel. Otherwise (``narrow``: compiled, the per-pair tables made in the graph)
    inductor writes out the hash's first round, read twice by its xor-shift: as int32, 4 bytes a pair,
    not 8 (the same bits; ``mix32_after_first_shift``; eagerly it would only add passes)."""
    rows, per_row = shape[0], shape[1:].numel()
    half = (per_row + 1) // 2
    h = mix32_after_first_shift(site_keys[:, None, None] ^ columns[None, :half, None], narrow)  # [rows, half, 1]
    keep = ((h & bounds[:, 0]) >= bounds[:, 1]).reshape(rows, 2 * half)  # [rows, half, 2] flattened
    return keep[:, :per_row].reshape(shape)


def _scaled_where(keep: torch.Tensor, t: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.where(keep, t * scale, torch.zeros((), dtype=t.dtype, device=t.device))


class _KeyedDropoutFunction(torch.autograd.Function):
    """``where(keep, x * scale, 0)`` whose backward recomputes ``keep`` from the site's keys instead of
    keeping it: autograd's own ``where`` saves the bool mask (and, compiled, the int64 hash it came
    from) per site for the backward; here only the [B] keys (and views of the key's shared column
    hashes) are saved. Recomputing costs one more hash per element in the backward, on data already in
    registers when fused."""

    @staticmethod
    def forward(ctx, x, site_keys, backward_site_keys, columns, bounds, scale: float, narrow: bool):
        # Compiled, the forward and the backward are one joint graph whose common subexpressions are
        # merged: the backward's mask made from the forward's keys would be the forward's mask, which
        # the partitioner then saves. The same keys in another tensor keep the recomputation apart.
        ctx.save_for_backward(backward_site_keys, columns, bounds)
        ctx.scale, ctx.narrow = scale, narrow
        return _scaled_where(keep_mask(site_keys, columns, bounds, x.shape, narrow), x, scale)

    @staticmethod
    def backward(ctx, grad):
        site_keys, columns, bounds = ctx.saved_tensors
        keep = keep_mask(site_keys, columns, bounds, grad.shape, ctx.narrow)
        return _scaled_where(keep, grad, ctx.scale), None, None, None, None, None, None


class KeyedDropout(nn.Module):
    """``nn.Dropout`` whose mask for row b is a function of the row's sample id (see the module doc)."""

    def __init__(self, p: float, site: str, key: DropoutKey):
        super().__init__()
        self.p, self.site, self.key = float(p), site, key
        self.site_id = zlib.crc32(site.encode())
        self.dropped = round(self.p * 65536)
        self.index = key.register(self.site_id, self.dropped)  # its row of key.site_keys

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        key = self.key
        if key.row_keys is None or key.row_keys.shape[0] != x.shape[0] or len(key.site_ids) <= self.index:
            raise RuntimeError(
                f"dropout site {self.site}: the batch's sample ids were not set for this input "
                f"of {x.shape[0]} rows (DropoutKey.set before the forward)"
            )
        half = (x.shape[1:].numel() + 1) // 2
        if key.per_element:
            keys, columns = (key.site_keys[self.index], key.backward_site_keys[self.index]), key.columns_for(half)
        else:  # compiled, the per-pair tables made here, in the graph (the backward's keys by other ops)
            keys = tuple(_prepared(_mix32(k ^ self.site_id)) for k in (key.row_keys, key.row_keys | 0))
            columns = _prepared_columns(half, x.device) if torch.compiler.is_compiling() else key.columns_for(half)
        scale = 65536.0 / (65536 - self.dropped)  # unbiased for the p drawn
        # the int32 hand-off only pays where inductor writes the value out; eagerly it is 5 more passes
        narrow = not key.per_element and torch.compiler.is_compiling()
        return _KeyedDropoutFunction.apply(x, *keys, columns, key.bounds[self.dropped], scale, narrow)


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


def install(hf_model: nn.Module, seed: int, per_element: bool = False) -> DropoutKey:
    """Replace every dropout of ``hf_model`` by a keyed one; returns the key to set per micro-batch.
    ``per_element``: ``DropoutKey``'s (``impl.dropout_hash``)."""
    config = hf_model.config
    attention_dropout = float(
        getattr(config, "attention_probs_dropout_prob", None) or getattr(config, "attention_dropout", 0.0) or 0.0
    )
    # The widest site's row: a sequence of hidden or intermediate vectors (ModernBERT drops its MLP's
    # inner activations); attention-probability sites, wider, hash their columns where they run.
    width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
    key = DropoutKey(seed, column_count=(config.max_position_embeddings * width + 1) // 2, per_element=per_element)
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
