"""Masking statistics on real tokenized Wikipedia text (bert-base-uncased WordPiece), 128-token rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from data_prep.common.errors import ShardError
from data_prep.common.manifest import FORMAT_VERSION, Manifest
from pretrain.config.schema import MaskingConfig
from pretrain.model.masking import (
    IGNORE_INDEX,
    SpecialIds,
    eval_masking_config,
    mask_batch,
    mask_generator,
    mask_seed,
    random_non_special,
    span_segments,
)

SEQ_LEN = 128
SPECIAL = SpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103, vocab_size=30522)  # bert-base-uncased's


def pack_rows(articles, tok_dir, min_tokens: int, seq_len: int = SEQ_LEN):
    """[CLS] piece... [SEP] rows, documents separated by [SEP], the last row padded, as data prep does."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ids, starts = [], []
    for enc in tok.encode_batch([text for _, text in articles], add_special_tokens=False):
        prev = None
        for i, w in zip(enc.ids, enc.word_ids):
            ids.append(i)
            starts.append(w != prev)
            prev = w
        ids.append(SPECIAL.sep)
        starts.append(False)
        if len(ids) >= min_tokens:
            break
    body = seq_len - 2
    rows_ids, rows_starts = [], []
    for k in range(0, len(ids), body):
        chunk, chunk_starts = ids[k : k + body], starts[k : k + body]
        pad = body - len(chunk)
        rows_ids.append([SPECIAL.cls] + chunk + [SPECIAL.sep] + [SPECIAL.pad] * pad)
        rows_starts.append([False] + chunk_starts + [False] * (pad + 1))
    return torch.tensor(rows_ids), torch.tensor(rows_starts)


@pytest.fixture(scope="module")
def rows(wiki_articles, bert_uncased_dir):
    ids, starts = pack_rows(wiki_articles, bert_uncased_dir, min_tokens=130_000)
    assert ids[-1, -1] == SPECIAL.pad and (ids == SPECIAL.unk).any()  # a padded row, real [UNK]s
    return ids, starts


def choosable(ids):
    return ~SPECIAL.is_special(ids)


def unit_ids(ids, starts):
    """Numbers each word (a special token is a unit of its own), the way the masking module defines words."""
    special = SPECIAL.is_special(ids)
    after = torch.ones_like(special)
    after[:, 1:] = special[:, :-1]
    return (torch.cumsum((starts | special | after).reshape(-1).long(), 0) - 1).numpy()


def run(ids, starts, cfg, step=0, rank=0, micro=0):
    return mask_batch(ids, starts, SPECIAL, cfg, mask_generator(cfg.seed, step, rank, micro))


def chosen_mask(ids, m):
    sel = torch.zeros(ids.numel(), dtype=torch.bool)
    sel[m.positions[m.labels != IGNORE_INDEX]] = True
    return sel.view_as(ids)


def check_common(ids, m, cfg):
    """Invariants of every strategy; returns (rate, mask, random, unchanged) fractions."""
    flat, new = ids.reshape(-1), m.input_ids.reshape(-1)
    used = m.labels != IGNORE_INDEX
    pos = m.positions[used]
    assert torch.all(pos[1:] > pos[:-1]), "positions ascending and unique"
    assert torch.equal(m.labels[used], flat[pos])
    assert not SPECIAL.is_special(flat[pos]).any(), "a special token was chosen"
    changed = (new != flat).nonzero().squeeze(1)
    assert torch.isin(changed, pos).all(), "a token changed that was not chosen"
    assert int(m.num_masked) == pos.numel()
    out = new[pos]
    is_mask = out == SPECIAL.mask
    kept = out == flat[pos]
    rand = ~is_mask & ~kept
    assert not SPECIAL.is_special(out[rand]).any(), "a random replacement is a special id"
    n = pos.numel()
    return n / int(choosable(ids).sum()), is_mask.sum().item() / n, rand.sum().item() / n, kept.sum().item() / n


def test_token_strategy_rates_on_real_text(rows):
    ids, starts = rows
    cfg = MaskingConfig(seed=3)
    assert int(choosable(ids).sum()) > 100_000
    for step in range(2):
        rate, p_mask, p_rand, p_keep = check_common(ids, run(ids, starts, cfg, step=step), cfg)
        assert abs(rate - 0.15) < 0.005
        assert abs(p_mask - 0.8) < 0.015 and abs(p_rand - 0.1) < 0.015 and abs(p_keep - 0.1) < 0.015


def test_other_rates_and_split(rows):
    ids, starts = rows
    cfg = MaskingConfig(rate=0.3, mask_replace_prob=0.5, random_replace_prob=0.3, seed=1)
    rate, p_mask, p_rand, p_keep = check_common(ids, run(ids, starts, cfg), cfg)
    assert abs(rate - 0.3) < 0.005
    assert abs(p_mask - 0.5) < 0.015 and abs(p_rand - 0.3) < 0.015 and abs(p_keep - 0.2) < 0.015


def test_whole_word_all_or_none_and_rate(rows):
    ids, starts = rows
    cfg = MaskingConfig(strategy="whole_word", seed=5)
    units = unit_ids(ids, starts)
    sizes = np.bincount(units)
    assert (sizes > 1).sum() > 3000, "the text has thousands of multi-piece words"
    rates = []
    for step in range(3):
        m = run(ids, starts, cfg, step=step)
        rate, p_mask, p_rand, p_keep = check_common(ids, m, cfg)
        rates.append(rate)
        chosen_per_unit = np.bincount(units, weights=chosen_mask(ids, m).reshape(-1).numpy().astype(float))
        assert np.all((chosen_per_unit == 0) | (chosen_per_unit == sizes)), "a word was partly chosen"
        multi = (sizes > 1) & (chosen_per_unit > 0)
        assert multi.sum() > 300, "multi-piece words do get chosen"
        assert abs(p_mask - 0.8) < 0.015 and abs(p_rand - 0.1) < 0.015
    # each word with probability rate: unbiased in tokens, with more variance than per token
    assert abs(np.mean(rates) - 0.15) < 0.005
    assert all(abs(r - 0.15) < 0.01 for r in rates)


def observed_span_pmf(words_left, p, k_max):
    """[n, k_max]: P(observed length = k) of a span drawn as min(Geometric(p), k_max) words that
    starts with ``words_left`` words before the next special token, which truncates it."""
    k = np.arange(1, k_max + 1)
    pmf = p * (1 - p) ** (k - 1.0)
    pmf[-1] = (1 - p) ** (k_max - 1)
    at_least = (1 - p) ** (k - 1.0)  # P(D >= k)
    r = np.asarray(words_left)[:, None]
    return np.where(k < r, pmf, 0.0) + np.where(k == r, at_least, 0.0)


def unit_layout(ids, starts):
    """Per unit (word or special token): is it special, and the words from it to the next special."""
    units = unit_ids(ids, starts)
    flat_special = SPECIAL.is_special(ids).reshape(-1).numpy()
    unit_special = np.zeros(units[-1] + 1, bool)
    unit_special[units[flat_special]] = True
    special_at = np.nonzero(unit_special)[0]
    i = np.arange(len(unit_special))
    next_special = np.r_[special_at, len(i)][np.searchsorted(special_at, i)]
    return units, unit_special, next_special - i


def check_lengths(lengths, words_left, p, k_max):
    expected = observed_span_pmf(words_left, p, k_max).sum(0)
    observed = np.bincount(lengths, minlength=k_max + 1)[1:]
    assert observed.sum() == len(lengths) and len(observed) == k_max
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 35, (chi2, observed, expected.round())  # k_max - 1 dof: p < 1e-4 at 35
    mean_expected = (expected * np.arange(1, k_max + 1)).sum() / expected.sum()
    assert abs(lengths.mean() / mean_expected - 1) < 0.02
    return mean_expected


def test_span_segments_have_clipped_geometric_lengths(rows):
    ids, starts = rows
    special = SPECIAL.is_special(ids)
    units, unit_special, words_left = unit_layout(ids, starts)
    first_token = np.r_[0, np.nonzero(np.diff(units))[0] + 1]  # of each unit
    for p, k_max in [(0.2, 10), (0.5, 3)]:
        cfg = MaskingConfig(strategy="span", span_geometric_p=p, span_max=k_max)
        seg = span_segments(special, starts, cfg, mask_generator(0, 0, 0, 0)).numpy()
        assert np.array_equal(seg, seg[first_token][units]), "a segment holds whole words"
        opens = seg[first_token] == first_token  # unit starts a segment
        assert opens[unit_special].all(), "a special token is a segment of its own"
        seg_first_unit = np.nonzero(opens & ~unit_special)[0]
        _, lengths = np.unique(seg[first_token][~unit_special], return_counts=True)
        assert len(lengths) == len(seg_first_unit) > 10_000
        assert lengths.max() == k_max
        mean = check_lengths(lengths, words_left[seg_first_unit], p, k_max)
        # away from specials the mean is the clipped geometric's
        assert 0.93 < mean / ((1 - (1 - p) ** k_max) / p) <= 1.0


def test_span_strategy_rate_and_runs(rows):
    ids, starts = rows
    cfg = MaskingConfig(strategy="span", seed=7)  # p 0.2, max 10: mean 4.46 words
    units, unit_special, words_left = unit_layout(ids, starts)
    sizes = np.bincount(units)
    rates, runs_len, runs_left = [], [], []
    for step in range(4):
        m = run(ids, starts, cfg, step=step)
        rate, p_mask, p_rand, _ = check_common(ids, m, cfg)
        rates.append(rate)
        assert abs(p_mask - 0.8) < 0.015 and abs(p_rand - 0.1) < 0.015
        chosen = np.bincount(units, weights=chosen_mask(ids, m).reshape(-1).numpy().astype(float))
        assert np.all((chosen == 0) | (chosen == sizes)), "spans are made of whole words"
        # runs of consecutive chosen words (a special token is a unit, so it ends a run)
        edges = np.diff(np.r_[0, (chosen > 0).astype(int), 0])
        begin, end = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
        runs_len.append(end - begin)
        runs_left.append(words_left[begin])
    lengths = np.concatenate(runs_len)
    assert lengths.max() == cfg.span_max, "chosen spans never touch, so no run exceeds span_max words"
    assert abs(np.mean(rates) - 0.15) < 0.005 and all(abs(r - 0.15) < 0.01 for r in rates)
    check_lengths(lengths, np.concatenate(runs_left), cfg.span_geometric_p, cfg.span_max)


def test_span_rate_above_quarter(rows):
    ids, starts = rows
    cfg = MaskingConfig(strategy="span", rate=0.4, seed=2)
    rate, *_ = check_common(ids, run(ids, starts, cfg), cfg)
    assert abs(rate - 0.4) < 0.01


def test_same_seed_same_mask_other_tuple_other_mask(rows):
    ids, starts = rows[0][:64], rows[1][:64]
    for strategy in ("token", "whole_word", "span"):
        cfg = MaskingConfig(strategy=strategy, seed=11)
        a, b = run(ids, starts, cfg, step=4), run(ids, starts, cfg, step=4)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
        for other in (
            run(ids, starts, cfg, step=5),
            run(ids, starts, cfg, step=4, rank=1),
            run(ids, starts, cfg, step=4, micro=1),
            run(ids, starts, MaskingConfig(strategy=strategy, seed=12), step=4),
        ):
            assert not torch.equal(a.positions, other.positions)
    seeds = {mask_seed(0, s, r, i) for s in range(50) for r in range(4) for i in range(4)}
    assert len(seeds) == 800 and max(seeds) < 2**63


def test_random_replacements_uniform_over_non_special():
    small = SpecialIds(pad=0, unk=1, cls=5, sep=6, mask=9, vocab_size=10)
    draws = random_non_special(100_000, small, mask_generator(0, 0, 0, 0), torch.device("cpu"))
    counts = np.bincount(draws.numpy(), minlength=10)
    assert counts[list(small.all_special)].sum() == 0
    allowed = counts[[2, 3, 4, 7, 8]] / 100_000
    assert np.abs(allowed - 0.2).max() < 0.006
    # the real vocabulary: 1e6 draws in 100 equal id bins, chi-square against uniform
    draws = random_non_special(1_000_000, SPECIAL, mask_generator(1, 0, 0, 0), torch.device("cpu")).numpy()
    assert not np.isin(draws, SPECIAL.all_special).any() and draws.min() >= 0 and draws.max() < 30522
    assert draws.min() == 1 and draws.max() == 30521
    bins = np.bincount(draws * 100 // 30522, minlength=100)
    allowed_ids = np.setdiff1d(np.arange(30522), SPECIAL.all_special)
    expected = np.bincount(allowed_ids * 100 // 30522, minlength=100) * (1_000_000 / len(allowed_ids))
    chi2 = ((bins - expected) ** 2 / expected).sum()
    assert chi2 < 150, chi2  # 99 dof: p ~ 0.001 at 150


def test_fixed_count_static_shapes(rows):
    ids, starts = rows
    cfg = MaskingConfig(fixed_count=True, seed=9)
    slots = math.ceil(0.15 * SEQ_LEN)  # 20
    tail = slice(len(ids) - 32, len(ids))  # ends with the padded row
    assert (ids[tail][-1] == SPECIAL.pad).sum() > 10
    shapes = set()
    for batch in (slice(0, 32), slice(32, 64), tail):
        bid, bst = ids[batch], starts[batch]
        m = run(bid, bst, cfg)
        shapes.add((tuple(m.positions.shape), tuple(m.labels.shape)))
        check_common(bid, m, cfg)
        filled = (m.labels != IGNORE_INDEX).view(len(bid), slots).sum(1)
        ideal = choosable(bid).sum(1).double() * 0.15  # stochastic rounding of this
        assert torch.all((filled == ideal.floor()) | (filled == ideal.ceil()))
        rows_of = m.positions.view(len(bid), slots) // SEQ_LEN
        assert torch.equal(rows_of, torch.arange(len(bid))[:, None].expand(-1, slots))
    assert shapes == {((32 * slots,), (32 * slots,))}
    rate, p_mask, p_rand, _ = check_common(ids, run(ids, starts, cfg), cfg)
    assert abs(rate - 0.15) < 0.002 and abs(p_mask - 0.8) < 0.015 and abs(p_rand - 0.1) < 0.015
    with pytest.raises(ValueError, match="fixed_count works with strategy 'token' only"):
        run(ids[:4], starts[:4], MaskingConfig(fixed_count=True, strategy="span"))


def test_eval_config_ignores_training_settings():
    ev = eval_masking_config(
        MaskingConfig(
            rate=0.4,
            mask_replace_prob=1.0,
            random_replace_prob=0.0,
            strategy="span",
            seed=77,
            fixed_count=True,
            dynamic=False,
        )
    )
    assert (ev.rate, ev.mask_replace_prob, ev.random_replace_prob, ev.strategy, ev.fixed_count, ev.dynamic) == (
        0.15,
        0.8,
        0.1,
        "token",
        False,
        True,
    )
    assert ev.seed == eval_masking_config(MaskingConfig()).seed and not ev.check()


def test_special_ids_from_manifest_errors():
    assert SPECIAL.all_special == (0, 100, 101, 102, 103)
    tokenizer = {
        "path": "tokenizer",
        "sha256": "ab" * 32,
        "vocab_size": 30522,
        "lowercase": True,
        "special_ids": {"pad": 0, "cls": 101, "sep": 102, "mask": 103},
        "special_tokens": {},
    }
    raw = {
        "format_version": FORMAT_VERSION,
        "seq_len": SEQ_LEN,
        "block_size": 256,
        "dtype": "uint16",
        "tokenizer": tokenizer,
        "num_tasks": 1,
        "shards": [],
        "totals": {},
        "settings": {},
    }
    with pytest.raises(ShardError, match=r"tokenizer.special_ids lacks \['unk'\]"):
        Manifest.from_dict(raw)
    tokenizer["special_ids"]["unk"] = 100
    assert SpecialIds.from_manifest(Manifest.from_dict(raw)) == SPECIAL
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=50, vocab_size=50)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_statistics(rows):
    ids, starts = rows[0].cuda(), rows[1].cuda()
    for strategy, fixed in (("token", False), ("token", True), ("whole_word", False), ("span", False)):
        cfg = MaskingConfig(strategy=strategy, fixed_count=fixed)
        m = mask_batch(ids, starts, SPECIAL, cfg, mask_generator(0, 0, 0, 0, ids.device))
        assert m.input_ids.is_cuda and m.positions.is_cuda
        m_cpu = type(m)(*(t.cpu() for t in (m.input_ids, m.positions, m.labels, m.num_masked)))
        rate, p_mask, p_rand, _ = check_common(ids.cpu(), m_cpu, cfg)
        assert abs(rate - 0.15) < 0.005 and abs(p_mask - 0.8) < 0.015 and abs(p_rand - 0.1) < 0.015
        again = mask_batch(ids, starts, SPECIAL, cfg, mask_generator(0, 0, 0, 0, ids.device))
        assert torch.equal(m.input_ids, again.input_ids)
        # static masks are integer arithmetic: the same on the GPU as on the CPU
        static_cfg = MaskingConfig(strategy=strategy, fixed_count=fixed, dynamic=False)
        sample_ids = torch.arange(len(ids)) + 2**33
        on_gpu = mask_batch(ids, starts, SPECIAL, static_cfg, sample_ids=sample_ids.cuda())
        on_cpu = mask_batch(ids.cpu(), starts.cpu(), SPECIAL, static_cfg, sample_ids=sample_ids)
        assert torch.equal(on_gpu.input_ids.cpu(), on_cpu.input_ids)
        assert torch.equal(on_gpu.positions.cpu(), on_cpu.positions)


# ------------------------------------------------------------------ prediction versus corruption
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_decoupled_prediction_and_corruption_rates(rows, dynamic):
    """Wettig et al.'s space: predict `rate` of the tokens, corrupt a share of those; 80/10/10 and
    100/0/0 are two of its points. Every share holds to +-0.5% of the choosable tokens."""
    ids, starts = rows
    n_tokens = int(choosable(ids).sum())
    assert n_tokens >= 100_000
    sample_ids = torch.arange(len(ids)) * 7919 + 12_345
    for rate, mask_replace_prob, random_replace_prob in [
        (0.15, 0.8, 0.1),
        (0.4, 1.0, 0.0),
        (0.4, 0.5, 0.0),
        (0.3, 0.0, 0.0),
        (0.2, 0.3, 0.5),
    ]:
        cfg = MaskingConfig(
            rate=rate,
            mask_replace_prob=mask_replace_prob,
            random_replace_prob=random_replace_prob,
            dynamic=dynamic,
            seed=21,
        )
        m = mask_batch(ids, starts, SPECIAL, cfg, mask_generator(cfg.seed, 0, 0, 0), sample_ids=sample_ids)
        predicted, p_mask, p_rand, p_keep = check_common(ids, m, cfg)
        point = (rate, mask_replace_prob, random_replace_prob)
        assert abs(predicted - rate) < 0.005, point
        assert abs(predicted * p_mask - rate * mask_replace_prob) < 0.005, point  # became [MASK]
        assert abs(predicted * p_rand - rate * random_replace_prob) < 0.005, point  # became a random token
        assert abs(predicted * p_keep - rate * (1 - mask_replace_prob - random_replace_prob)) < 0.005, (
            point
        )  # predicted, visible
        corrupted = (m.input_ids != ids).sum().item() / n_tokens
        assert abs(corrupted - rate * (mask_replace_prob + random_replace_prob)) < 0.005, point
        if mask_replace_prob == 1.0:
            assert p_mask == 1.0
        if mask_replace_prob + random_replace_prob == 0.0:
            assert torch.equal(m.input_ids, ids), "nothing corrupted: the input is the text itself"


# ------------------------------------------------------------------ static masking
def static(ids, starts, cfg, sample_ids, step=0, rank=0, micro=0):
    return mask_batch(ids, starts, SPECIAL, cfg, mask_generator(cfg.seed, step, rank, micro), sample_ids=sample_ids)


STRATEGIES = [("token", False), ("token", True), ("whole_word", False), ("span", False)]


@pytest.mark.parametrize("strategy,fixed", STRATEGIES)
def test_static_mask_belongs_to_the_sequence_not_to_the_step(rows, strategy, fixed):
    """The same sequence gets the same mask in another step, epoch (another batch, place in the
    batch, rank, micro-step) and process; dynamic masking gives it a new one each time."""
    ids, starts = rows[0][:96], rows[1][:96]
    sample_ids = torch.arange(96) + 5_000
    cfg = MaskingConfig(strategy=strategy, fixed_count=fixed, dynamic=False, seed=3)
    first = static(ids, starts, cfg, sample_ids, step=1)
    # "epoch 3": the rows come in another order, split into micro-batches of another size
    order = torch.randperm(96, generator=torch.Generator().manual_seed(1))
    again_rows = torch.empty_like(ids)
    again_chosen = torch.empty_like(ids, dtype=torch.bool)
    for k, part in enumerate(order.split(40)):
        torch.manual_seed(100 + k)  # the global RNG plays no part either
        m = static(ids[part], starts[part], cfg, sample_ids[part], step=700 + k, rank=k % 2, micro=k)
        again_rows[part], again_chosen[part] = m.input_ids, chosen_mask(ids[part], m)
    assert torch.equal(again_rows, first.input_ids) and torch.equal(again_chosen, chosen_mask(ids, first))
    # another sequence id, another mask; another masking seed, another mask
    assert not torch.equal(static(ids, starts, cfg, sample_ids + 1).input_ids, first.input_ids)
    assert not torch.equal(
        static(
            ids, starts, MaskingConfig(strategy=strategy, fixed_count=fixed, dynamic=False, seed=4), sample_ids
        ).input_ids,
        first.input_ids,
    )
    # dynamic masking: the same rows at another step are masked differently
    dyn = MaskingConfig(strategy=strategy, fixed_count=fixed, seed=3)
    a, b = static(ids, starts, dyn, sample_ids, step=1), static(ids, starts, dyn, sample_ids, step=2)
    assert not torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(static(ids, starts, dyn, sample_ids + 99, step=1).input_ids, a.input_ids), (
        "dynamic masking ignores sample ids"
    )


@pytest.mark.slow
def test_static_mask_is_the_same_in_a_fresh_process(rows):
    """What a resumed job does: a new process masks the same sequence exactly as before."""
    import subprocess
    import sys

    from conftest import REPO

    ids, starts = rows[0][:8], rows[1][:8]
    cfg = MaskingConfig(strategy="span", rate=0.3, dynamic=False, seed=9)
    here = static(ids, starts, cfg, torch.arange(8) * 3).input_ids
    code = (
        "import sys, torch; from pretrain.config.schema import MaskingConfig; "
        "from pretrain.model.masking import SpecialIds, mask_batch; "
        "ids, starts = torch.tensor(eval(sys.argv[1])), torch.tensor(eval(sys.argv[2])); "
        "sp = SpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103, vocab_size=30522); torch.manual_seed(5); "
        "cfg = MaskingConfig(strategy='span', rate=0.3, dynamic=False, seed=9); "
        "print(mask_batch(ids, starts, sp, cfg, sample_ids=torch.arange(8) * 3).input_ids.tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ids.tolist()), str(starts.tolist())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert torch.equal(torch.tensor(eval(out)), here)


@pytest.mark.parametrize("strategy,fixed", STRATEGIES)
def test_static_masking_statistics(rows, strategy, fixed):
    """Hash-drawn masks keep every strategy's rate and invariants; draws are independent across
    positions and across sequences."""
    ids, starts = rows
    cfg = MaskingConfig(strategy=strategy, fixed_count=fixed, dynamic=False, seed=13)
    sample_ids = torch.arange(len(ids)) + 2**40  # ids beyond 32 bits
    m = static(ids, starts, cfg, sample_ids)
    rate, p_mask, p_rand, p_keep = check_common(ids, m, cfg)
    assert abs(rate - 0.15) < (0.002 if fixed else 0.005 if strategy == "token" else 0.01), rate
    assert abs(p_mask - 0.8) < 0.015 and abs(p_rand - 0.1) < 0.015 and abs(p_keep - 0.1) < 0.015
    chosen = chosen_mask(ids, m)
    if strategy == "whole_word":
        units = unit_ids(ids, starts)
        per_unit = np.bincount(units, weights=chosen.reshape(-1).numpy().astype(float))
        assert np.all((per_unit == 0) | (per_unit == np.bincount(units))), "a word was partly chosen"
    if strategy == "token":
        # neighbours independent: P(chosen | left neighbour chosen) ~ rate
        ok = choosable(ids)[:, 1:] & choosable(ids)[:, :-1]
        both = (chosen[:, 1:] & chosen[:, :-1] & ok).sum().item()
        left = (chosen[:, :-1] & ok).sum().item()
        assert abs(both / left - 0.15) < 0.02, both / left
        # sequences independent: the same text under two ids overlaps as two independent masks do
        other = chosen_mask(ids, static(ids, starts, cfg, sample_ids + len(ids)))
        overlap = (chosen & other).sum().item() / int(choosable(ids).sum())
        assert abs(overlap - 0.15**2) < 0.003, overlap


def test_static_masking_needs_sample_ids(rows):
    ids, starts = rows[0][:4], rows[1][:4]
    cfg = MaskingConfig(dynamic=False)
    with pytest.raises(ValueError, match=r"masking.dynamic=false needs sample_ids"):
        mask_batch(ids, starts, SPECIAL, cfg, mask_generator(0, 0, 0, 0))
    with pytest.raises(ValueError, match=r"sample_ids must have shape \[4\]"):
        mask_batch(ids, starts, SPECIAL, cfg, sample_ids=torch.arange(3))
    with pytest.raises(ValueError, match="dynamic masking needs sample_ids and step, or a generator"):
        mask_batch(ids, starts, SPECIAL, MaskingConfig(), sample_ids=torch.arange(4))


@pytest.mark.parametrize("strategy", ["token", "whole_word", "span"])
def test_dynamic_masks_keyed_by_sample_do_not_depend_on_the_batch_layout(rows, strategy):
    """What the trainer does: a row's mask is a function of (seed, step, sample id) only, so the same
    step masks the same way at any world size or micro-batch, and another step masks differently."""
    ids, starts = rows[0][:8], rows[1][:8]
    sample_ids = torch.arange(8) * 101 + 7
    cfg = MaskingConfig(strategy=strategy, seed=5)

    def rows_masked(order, step):
        m = mask_batch(ids[order], starts[order], SPECIAL, cfg, sample_ids=sample_ids[order], step=step)
        return {int(sample_ids[order][r]): m.input_ids[r] for r in range(len(order))}

    whole = rows_masked(torch.arange(8), step=3)
    halves = {**rows_masked(torch.tensor([6, 1, 4, 3]), step=3), **rows_masked(torch.tensor([5, 0, 7, 2]), step=3)}
    assert all(torch.equal(whole[k], halves[k]) for k in whole)
    later = rows_masked(torch.arange(8), step=4)
    assert sum(not torch.equal(whole[k], later[k]) for k in whole) >= 6


# Digests of keyed masks as the trainer makes them (sample ids, step), taken before the masking was
# batched over a step's micro-batches and over the kinds of draw: a change that moves one bit would
# mask other tokens in every run resumed across it.
KEYED_MASK_DIGESTS = {
    ("token", False, True): "48ce75d6ad4a5159",
    ("token", False, False): "7dad48452b568527",
    ("token", True, True): "567a237140e0e79a",
    ("token", True, False): "2d581d2b7ce4c1af",
    ("whole_word", False, True): "807f37441693a4d3",
    ("whole_word", False, False): "c236b8e2f563967d",
    ("span", False, True): "a4d0a2b646af714d",
    ("span", False, False): "fc265108b030b672",
}


def keyed_rows():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1000, 30522, (6, 64), generator=g)
    ids[:, 0] = SPECIAL.cls
    ids[:, 40] = ids[:, -1] = SPECIAL.sep
    ids[5, 50:] = SPECIAL.pad
    starts = torch.rand(6, 64, generator=g) < 0.7
    return ids, starts, torch.tensor([3, 141, 59, 26535, 8979, 2**40 + 5])  # a 64-bit id too


def digest(m) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in (m.input_ids, m.positions, m.labels, m.num_masked.reshape(1)):
        h.update(t.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("strategy, fixed, dynamic", sorted(KEYED_MASK_DIGESTS))
def test_keyed_masks_keep_their_bits(strategy, fixed, dynamic):
    ids, starts, sample_ids = keyed_rows()
    cfg = MaskingConfig(rate=0.3, strategy=strategy, fixed_count=fixed, dynamic=dynamic, seed=11)
    m = mask_batch(ids, starts, SPECIAL, cfg, sample_ids=sample_ids, step=17)
    assert digest(m) == KEYED_MASK_DIGESTS[(strategy, fixed, dynamic)]


@pytest.mark.parametrize("strategy, fixed", [("token", False), ("token", True), ("whole_word", False), ("span", False)])
@pytest.mark.parametrize("rows_per_part", [[2, 2, 2], [1, 3, 2], [6]])
def test_micro_batches_masked_together_are_masked_as_each_alone(strategy, fixed, rows_per_part):
    """The trainer masks a step's micro-batches in one call (pretrain/step.py): split back, each part
    is what masking it alone gives, bit for bit, with its positions re-based to its own rows."""
    from pretrain.model.masking import split_rows

    ids, starts, sample_ids = keyed_rows()
    cfg = MaskingConfig(rate=0.3, strategy=strategy, fixed_count=fixed, seed=11)
    together = split_rows(mask_batch(ids, starts, SPECIAL, cfg, sample_ids=sample_ids, step=5), rows_per_part, fixed)
    first = 0
    assert len(together) == len(rows_per_part)
    for part, n in zip(together, rows_per_part):
        rows = slice(first, first + n)
        alone = mask_batch(ids[rows], starts[rows], SPECIAL, cfg, sample_ids=sample_ids[rows], step=5)
        for got, want in zip(
            (part.input_ids, part.positions, part.labels, part.num_masked),
            (alone.input_ids, alone.positions, alone.labels, alone.num_masked),
        ):
            assert torch.equal(got, want), (strategy, fixed, rows_per_part)
        first += n
