"""How precise an accuracy measured on ``n`` test examples is: Wilson's score interval.

A probe scored on 133 held-out sentences (the demo's word-order task) moves by 0.0075 a sentence,
and the same encoder would score anywhere in about +-0.06 on another 133 sentences of the same
kind. Without that, 0.857 on one machine and 0.887 on another read as a difference; they are four
sentences. The interval is Wilson's (1927), the inverted score test of a binomial proportion: unlike
the normal approximation p +- z sqrt(p(1-p)/n), it stays inside [0, 1] and keeps its coverage near
0 and 1 and for small ``n``, where probes on a user's few hundred labels live.

It says how far one score may be from the encoder's accuracy on the task's whole population. Two
runs scored on the *same* test examples share that sampling, so their difference is known more
precisely than the two intervals suggest: intervals that do not overlap mean a real difference;
overlapping ones do not prove there is none (docs/evaluating.md).
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval
TEST_EXAMPLES = "test_examples"  # downstream/<task>/test_examples: n, logged with the baselines


def wilson(accuracy: float, examples: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of Wilson's interval for ``accuracy`` observed on ``examples`` test examples."""
    if examples <= 0 or not 0.0 <= accuracy <= 1.0:
        return float("nan"), float("nan")
    z2n = z * z / examples
    centre = (accuracy + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(accuracy * (1 - accuracy) / examples + z2n / (4 * examples)) / (1 + z2n)
    # exactly 0 and 1 at none and all right (the sums round a hair inside)
    return (0.0 if accuracy == 0 else centre - half), (1.0 if accuracy == 1 else centre + half)


def interval_text(accuracy: float, examples: int, what: str = "test examples") -> str:
    """``95% interval 0.788-0.907, 133 test examples``: the words after a score."""
    examples = int(examples)  # a float where it was read back from MLflow
    low, high = wilson(accuracy, examples)
    return f"95% interval {low:.3f}-{high:.3f}, {examples:,} {what}"
