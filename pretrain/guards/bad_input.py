"""Bad input, reported once and never lost.

Found before the start (``report_before_start``): the first rank reports it, the others only if the
first did not (below).

Read mid-run by some ranks (a corrupt shard block, a token id beyond the vocabulary), in the
training or the evaluation split: every rank stops with exit 2 and the named error, not one rank
with the error and the others with a collective's traceback.

The rank that failed to read its micro-batches trains the step on placeholder rows (special tokens
only: nothing is masked, nothing is learnt) so that it makes the same collectives as the others; its
"bad input" flag rides on the step's existing flag all-reduce, the update is skipped everywhere, and
then, on this path only, every rank gathers the messages and prints them.

A store that stays unavailable past ``data.remote_timeout_s`` (``StoreUnavailable``) takes the same
path with a higher flag: every rank stops with exit 3 (requeue) instead, the checkpoint untouched.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from data_prep.common.errors import ShardError
from data_prep.common.storage import StoreUnavailable
from pretrain.model.masking import SpecialIds

BAD_INPUT_KEY = "bad_input"  # in a placeholder micro-batch: what this rank failed to read
OUTAGE_KEY = "store_unavailable"  # ... and whether because the data's store was down (exit 3, not 2)
BAD_INPUT, OUTAGE = 1.0, 2.0  # a step's failure level, max-reduced over the ranks

# How long a rank other than the first waits before it reports bad input itself (below).
OTHER_RANKS_REPORT_AFTER_S = 10.0


def report_before_start(exc: Exception, first_rank: bool) -> None:
    """The first rank reports; the others wait first. DeepSpeed's launcher kills every rank as soon
    as one exits non-zero: another rank exiting at once could cut the first one off before it prints,
    and the user would see only an exit code. In that time the first rank reports and exits, and the
    launcher ends the wait; a rank still here found a problem the first did not (its node's files)."""
    if not first_rank:
        time.sleep(OTHER_RANKS_REPORT_AFTER_S)
    prefix = "error" if first_rank else f"error (rank {os.environ.get('RANK')})"
    print(f"{prefix}: {exc}", file=sys.stderr, flush=True)


def next_micro_batches(batches, count: int, special: SpecialIds, micro_batch: int, seq_len: int) -> list[dict]:
    """The step's ``count`` micro-batches, or placeholders carrying the reading error's message. The
    stream never ends (it runs epoch after epoch): it stops only after such an error, and a step that
    logs nothing learns of the error a step later (pretrain/step.py, "Deferred reads"), after asking
    for the next step's batches, which are placeholders too."""
    try:
        return [next(batches) for _ in range(count)]
    except (ShardError, StoreUnavailable) as exc:
        message, outage = str(exc), isinstance(exc, StoreUnavailable)
    except StopIteration:
        message, outage = "the data stream stopped after a read error (named for the step before)", False
    placeholder = {
        "input_ids": torch.full((micro_batch, seq_len), special.cls, dtype=torch.long),
        "word_starts": torch.zeros(micro_batch, seq_len, dtype=torch.bool),
        "sample_ids": torch.zeros(micro_batch, dtype=torch.long),
        "has_padding": False,
        BAD_INPUT_KEY: message,
        OUTAGE_KEY: outage,
    }
    return [placeholder] * count


def failure_level(micro_batches: list[dict]) -> float:
    """0 (read), BAD_INPUT or OUTAGE: what this rank's reading of the step met."""
    if not any(BAD_INPUT_KEY in b for b in micro_batches):
        return 0.0
    return OUTAGE if any(b.get(OUTAGE_KEY) for b in micro_batches) else BAD_INPUT


def report(micro_batches: list[dict], rank: int, outage: bool = False) -> None:
    """Every rank prints every failing rank's error (a collective: call on all ranks)."""
    report_messages(next((b[BAD_INPUT_KEY] for b in micro_batches if BAD_INPUT_KEY in b), None), rank, outage)


def report_messages(mine: str | None, rank: int, outage: bool = False) -> None:
    """Every rank prints every rank's error (``mine``: this rank's, or None); a collective."""
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    for source, message in enumerate(messages):
        if message is not None:
            print(f"error: [read by rank {source}] {message}", file=sys.stderr, flush=True)
    why = ": the data's store is unavailable (exit 3, requeue)" if outage else " on bad input (exit 2)"
    print(f"[rank {rank}] stopping{why}; the last complete checkpoint is untouched", file=sys.stderr, flush=True)


class BadInputStop(Exception):
    """Bad input was read mid-run and reported on every rank: every rank exits with code 2 (3 where
    ``outage``: the data's store was down)."""

    def __init__(self, outage: bool = False):
        super().__init__("the data's store is unavailable" if outage else "bad input")
        self.outage = outage
