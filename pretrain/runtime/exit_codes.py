"""The trainer's exit codes, what launchers and schedulers act on (`pretrain.launch` says what each
means after a non-zero exit; `launchers/slurm/pretrain.sbatch` requeues on REQUEUE)."""

from __future__ import annotations

BAD_INPUT, REQUEUE, NONFINITE, SPIKES, MIRROR_BEHIND, DISK_FULL = 2, 3, 4, 5, 6, 7

MEANINGS = {
    BAD_INPUT: "bad input or settings, named above; nothing was lost",
    REQUEUE: "stopped to be relaunched: on a signal (after a checkpoint), or after a hang or a store outage "
    "(nothing new checkpointed; the lines above say which); relaunch the same command: it resumes from the "
    "last complete checkpoint (a requeue)",
    NONFINITE: "too many non-finite losses in a row; the last complete checkpoint is untouched",
    SPIKES: "loss spikes past train.spike_guard's limit; the last complete checkpoint is untouched",
    MIRROR_BEHIND: "the run ended as asked, but its newest checkpoint did not reach train.checkpoint_mirror "
    "(named above): it is only on local disk",
    DISK_FULL: "no space left on the run's disk while writing a checkpoint (named above); the previous complete "
    "checkpoint is intact: free space (or lower train.keep_checkpoints), then relaunch the same command; a "
    "requeue as it is would fill the disk again",
}
