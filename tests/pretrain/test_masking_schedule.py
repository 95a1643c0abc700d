"""The masking-rate schedule (masking.rate_end): linear from `rate` at step 0 to `rate_end` at the last
step, a pure function of (step, train.max_steps), measured on real tokenized Wikipedia rows at the
start and the end of a run, and usable as a study axis beside fixed rates."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import REPO
from pretrain.config.schema import MaskingConfig
from pretrain.model.masking import IGNORE_INDEX, mask_batch, rate_at_step
from test_masking import SPECIAL, pack_rows

MAX_STEPS = 1000


@pytest.fixture(scope="module")
def rows(wiki_articles, bert_uncased_dir):
    return pack_rows(wiki_articles, bert_uncased_dir, min_tokens=130_000)


def chosen_fraction(ids, m) -> float:
    used = m.labels != IGNORE_INDEX
    return used.sum().item() / (~SPECIAL.is_special(ids)).sum().item()


def test_rate_is_linear_from_rate_to_rate_end_over_the_run():
    cfg = MaskingConfig(rate=0.3, rate_end=0.15)
    assert rate_at_step(cfg, 0, MAX_STEPS) == 0.3
    assert rate_at_step(cfg, MAX_STEPS - 1, MAX_STEPS) == pytest.approx(0.15, abs=1e-12)
    assert rate_at_step(cfg, 333, MAX_STEPS) == pytest.approx(0.3 - 0.15 * 333 / 999, abs=1e-12)
    # A resume with a longer max_steps recomputes the rate for the new end (as the lr schedule does)
    assert rate_at_step(cfg, 999, 2000) == pytest.approx(0.3 - 0.15 * 999 / 1999, abs=1e-12)
    assert rate_at_step(MaskingConfig(rate=0.3), 999, MAX_STEPS) == 0.3  # no rate_end: fixed


@pytest.mark.parametrize("strategy,fixed", [("token", False), ("token", True), ("whole_word", False)])
def test_rate_holds_statistically_at_the_start_and_the_end(rows, strategy, fixed):
    ids, starts = rows
    cfg = MaskingConfig(rate=0.3, rate_end=0.15, strategy=strategy, fixed_count=fixed, seed=5)
    sample_ids = torch.arange(ids.shape[0])
    n = (~SPECIAL.is_special(ids)).sum().item()
    slots = set()
    for step, want in ((0, 0.3), (MAX_STEPS - 1, 0.15)):
        m = mask_batch(
            ids, starts, SPECIAL, cfg, sample_ids=sample_ids, step=step, rate=rate_at_step(cfg, step, MAX_STEPS)
        )
        # whole words come in clumps of ~1.3 tokens: a looser bound than independent tokens' 4 sigma
        sigma = math.sqrt(want * (1 - want) / n) * (2 if strategy == "whole_word" else 1)
        assert abs(chosen_fraction(ids, m) - want) < 4 * sigma, (step, chosen_fraction(ids, m), want)
        slots.add(m.positions.numel())
    if fixed:  # static shapes over the whole schedule: the slots of its highest rate
        assert slots == {ids.shape[0] * math.ceil(0.3 * ids.shape[1])}


def test_a_scheduled_step_masks_as_a_fixed_rate_of_that_value(rows):
    """Exact on resume: a step's mask depends on (sample ids, step, its rate) only, and that rate on
    (step, max_steps) only."""
    ids, starts = rows
    ids, starts = ids[:64], starts[:64]
    scheduled = MaskingConfig(rate=0.4, rate_end=0.1, seed=3)
    rate = rate_at_step(scheduled, 600, MAX_STEPS)
    a = mask_batch(ids, starts, SPECIAL, scheduled, sample_ids=torch.arange(64), step=600, rate=rate)
    b = mask_batch(ids, starts, SPECIAL, MaskingConfig(rate=rate, seed=3), sample_ids=torch.arange(64), step=600)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)


def test_rate_end_is_checked_and_is_a_study_axis(shards):
    from pretrain.config.loader import ConfigError
    from pretrain.study.plan import load_study

    assert MaskingConfig(rate_end=1.5).check() == ["rate_end: must be in (0, 1) or null, got 1.5"]
    study = load_study(
        str(REPO / "configs" / "study.yaml"),
        [
            f"data.dir={shards}",
            "model.max_position_embeddings=64",
            "masking.strategy=token",
            "masking.rate=0.3",
            "masking.rate_end=null,0.15",
        ],
    )
    assert [v.name for v in study.variants] == ["rate_end=None", "rate_end=0.15"]
    assert [(v.cfg.masking.rate, v.cfg.masking.rate_end) for v in study.variants] == [(0.3, None), (0.3, 0.15)]
    with pytest.raises(ConfigError, match=r"masking.rate_end: must be in \(0, 1\) or null, got 0.0"):
        load_study(str(REPO / "configs" / "study.yaml"), [f"data.dir={shards}", "masking.rate_end=0.0,0.15"])
