"""MLM masking, done on the device once per optimiser step, its micro-batches together: dynamic
(default) or static.

``mask_batch`` is a pure function of (token ids, word starts, special ids, masking config, and either
a generator or the rows' sample ids):

* **Dynamic** (``masking.dynamic: true``): with sample ids, what the trainer always passes, every
  random number is a counter-based hash of (seed, step, draw kind, sample id, position in the row), so
  a sequence gets a new mask every time it is seen, and a resumed run masks every row exactly as the
  uninterrupted run did, at any world size or micro-batch. Without sample ids (a caller that has
  none) it draws from a generator, e.g. ``mask_generator(seed, step, rank, micro_step)``.
* **Static** (``masking.dynamic: false``, original BERT's pre-generated masks without writing them
  to disk): every random number is a counter-based hash of (seed, draw kind, sample id, position in
  the row), so a sequence keeps one mask for the whole run whatever the step, epoch, rank, micro-batch
  or resume. Device tensors only (int64 arithmetic), no per-row generator; every strategy and
  ``fixed_count`` work.

Prediction versus corruption (Wettig et al. 2023, "Should You Mask 15% in MLM?"): ``rate`` is the
share of tokens the model *predicts* (the loss covers them); of those, ``mask_replace_prob`` are corrupted to
[MASK], ``random_replace_prob`` to a random token, and the rest stay visible. The corruption rate is
``rate * (mask_replace_prob + random_replace_prob)``. BERT's 80/10/10 is one point of that space, 100/0/0 (predict
exactly what is corrupted, all by [MASK]) another.

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

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from data_prep.common.manifest import SPECIAL_ROLES, Manifest
from pretrain.config.schema import MaskingConfig
from pretrain.config.seeds import derive_seed

IGNORE_INDEX = -100  # label of an unused fixed_count slot (torch's CE default)
EVAL_MASK_SEED = 20_250_101  # evaluation masks never depend on the training config


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int
    vocab_size: int
    all_special: tuple[int, ...] = field(init=False)  # sorted, unique; never chosen nor drawn

    def __post_init__(self):
        ids = tuple(sorted({self.pad, self.unk, self.cls, self.sep, self.mask}))
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"special ids {bad} lie outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.vocab_size:
            raise ValueError(f"vocabulary of {self.vocab_size} has no ids besides the special ones {ids}")
        object.__setattr__(self, "all_special", ids)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "SpecialIds":
        """The data's special ids (``Manifest.from_dict`` saw that there is one for each role)."""
        tok = manifest.tokenizer
        return cls(**{k: tok.special_ids[k] for k in SPECIAL_ROLES}, vocab_size=tok.vocab_size)

    def is_special(self, ids: torch.Tensor) -> torch.Tensor:
        # Python-int comparisons: no small tensor copied to the device on every call.
        out = ids == self.all_special[0]
        for s in self.all_special[1:]:
            out |= ids == s
        return out


@dataclass
class MaskedBatch:
    input_ids: torch.Tensor  # [B, L] int64, the model's input
    positions: torch.Tensor  # [N] int64, flat indices into B*L, ascending
    labels: torch.Tensor  # [N] int64, original ids there (IGNORE_INDEX for unused fixed_count slots)
    num_masked: torch.Tensor  # 0-d int64 on the device: labels that count (== N without fixed_count)


# ---------------------------------------------------------------------------- random numbers
# Kinds of draw: each gets its own stream, so that e.g. the choice of a token and its replacement
# are independent in static masking.
_CHOOSE, _SPAN_CUT, _SPAN_COIN, _ACTION, _REPLACEMENT, _FIXED_DITHER, _FIXED_SCORE = range(1, 8)
_KINDS = 7
_M32 = 0xFFFFFFFF


def _mix32(x):
    """A bijection of [0, 2**32) with good avalanche (xor-shift / multiply rounds), on Python ints or
    int64 tensors. The odd multipliers stay below 2**31 so every product fits in int64 unsigned-free."""
    return mix32_after_first_shift(x ^ (x >> 16))


_MIX_ROUNDS = ((0x6C8E9CF5, 15), (0x2545F491, 16), (0x4F1BBCDD, 15))  # (odd multiplier, xor-shift)


def mix32_after_first_shift(x, narrow_first: bool = False):
    """``_mix32`` given ``x ^ (x >> 16)``: the first xor-shift is linear, so for ``x = a ^ b`` it may
    be taken of ``a`` and ``b`` apart (keyed dropout takes it once per row and per column).
    ``narrow_first`` (tensors): the first round's product is read by its xor-shift as int32, the same
    bits, so that where a compiler writes that value out (its two readers) it writes 4 bytes, not 8."""
    for i, (multiplier, shift) in enumerate(_MIX_ROUNDS):
        x = (x * multiplier) & _M32
        x = _xor_shift_from_int32(x, shift) if narrow_first and i == 0 else x ^ (x >> shift)
    return x


def _xor_shift_from_int32(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x ^ (x >> shift)`` for int64 ``x`` in [0, 2**32), both reads of ``x`` from one int32 of the same
    32 bits (moved into int32's range first: no conversion out of range)."""
    narrow = ((x ^ 0x80000000) - 0x80000000).to(torch.int32)  # x read once: the compiler keeps it in registers
    return (narrow.long() & _M32) ^ ((narrow >> shift).long() & (_M32 >> shift))


def _absorb(h, key):
    """Fold a 64-bit key into a 32-bit hash state, low half then high half."""
    h = _mix32((h ^ (key & _M32)) & _M32)
    return _mix32((h + ((key >> 32) & _M32) + 0x3C6EF372) & _M32)


def _uniform24(h: torch.Tensor) -> torch.Tensor:
    """float32 uniforms on [0, 1) with 24 bits, exactly representable."""
    return (h >> 8).float() * (1.0 / (1 << 24))


class _GeneratorDraws:
    """Dynamic masking: consecutive draws from one generator (the call order is part of the mask)."""

    def __init__(self, gen: torch.Generator, device: torch.device):
        self.gen, self.device = gen, device

    def tokens(self, kind: int, shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)

    def rows(self, kind: int, b: int) -> torch.Tensor:
        return torch.rand(b, generator=self.gen, device=self.device, dtype=torch.float64)

    def at(self, kind: int, flat_positions: torch.Tensor) -> torch.Tensor:
        return torch.rand(flat_positions.numel(), generator=self.gen, device=self.device)

    def ids_at(self, kind: int, flat_positions: torch.Tensor, n: int) -> torch.Tensor:
        return torch.randint(0, n, (flat_positions.numel(),), generator=self.gen, device=self.device)


class _HashDraws:
    """Keyed masking: the draw of kind k at (row b, position j) is hash(seed, k, sample_ids[b], j).

    On a GPU each elementwise op is a kernel launch of a few microseconds of host time, and the masks
    are made after the step's one wait for the device, with nothing queued to hide them behind: so the
    row keys of every kind are made together ([kinds, B], one pass of the hash), and the position
    terms of the chosen positions once for the two draws taken there (what each token becomes)."""

    def __init__(self, seed: int, sample_ids: torch.Tensor, seq_len: int):
        self.seed, self.ids, self.seq_len = int(seed), sample_ids, seq_len
        seed_state = _absorb(0x9E3779B9, self.seed & ((1 << 64) - 1))  # Python ints
        # Filled with Python ints as the fill kernel's argument: torch.tensor(..., device=) or
        # ``heads[k] = int`` would be a copy from host memory, which waits for the device's queue.
        heads = torch.empty(_KINDS, 1, dtype=torch.long, device=sample_ids.device)
        for kind in range(1, _KINDS + 1):
            heads[kind - 1].fill_(_absorb(seed_state, kind))
        self._keys = _absorb(heads, sample_ids[None, :])
        self._at: tuple | None = None  # (flat positions, their rows, their position terms)

    def _hash(self, kind: int, rows: torch.Tensor, position_terms: torch.Tensor) -> torch.Tensor:
        return _mix32(self._keys[kind - 1][rows] ^ position_terms)

    def _at_positions(self, flat_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._at is None or self._at[0] is not flat_positions:
            cols = flat_positions % self.seq_len
            self._at = (flat_positions, flat_positions // self.seq_len, _position_terms(cols))
        return self._at[1], self._at[2]

    def tokens(self, kind: int, shape) -> torch.Tensor:
        b, length = shape
        rows = torch.arange(b, device=self.ids.device)[:, None]
        return _uniform24(
            self._hash(kind, rows, _position_terms(torch.arange(length, device=self.ids.device))[None, :])
        )

    def rows(self, kind: int, b: int) -> torch.Tensor:
        # every row's position 0: the position term is a constant
        h = self._hash(kind, torch.arange(b, device=self.ids.device), _position_terms(0))
        return h.double() * (1.0 / (1 << 32))

    def at(self, kind: int, flat_positions: torch.Tensor) -> torch.Tensor:
        return _uniform24(self._hash(kind, *self._at_positions(flat_positions)))

    def ids_at(self, kind: int, flat_positions: torch.Tensor, n: int) -> torch.Tensor:
        # (h * n) >> 32 maps 32 uniform bits onto [0, n) (n < 2**31: the product fits in int64)
        return (self._hash(kind, *self._at_positions(flat_positions)) * n) >> 32


def _position_terms(cols):
    """What a position (an int64 tensor or a Python int) adds to every kind's hash."""
    return _mix32(cols + 0x2F1D7A3B)


def mask_seed(seed: int, step: int, rank: int, micro_step: int) -> int:
    """A well-mixed 63-bit seed from the tuple: nearby tuples give unrelated streams."""
    return derive_seed("mlm-mask", seed, step, rank, micro_step)


def mask_generator(
    seed: int, step: int, rank: int, micro_step: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(mask_seed(seed, step, rank, micro_step))
    return gen


def rate_at_step(cfg: MaskingConfig, step: int, max_steps: int) -> float:
    """The masking rate of optimiser step ``step`` (0-based): ``rate`` throughout, or with
    ``rate_end`` set, linear from ``rate`` at step 0 to ``rate_end`` at the last step, max_steps - 1.
    A function of (step, max_steps) alone, so a resume masks as the uninterrupted run; a resume with a
    longer max_steps recomputes it for the new end, as the learning-rate schedule does."""
    if cfg.rate_end is None:
        return cfg.rate
    progress = min(1.0, step / max(1, max_steps - 1))
    return cfg.rate + (cfg.rate_end - cfg.rate) * progress


def eval_masking_config(cfg: MaskingConfig | None = None) -> MaskingConfig:
    """Evaluation always masks 15% of tokens, 80/10/10, dynamically with a fixed seed, whatever
    training uses, so eval losses compare across runs with different masking settings.
    Variable-count selection (not fixed_count) so the eval masks do not depend on that speed switch
    either."""
    return MaskingConfig(
        rate=0.15,
        mask_replace_prob=0.8,
        random_replace_prob=0.1,
        strategy="token",
        fixed_count=False,
        dynamic=True,
        seed=EVAL_MASK_SEED,
    )


def _to_non_special(r: torch.Tensor, special: SpecialIds) -> torch.Tensor:
    """Map [0, V - k) monotonically onto the non-special ids: step over each special, in ascending order."""
    for s in special.all_special:
        r += (r >= s).long()
    return r


def random_non_special(n: int, special: SpecialIds, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``n`` ids uniform over the vocabulary minus the special ids."""
    r = torch.randint(0, special.vocab_size - len(special.all_special), (n,), generator=generator, device=device)
    return _to_non_special(r, special)


def _check_inputs(
    input_ids: torch.Tensor, word_starts: torch.Tensor, cfg: MaskingConfig, sample_ids: torch.Tensor | None
) -> None:
    if input_ids.dim() != 2 or word_starts.shape != input_ids.shape:
        raise ValueError(
            f"mask_batch: expected input_ids and word_starts of one shape [B, L], got "
            f"{tuple(input_ids.shape)} and {tuple(word_starts.shape)}"
        )
    if cfg.fixed_count and cfg.strategy != "token":
        raise ValueError(
            f"masking.fixed_count works with strategy 'token' only (got {cfg.strategy!r}): "
            "whole words and spans cannot fill an exact token count without bias"
        )
    if sample_ids is not None and sample_ids.shape != (input_ids.shape[0],):
        raise ValueError(
            f"mask_batch: sample_ids must have shape [{input_ids.shape[0]}] (one stable id per row), "
            f"got {tuple(sample_ids.shape)}"
        )


def _draws(
    ids: torch.Tensor,
    cfg: MaskingConfig,
    generator: torch.Generator | None,
    sample_ids: torch.Tensor | None,
    step: int | None,
):
    """Keyed draws (a hash of seed, sample id, position: the same for a row wherever it lands), or a
    generator's for callers without sample ids."""
    if not cfg.dynamic or (sample_ids is not None and step is not None):
        if sample_ids is None:
            raise ValueError("mask_batch: masking.dynamic=false needs sample_ids (one stable id per row)")
        key = derive_seed("mask", cfg.seed, step) if cfg.dynamic else cfg.seed
        return _HashDraws(key, sample_ids.to(ids.device, torch.long), ids.shape[1])
    if generator is None:
        raise ValueError("mask_batch: dynamic masking needs sample_ids and step, or a generator")
    return _GeneratorDraws(generator, ids.device)


def mask_batch(
    input_ids: torch.Tensor,
    word_starts: torch.Tensor,
    special: SpecialIds,
    cfg: MaskingConfig,
    generator: torch.Generator | None = None,
    sample_ids: torch.Tensor | None = None,
    step: int | None = None,
    rate: float | None = None,
) -> MaskedBatch:
    """Choose ``cfg.rate`` of the tokens per ``cfg.strategy`` (the prediction targets), then replace
    mask_replace_prob of them by [MASK], random_replace_prob by a random non-special id, and keep the rest visible.
    ``input_ids`` is not modified.

    With ``sample_ids`` ([B] int64, a stable identity of each row's sequence) every draw is a hash
    of (seed, sample id, position): static masking (``cfg.dynamic`` false) keys it by the sequence
    alone, dynamic masking by the sequence and ``step``. A row's mask then depends on nothing else,
    neither the rank nor the micro-batch it lands in, so a run resumed at another world size or
    micro-batch masks exactly as the uninterrupted one (the trainer always masks this way).
    Without ``sample_ids``, dynamic masking draws from ``generator`` (on the inputs' device).
    ``rate`` replaces ``cfg.rate`` (a scheduled rate, ``rate_at_step``); fixed_count then keeps the
    slots of the highest rate of the schedule, so shapes stay static over the run."""
    _check_inputs(input_ids, word_starts, cfg, sample_ids)
    slot_rate = max(cfg.rate, cfg.rate_end or 0.0, rate or 0.0)
    if rate is not None:
        cfg = dataclasses.replace(cfg, rate=rate)
    ids = input_ids.long()
    draws = _draws(ids, cfg, generator, sample_ids, step)
    special_tok = special.is_special(ids)
    flat_ids = ids.reshape(-1)

    if cfg.fixed_count:
        positions, labels = _choose_fixed(special_tok, flat_ids, cfg.rate, draws, slot_rate)
        valid = labels != IGNORE_INDEX
        num_masked = valid.sum()
    else:
        chosen = {"token": _choose_tokens, "whole_word": _choose_words, "span": _choose_spans}[cfg.strategy](
            special_tok, word_starts.bool(), cfg, draws
        )
        positions = chosen.reshape(-1).nonzero().squeeze(1)  # host sync: N is data-dependent
        labels = flat_ids[positions]
        valid = None
        # A fill with a Python int, not torch.tensor(n, device=): no copy from host memory to wait on
        num_masked = torch.full((), positions.numel(), dtype=torch.long, device=ids.device)

    action = draws.at(_ACTION, positions)
    replacement = _to_non_special(
        draws.ids_at(_REPLACEMENT, positions, special.vocab_size - len(special.all_special)), special
    )
    new = torch.where(
        action < cfg.mask_replace_prob,
        torch.full_like(labels, special.mask),
        torch.where(action < cfg.mask_replace_prob + cfg.random_replace_prob, replacement, flat_ids[positions]),
    )
    if valid is not None:
        new = torch.where(valid, new, flat_ids[positions])
    masked = flat_ids.clone()
    masked[positions] = new
    return MaskedBatch(masked.view_as(ids), positions, labels, num_masked)


def split_rows(m: MaskedBatch, rows: list[int], fixed_count: bool) -> list[MaskedBatch]:
    """``m``, the masks of micro-batches of ``rows`` rows each stacked in order, as masking each alone
    gives them (keyed masks depend on a row's sample id and position, not on its batch): positions
    re-based to each part's rows. With ``fixed_count`` (the same number of slots in every row) the
    parts' boundaries are known on the host; otherwise they are read once from the device, where the
    variable count was already read (``nonzero``)."""
    if len(rows) == 1:
        return [m]
    seq_len = m.input_ids.shape[1]
    firsts = [sum(rows[:i]) * seq_len for i in range(len(rows))]  # each part's first flat index
    if fixed_count:
        slots = m.positions.numel() // sum(rows)
        counts = [r * slots for r in rows]
    else:
        ends = torch.searchsorted(m.positions, _part_ends(rows, seq_len, m.positions.device)).tolist()
        counts = [e - s for e, s in zip(ends, [0] + ends[:-1])]
    positions, labels = m.positions.split(counts), m.labels.split(counts)
    used = (m.labels != IGNORE_INDEX).split(counts)
    return [
        MaskedBatch(ids, p - first, lab, u.sum())
        for ids, p, lab, u, first in zip(m.input_ids.split(rows), positions, labels, used, firsts)
    ]


def _part_ends(rows: list[int], seq_len: int, device) -> torch.Tensor:
    """The flat index after each part's last token, made on the device (no copy from host memory,
    which would wait for the device's queue): the trainer's micro-batches are all alike."""
    if len(set(rows)) == 1:
        return torch.arange(1, len(rows) + 1, device=device) * (rows[0] * seq_len)
    ends = torch.empty(len(rows), dtype=torch.long, device=device)
    for i in range(len(rows)):
        ends[i] = sum(rows[: i + 1]) * seq_len
    return ends


def _choose_tokens(special_tok, word_starts, cfg, draws):
    return (draws.tokens(_CHOOSE, special_tok.shape) < cfg.rate) & ~special_tok


def _unit_starts(special_tok: torch.Tensor, word_starts: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: where a word (or a special token, a unit of its own) begins."""
    after_boundary = torch.ones_like(special_tok)
    after_boundary[:, 1:] = special_tok[:, :-1]
    return word_starts | special_tok | after_boundary


def _start_of_unit(unit_start: torch.Tensor) -> torch.Tensor:
    """Flat index of the start of each token's unit: a running maximum, no loop. Units never cross
    rows (a row's first token starts one), so static masks depend on the row alone."""
    flat = unit_start.reshape(-1)
    idx = torch.arange(flat.numel(), device=flat.device)
    return torch.cummax(torch.where(flat, idx, torch.zeros_like(idx)), dim=0).values


def _choose_words(special_tok, word_starts, cfg, draws):
    start = _start_of_unit(_unit_starts(special_tok, word_starts))
    u = draws.tokens(_CHOOSE, special_tok.shape).reshape(-1)
    return ((u[start] < cfg.rate) & ~special_tok.reshape(-1)).view_as(special_tok)


def span_segments(special_tok: torch.Tensor, word_starts: torch.Tensor, cfg: MaskingConfig, draws) -> torch.Tensor:
    """Flat index of the first token of each token's candidate span (see the module docstring).
    ``draws``: a torch.Generator, or the draw source ``mask_batch`` made."""
    device = special_tok.device
    if isinstance(draws, torch.Generator):
        draws = _GeneratorDraws(draws, device)
    first_after_boundary = torch.ones_like(special_tok)
    first_after_boundary[:, 1:] = special_tok[:, :-1]
    word_start = (_unit_starts(special_tok, word_starts) & ~special_tok).reshape(-1)
    first_after_boundary = first_after_boundary.reshape(-1)
    u = draws.tokens(_SPAN_CUT, special_tok.shape).reshape(-1)
    random_cut = word_start & (first_after_boundary | (u < cfg.span_geometric_p))
    word_no = torch.cumsum(word_start.long(), 0)  # same for every piece of a word
    last_cut = torch.cummax(torch.where(random_cut, word_no, torch.zeros_like(word_no)), 0).values
    since = word_no - last_cut  # words since the last random cut
    clip_cut = word_start & (since > 0) & (since % cfg.span_max == 0)
    cut = random_cut | clip_cut | special_tok.reshape(-1)
    idx = torch.arange(cut.numel(), device=device)
    return torch.cummax(torch.where(cut, idx, torch.zeros_like(idx)), 0).values


def _choose_spans(special_tok, word_starts, cfg, draws):
    seg = span_segments(special_tok, word_starts, cfg, draws)
    u = draws.tokens(_SPAN_COIN, special_tok.shape).reshape(-1)
    if cfg.rate <= 0.25:
        q = (1.0 - (1.0 - 4.0 * cfg.rate) ** 0.5) / 2.0  # q (1 - q) = rate
        coin = u < q
        prev_seg = seg[(seg - 1).clamp(min=0)]
        chosen_seg = coin[seg] & ~(coin[prev_seg] & (seg > 0))
    else:
        chosen_seg = (u < cfg.rate)[seg]
    return (chosen_seg & ~special_tok.reshape(-1)).view_as(special_tok)


def _choose_fixed(special_tok, flat_ids, rate, draws, slot_rate):
    b, length = special_tok.shape
    slots = min(length, max(1, math.ceil(slot_rate * length - 1e-9)))
    choosable = (~special_tok).sum(1)
    dither = draws.rows(_FIXED_DITHER, b)
    fill = torch.floor(choosable.double() * rate + dither).long().clamp(max=slots)  # [B]
    scores = draws.tokens(_FIXED_SCORE, special_tok.shape)
    scores = scores.masked_fill(special_tok, -1.0)  # specials rank last, never filled
    top = scores.topk(slots, dim=1).indices  # best first: slot j is filled iff j < fill
    filled = torch.arange(slots, device=top.device)[None, :] < fill[:, None]
    order = top.argsort(dim=1)
    top, filled = top.gather(1, order), filled.gather(1, order)
    positions = (top + torch.arange(b, device=top.device)[:, None] * length).reshape(-1)
    labels = torch.where(filled.reshape(-1), flat_ids[positions], torch.full_like(positions, IGNORE_INDEX))
    return positions, labels
