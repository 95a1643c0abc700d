"""The hang watchdog against a real gloo collective: the rank waiting for a hung peer exits 3 as the
peer does, even when the peer's exit breaks its collective before its own watchdog has ended it
(a Slurm job then requeues instead of failing with 1; issue of the CI run of 2026-11-28)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, free_port

# Each rank: one collective both finish, then rank 1 stops in "I/O" under its watchdog while rank 0
# waits for it in the next collective, handing a failure to exit_if_hung as the training loop does.
RANK = r"""
import sys, time
import torch, torch.distributed as dist
from pretrain.guards.watchdog import HangWatchdog

rank, port, out, hung, rank0_delay = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "hang", float(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))
if rank == 1:
    if not hung:
        sys.exit(1)  # a crash: no watchdog involved
    dog = HangWatchdog(2.0, out, rank, tracker=None, allowance_s=2.0)
    dog.step_started()
    time.sleep(3600)
time.sleep(rank0_delay)
dog = HangWatchdog(2.0 if hung else 600.0, out, rank, tracker=None, allowance_s=2.0 if hung else 600.0)
dog.step_started()
try:
    dist.all_reduce(torch.ones(1))
except Exception as exc:
    print(f"rank 0's collective failed: {exc}", file=sys.stderr, flush=True)
    dog.exit_if_hung(exc)
    raise
"""


def run_pair(tmp_path, mode: str, rank0_delay: float) -> tuple[subprocess.CompletedProcess, int]:
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), port, str(tmp_path), mode, str(rank0_delay)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        out, err = ranks[0].communicate(timeout=90)
        peer = ranks[1].wait(timeout=30)
    finally:
        for p in ranks:
            p.kill()
    return subprocess.CompletedProcess(ranks[0].args, ranks[0].returncode, out, err), peer


@pytest.mark.slow
def test_a_rank_whose_collective_breaks_after_its_peers_hang_exits_3(tmp_path):
    """Rank 0's step starts 1.5 s after rank 1's, as a rank's own watchdog may fire up to a poll later:
    rank 1 exits 3 (2 s + up to 1 s, then 5 s of grace) while rank 0's watchdog is still in its grace,
    so rank 0's collective fails first. Before, that failure ended rank 0 with exit 1."""
    rank0, peer = run_pair(tmp_path, "hang", rank0_delay=1.5)
    assert peer == 3
    assert "rank 0's collective failed" in rank0.stderr, rank0.stderr[-3000:]
    assert rank0.returncode == 3, rank0.stderr[-3000:]
    stacks = (tmp_path / "hang-rank0.txt").read_text()
    assert "no step finished within 2s" in stacks


@pytest.mark.slow
def test_a_collective_broken_by_a_crashed_peer_before_the_deadline_is_a_crash(tmp_path):
    rank0, peer = run_pair(tmp_path, "crash", rank0_delay=0.0)
    assert peer == 1
    assert rank0.returncode == 1, rank0.stderr[-3000:]
    assert not (tmp_path / "hang-rank0.txt").exists()
