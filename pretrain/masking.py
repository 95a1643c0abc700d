"""Dynamic MLM masking, done on the device once per micro-step.

``mask_batch`` is a pure function of (token ids, word starts, special ids, masking config, generator).
The generator comes from ``mask_generator(seed, step, rank, micro_step)``, so a resumed run masks
every micro-batch exactly as the uninterrupted run did (given the same micro-batch size and world
size, which decide what each (rank, micro_step) holds).

Which tokens may be chosen: every id except the manifest's special ids ([PAD], [CLS], [SEP], [MASK]
and [UNK]). [UNK] is excluded like Hugging Face's ``DataCollatorForLanguageModeling`` does (it counts
[UNK] among the special tokens): the target "[UNK]" carries no information about the text, and a
random replacement by [UNK] would teach the model that [UNK] stands for arbitrary words.

Strategies (``MaskingConfig.strategy``); each one selects ``rate`` of the choosable tokens *in
expectation*, exactly, not just approximately:

* ``token``: each choosable token independently with probability ``rate``.
* ``whole_word``: each word independently with probability ``rate``, all of its pieces or none. A
  word is a word-start token and the continuation pieces after it; a special token, and the first
  token after one (a row may begin in the middle of a word), always starts a new unit. Since each
  token is chosen exactly when its word is, E[chosen tokens] = rate x tokens, whatever the word
  lengths (no "select until the budget" loop is needed for the rate to be right).
* ``span`` (SpanBERT): spans of whole words, lengths in words ~ min(Geometric(span_geometric_p),
  span_max). Fully tensorised: the words of the batch are cut into consecutive segments by a
  renewal process (each word starts a new segment with probability p, a segment that reached
  span_max words is cut, and specials cut), which makes the segment lengths i.i.d.
  min(Geometric(p), span_max) (the geometric is memoryless), except the last segment before a
  special token, which the special truncates. Each segment is then chosen with probability q(1-q):
  "its coin came up and its predecessor's did not" (coin probability q), so two chosen spans are
  never adjacent and every chosen span shows up as one masked run of at most span_max words.
  q(1-q) = rate needs rate <= 0.25; above that each segment is chosen with probability rate and
  adjacent spans may merge. Each token is in exactly one segment, so E[chosen tokens] = rate x tokens.
  Note: SpanBERT's reference code renormalises the truncated geometric (mean 3.8 words at p=0.2,
  max 10); the config asks for clipping, whose mean is (1 - (1-p)^max) / p = 4.46 words.

``fixed_count`` (strategy ``token`` only) keeps shapes static for torch.compile / CUDA graphs: every
row gets ``n = ceil(rate * L)`` prediction slots (L = sequence length), of which row b fills
``floor(rate * c_b + u)``, u ~ U[0, 1) (c_b = its choosable tokens: fewer than L - 2 in rows with
document separators and in the last, padded row of a data-prep task). That stochastic rounding keeps
the expected rate exactly ``rate`` (plain rounding was 0.152 on real text, since most c_b are just
below 126). Unfilled slots get label -100 (ignored by the loss) and leave the input unchanged;
``num_masked`` counts the filled ones, so normalise the loss by it, not by ``positions.numel()``.

Random replacements are drawn uniformly from the non-special vocabulary (the bert-base-uncased
vocabulary's [unusedN] entries included: they are ordinary ids to the data).

Host syncs: without ``fixed_count`` the number of chosen tokens is data-dependent, so building
``positions`` with ``nonzero`` waits for the device once per call. With ``fixed_count`` nothing
waits. Everything else is device tensors and the given generator.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from pretrain.config import MaskingConfig

IGNORE_INDEX = -100                      # label of an unused fixed_count slot (torch's CE default)
EVAL_MASK_SEED = 20_250_101              # evaluation masks never depend on the training config
_SPECIAL_NAMES = ("pad", "unk", "cls", "sep", "mask")


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int
    vocab_size: int
    all_special: tuple[int, ...] = field(init=False)   # sorted, unique; never chosen nor drawn

    def __post_init__(self):
        ids = tuple(sorted({self.pad, self.unk, self.cls, self.sep, self.mask}))
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"special ids {bad} lie outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.vocab_size:
            raise ValueError(f"vocabulary of {self.vocab_size} has no ids besides the special ones {ids}")
        object.__setattr__(self, "all_special", ids)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "SpecialIds":
        tok = manifest.get("tokenizer")
        if not isinstance(tok, dict):
            raise ValueError("manifest.json: missing the 'tokenizer' section")
        ids = tok.get("special_ids")
        if not isinstance(ids, dict):
            raise ValueError("manifest.json: missing tokenizer.special_ids")
        missing = [k for k in _SPECIAL_NAMES if not isinstance(ids.get(k), int)]
        if missing:
            raise ValueError(f"manifest.json: tokenizer.special_ids lacks {missing} (has {sorted(ids)})")
        if not isinstance(tok.get("vocab_size"), int):
            raise ValueError("manifest.json: missing tokenizer.vocab_size")
        return cls(**{k: ids[k] for k in _SPECIAL_NAMES}, vocab_size=tok["vocab_size"])

    def is_special(self, ids: torch.Tensor) -> torch.Tensor:
        # Python-int comparisons: no small tensor copied to the device on every call.
        out = ids == self.all_special[0]
        for s in self.all_special[1:]:
            out |= ids == s
        return out


@dataclass
class MaskedBatch:
    input_ids: torch.Tensor     # [B, L] int64, the model's input
    positions: torch.Tensor     # [N] int64, flat indices into B*L, ascending
    labels: torch.Tensor        # [N] int64, original ids there (IGNORE_INDEX for unused fixed_count slots)
    num_masked: torch.Tensor    # 0-d int64 on the device: labels that count (== N without fixed_count)


def mask_seed(seed: int, step: int, rank: int, micro_step: int) -> int:
    """A well-mixed 63-bit seed from the tuple: nearby tuples give unrelated streams."""
    key = f"mlm-mask/{int(seed)}/{int(step)}/{int(rank)}/{int(micro_step)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def mask_generator(seed: int, step: int, rank: int, micro_step: int,
                   device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(mask_seed(seed, step, rank, micro_step))
    return gen


def eval_masking_config(cfg: MaskingConfig | None = None) -> MaskingConfig:
    """Evaluation always masks 15% of tokens, 80/10/10, with a fixed seed, whatever training uses,
    so eval losses compare across runs with different masking settings. Variable-count selection
    (not fixed_count) so the eval masks do not depend on that speed switch either."""
    return MaskingConfig(rate=0.15, mask_prob=0.8, random_prob=0.1, strategy="token",
                         fixed_count=False, seed=EVAL_MASK_SEED)


def random_non_special(n: int, special: SpecialIds, generator: torch.Generator,
                       device: torch.device) -> torch.Tensor:
    """``n`` ids uniform over the vocabulary minus the special ids."""
    r = torch.randint(0, special.vocab_size - len(special.all_special), (n,), generator=generator,
                      device=device)
    # Map [0, V - k) monotonically onto the non-special ids: step over each special, in ascending order.
    for s in special.all_special:
        r += (r >= s).long()
    return r


def mask_batch(input_ids: torch.Tensor, word_starts: torch.Tensor, special: SpecialIds,
               cfg: MaskingConfig, generator: torch.Generator) -> MaskedBatch:
    """Choose tokens per ``cfg.strategy``, then replace mask_prob of them by [MASK], random_prob by a
    random non-special id, and keep the rest. ``input_ids`` is not modified; the generator must live
    on the inputs' device."""
    if input_ids.dim() != 2 or word_starts.shape != input_ids.shape:
        raise ValueError(f"mask_batch: expected input_ids and word_starts of one shape [B, L], got "
                         f"{tuple(input_ids.shape)} and {tuple(word_starts.shape)}")
    if cfg.fixed_count and cfg.strategy != "token":
        raise ValueError(f"masking.fixed_count works with strategy 'token' only (got {cfg.strategy!r}): "
                         "whole words and spans cannot fill an exact token count without bias")
    ids = input_ids.long()
    special_tok = special.is_special(ids)
    flat_ids = ids.reshape(-1)

    if cfg.fixed_count:
        positions, labels = _choose_fixed(special_tok, flat_ids, cfg.rate, generator)
        valid = labels != IGNORE_INDEX
        num_masked = valid.sum()
    else:
        chosen = {"token": _choose_tokens, "whole_word": _choose_words, "span": _choose_spans}[cfg.strategy](
            special_tok, word_starts.bool(), cfg, generator)
        positions = chosen.reshape(-1).nonzero().squeeze(1)        # host sync: N is data-dependent
        labels = flat_ids[positions]
        valid = None
        num_masked = torch.tensor(positions.numel(), device=ids.device)

    n = positions.numel()
    action = torch.rand(n, generator=generator, device=ids.device)
    replacement = random_non_special(n, special, generator, ids.device)
    new = torch.where(action < cfg.mask_prob, torch.full_like(labels, special.mask),
                      torch.where(action < cfg.mask_prob + cfg.random_prob, replacement, flat_ids[positions]))
    if valid is not None:
        new = torch.where(valid, new, flat_ids[positions])
    masked = flat_ids.clone()
    masked[positions] = new
    return MaskedBatch(masked.view_as(ids), positions, labels, num_masked)


def _choose_tokens(special_tok, word_starts, cfg, gen):
    u = torch.rand(special_tok.shape, generator=gen, device=special_tok.device)
    return (u < cfg.rate) & ~special_tok


def _unit_starts(special_tok: torch.Tensor, word_starts: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: where a word (or a special token, a unit of its own) begins."""
    after_boundary = torch.ones_like(special_tok)
    after_boundary[:, 1:] = special_tok[:, :-1]
    return word_starts | special_tok | after_boundary


def _start_of_unit(unit_start: torch.Tensor) -> torch.Tensor:
    """Flat index of the start of each token's unit: a running maximum, no loop."""
    flat = unit_start.reshape(-1)
    idx = torch.arange(flat.numel(), device=flat.device)
    return torch.cummax(torch.where(flat, idx, torch.zeros_like(idx)), dim=0).values


def _choose_words(special_tok, word_starts, cfg, gen):
    start = _start_of_unit(_unit_starts(special_tok, word_starts))
    u = torch.rand(start.numel(), generator=gen, device=start.device)
    return ((u[start] < cfg.rate) & ~special_tok.reshape(-1)).view_as(special_tok)


def span_segments(special_tok: torch.Tensor, word_starts: torch.Tensor, cfg: MaskingConfig,
                  gen: torch.Generator) -> torch.Tensor:
    """Flat index of the first token of each token's candidate span (see the module docstring)."""
    device = special_tok.device
    first_after_boundary = torch.ones_like(special_tok)
    first_after_boundary[:, 1:] = special_tok[:, :-1]
    word_start = (_unit_starts(special_tok, word_starts) & ~special_tok).reshape(-1)
    first_after_boundary = first_after_boundary.reshape(-1)
    u = torch.rand(word_start.numel(), generator=gen, device=device)
    random_cut = word_start & (first_after_boundary | (u < cfg.span_geometric_p))
    word_no = torch.cumsum(word_start.long(), 0)              # same for every piece of a word
    last_cut = torch.cummax(torch.where(random_cut, word_no, torch.zeros_like(word_no)), 0).values
    since = word_no - last_cut                                # words since the last random cut
    clip_cut = word_start & (since > 0) & (since % cfg.span_max == 0)
    cut = random_cut | clip_cut | special_tok.reshape(-1)
    idx = torch.arange(cut.numel(), device=device)
    return torch.cummax(torch.where(cut, idx, torch.zeros_like(idx)), 0).values


def _choose_spans(special_tok, word_starts, cfg, gen):
    seg = span_segments(special_tok, word_starts, cfg, gen)
    u = torch.rand(seg.numel(), generator=gen, device=seg.device)
    if cfg.rate <= 0.25:
        q = (1.0 - (1.0 - 4.0 * cfg.rate) ** 0.5) / 2.0        # q (1 - q) = rate
        coin = u < q
        prev_seg = seg[(seg - 1).clamp(min=0)]
        chosen_seg = coin[seg] & ~(coin[prev_seg] & (seg > 0))
    else:
        chosen_seg = (u < cfg.rate)[seg]
    return (chosen_seg & ~special_tok.reshape(-1)).view_as(special_tok)


def _choose_fixed(special_tok, flat_ids, rate, gen):
    b, length = special_tok.shape
    slots = min(length, max(1, math.ceil(rate * length - 1e-9)))
    choosable = (~special_tok).sum(1)
    dither = torch.rand(b, generator=gen, device=special_tok.device, dtype=torch.float64)
    fill = torch.floor(choosable.double() * rate + dither).long().clamp(max=slots)   # [B]
    scores = torch.rand(special_tok.shape, generator=gen, device=special_tok.device)
    scores = scores.masked_fill(special_tok, -1.0)            # specials rank last, never filled
    top = scores.topk(slots, dim=1).indices                   # best first: slot j is filled iff j < fill
    filled = torch.arange(slots, device=top.device)[None, :] < fill[:, None]
    order = top.argsort(dim=1)
    top, filled = top.gather(1, order), filled.gather(1, order)
    positions = (top + torch.arange(b, device=top.device)[:, None] * length).reshape(-1)
    labels = torch.where(filled.reshape(-1), flat_ids[positions], torch.full_like(positions, IGNORE_INDEX))
    return positions, labels
