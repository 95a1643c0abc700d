"""Every metric's name, in one place. A metric's name is its identity: the same in ``metrics.jsonl``,
MLflow, the console, the run report and a study's summary. The writers (the loop, the step, the
guards, the held-out and downstream evaluations, the data mixture) and the readers (the report, the
study summary, the console's closing line) import these; no other module spells one
(``tests/project/test_structure.py`` checks it).

Groups: ``train/`` the optimisation, ``perf/`` speed and memory, ``eval/`` the held-out MLM
evaluation (``eval/<source>/`` per source of a mixture), ``downstream/<task>/`` the probe and
fine-tune, ``health/<layer>/`` per-layer norms, ``data/<source>/`` a mixture's consumption,
``system/`` host metrics (named by MLflow's own monitor)."""

from __future__ import annotations

TRAIN_LOSS = "train/loss"
TRAIN_ACCURACY = "train/accuracy"  # of the logged step alone: the only step whose argmax is computed
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_MASK_RATE = "train/mask_rate"  # logged when masking.rate_end schedules it
TRAIN_TOKENS_SEEN = "train/tokens_seen"
TRAIN_NONFINITE_SKIPPED = "train/nonfinite_skipped"  # cumulative
TRAIN_SPIKE_RECOVERIES = "train/spike_recoveries"  # cumulative

PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_SAMPLES_PER_S = "perf/samples_per_s"
PERF_MFU = "perf/mfu"
PERF_STEP_TIME_S = "perf/step_time_s"
PERF_DATA_WAIT_S = "perf/data_wait_s"
PERF_MEMORY_GB = "perf/memory_gb"
PERF_MEMORY_CURRENT_GB = "perf/memory_current_gb"

EVAL = "eval"
EVAL_LOSS = "eval/loss"
EVAL_ACCURACY = "eval/accuracy"
DOWNSTREAM = "downstream"
SYSTEM = "system/"
SPIKE = "spike/"  # a spike event's own metrics, in the rows of runs that logged them


def heldout(prefix: str) -> tuple[str, str]:
    """The loss and accuracy names of a held-out evaluation under ``prefix`` (``eval``, ``eval/<source>``)."""
    return f"{prefix}/loss", f"{prefix}/accuracy"


def eval_source(source: str) -> str:
    """The prefix of one source's held-out figures in a mixture."""
    return f"{EVAL}/{source}"


def downstream(prefix: str, task: str, what: str) -> str:
    """``downstream/<task>/accuracy`` and the like (``prefix`` another group for the evaluate command)."""
    return f"{prefix}/{task}/{what}"


def health(layer: str, what: str) -> str:
    """``health/<layer>/grad_norm``, ``param_norm``, ``update_ratio``."""
    return f"health/{layer}/{what}"


def data_source(source: str, what: str) -> str:
    """``data/<source>/tokens``, ``epochs``, ``epochs_at_max_steps``."""
    return f"data/{source}/{what}"


def system(name: str) -> str:
    return f"{SYSTEM}{name}"
