"""The quality model's cut, a step of the clusters stage: of the documents every other step kept, those the
model scores under its threshold (or outside the top ``keep_top`` percent), from each group's saved
scores; and what the report says of it (the cut, a histogram, a warning when it removed everything)."""

from __future__ import annotations

import logging

import numpy as np

from .work import Job, group_sig

log = logging.getLogger("data_prep")


QUALITY_BINS = 1 << 16  # --quality-keep-top cuts at a bin edge: a score resolution of 1.5e-5
REPORT_BINS = 20


def quality_model_cut(job: Job, groups, offsets, gone: np.ndarray) -> tuple[np.ndarray, dict]:
    """(the ids the quality model removes, what the report says of it): of the documents every other
    step kept (scored, not in ``gone``), those under the threshold, or under the score that keeps
    ``keep_top`` percent of them. Two passes over the groups' scores: memory is one group's."""
    m = job.s.quality_model
    if not m.path:
        return np.zeros(0, np.int64), {}

    def survivors(g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scores = group_sig(job, groups[g][0], "quality_scores").quality_scores
        alive = ~np.isnan(scores)
        lo, hi = np.searchsorted(gone, [offsets[g], offsets[g] + len(scores)])
        alive[gone[lo:hi] - offsets[g]] = False
        bins = np.minimum((np.nan_to_num(scores) * QUALITY_BINS).astype(np.int64), QUALITY_BINS - 1)
        return alive, scores, bins

    hist = np.zeros(QUALITY_BINS, np.int64)
    for g in range(len(groups)):
        alive, _, bins = survivors(g)
        hist += np.bincount(bins[alive], minlength=QUALITY_BINS)
    scored = int(hist.sum())
    kept_from = np.concatenate([np.cumsum(hist[::-1])[::-1], [0]])  # kept_from[b]: documents in bins >= b
    cut_bin = int(np.argmax(kept_from <= int(scored * m.keep_top / 100)))
    removed = []
    for g in range(len(groups)):
        alive, scores, bins = survivors(g)
        low = bins < cut_bin if m.keep_top else scores < m.threshold
        removed.append(np.flatnonzero(alive & low) + offsets[g])
    report = {
        "label": m.label,
        "threshold": m.threshold,
        "keep_top": m.keep_top,
        "cut": round(cut_bin / QUALITY_BINS, 5) if m.keep_top else m.threshold,  # removed: scores below it
        "scored": scored,
        "histogram": np.bincount(
            np.arange(QUALITY_BINS) * REPORT_BINS // QUALITY_BINS, weights=hist, minlength=REPORT_BINS
        )
        .astype(np.int64)
        .tolist(),  # of the scored documents, by score in 20 bins of 0.05
    }
    if scored and sum(len(r) for r in removed) == scored:
        # A damaged model, one trained for another label, or a threshold above every score: loud.
        report["warning"] = (
            f"the quality model removed every one of the {scored:,} documents it scored (cut {report['cut']}, "
            f"highest score {max(b for b in range(QUALITY_BINS) if hist[b]) / QUALITY_BINS:.2f}): check the "
            f"model and quality_model.label ({m.label}), and lower the threshold or use keep_top"
        )
        log.warning("clean: %s", report["warning"])
    return np.concatenate(removed), report
