"""Where a run's checkpoint files live: one ``train.out_dir`` every rank sees (a shared filesystem), or
one per node (node-local disks, e.g. ``/local/scratch/run`` on every node of a Slurm job).

Found out at start, not configured: the first rank writes a token into its ``train.out_dir`` and every
rank reads it back. On node-local disks DeepSpeed's ``use_node_local_storage`` makes each node's
first rank write the files that rank 0 writes on a shared filesystem (``mp_rank_00_model_states.pt``),
each node's first rank writes the checkpoint's side files, file list and ``COMPLETE`` beside its own
ranks' shards, and a conversion to another layout is made on every node. Each node's folder is then
a complete record of what its ranks need; rank 0's ``COMPLETE`` comes last, after every node's. What
needs every rank's shards in one place (an export) gathers them over the process group instead, and
a requeue onto other nodes finds them in ``train.checkpoint_mirror``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from data_prep.common.atomic import write_atomic
from pretrain.checkpoint.files import SHARED_PROBE, rank_of_file


@dataclass(frozen=True)
class NodeLayout:
    rank: int
    shared: bool  # every rank sees rank 0's train.out_dir
    leaders: tuple[int, ...]  # the first rank of each node, ascending (ranks are numbered node by node)
    world: int

    @property
    def writes_folder(self) -> bool:
        """This rank writes its folder's side files, COMPLETE and conversions (and uploads them)."""
        return self.rank == 0 or (not self.shared and self.rank in self.leaders)

    def node_ranks(self, rank: Optional[int] = None) -> range:
        """The ranks of ``rank``'s node (this rank's by default)."""
        rank = self.rank if rank is None else rank
        first = max(r for r in self.leaders if r <= rank)
        following = [r for r in self.leaders if r > first]
        return range(first, following[0] if following else self.world)


def single(rank: int = 0, world: int = 1) -> NodeLayout:
    """One folder for all: a single process, or tools that read a checkpoint offline."""
    return NodeLayout(rank, True, (0,), world)


def probe(out_dir: str | Path) -> NodeLayout:
    """Whether every rank sees rank 0's ``out_dir``, and which ranks lead their node. A collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    box = [uuid.uuid4().hex]
    dist.broadcast_object_list(box, src=0)
    path = Path(out_dir) / SHARED_PROBE
    if rank == 0:
        write_atomic(path, box[0])
    dist.barrier()
    try:
        sees = path.read_text() == box[0]
    except OSError:
        sees = False
    seen: list = [None] * world
    dist.all_gather_object(seen, (local_rank, sees))
    leaders = tuple(r for r, (lr, _) in enumerate(seen) if lr == 0)
    return NodeLayout(rank, all(s for _, s in seen), leaders or (0,), world)


def needed_by(names, ranks: Optional[range]) -> list[str]:
    """Of a checkpoint's file names, those that ``ranks`` load (all of them when ``ranks`` is None)."""
    return sorted(n for n in names if ranks is None or rank_of_file(n) is None or rank_of_file(n) in ranks)


def env_node_ranks() -> Optional[range]:
    """Before any process group: this node's ranks, from the launcher's RANK, LOCAL_RANK and LOCAL_SIZE
    (deepspeed's launcher; torchrun's LOCAL_WORLD_SIZE); None when they are not all known."""
    size = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    if size is None or "RANK" not in os.environ:
        return None
    first = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", "0"))
    return range(first, first + int(size))
