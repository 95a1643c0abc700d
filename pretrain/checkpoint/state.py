"""Everything a resumed run needs besides the model and optimiser, in one object.

``TrainState`` is saved in every checkpoint (DeepSpeed's client state, key ``train_state``) and
loaded back in one place (``pretrain.train``'s resume). The data position is one global count of
samples consumed, so a run resumes at any world size or micro-batch on the same samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from pretrain.checkpoint.checkpointing import rng_state, set_rng_state

STATE_KEY = "train_state"


@dataclass
class TrainState:
    step: int = 0  # optimiser steps taken (skipped non-finite steps count)
    samples_consumed: int = 0  # sequences of the training split consumed, all ranks together
    tokens_seen: int = 0  # sequence slots consumed (padding included), all ranks together
    nonfinite_total: int = 0  # steps whose update was skipped for a non-finite loss
    run_id: Optional[str] = None  # the tracking run this job continues
    config: dict = field(default_factory=dict)  # the resolved config that wrote the checkpoint
    data: dict = field(default_factory=dict)  # the data stream's state_dict
    rng: dict = field(default_factory=dict)  # this rank's torch RNG states, taken when saved
    log_window: dict = field(default_factory=dict)  # the log window in progress (pretrain/tracking/resume_log.py)
    logged: dict = field(default_factory=dict)  # the metrics of the last step that logged, re-logged on resume
    # Loss-spike recoveries (pretrain.guards.spike_guard): each skipped window of global samples, and the
    # detector's recent losses, so that a resume sees and skips exactly what the first run did.
    skipped_windows: list = field(default_factory=list)
    spike_detector: dict = field(default_factory=dict)
    attention: str = ""  # the attention kernel the run started with (pretrain.runtime.attention)
    seconds: float = 0.0  # wall seconds of the run up to this checkpoint, every job before it included

    def state_dict(self) -> dict:
        """A snapshot, with the RNG states of this moment."""
        self.rng = rng_state()
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - set(asdict(self))
        if unknown:
            raise ValueError(f"train state has unknown keys {sorted(unknown)}: written by a newer version?")
        for key, value in state.items():
            setattr(self, key, value)
        if self.rng:
            set_rng_state(self.rng)
