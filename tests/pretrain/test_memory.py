"""Memory that stays flat over a run (issue 37): launched as users launch it (``pretrain.launch``, which
preloads tcmalloc), a run's resident memory, logged every step as ``perf/memory_current_gb``, stops
growing after its first steps; a step that keeps memory (the test hook ``MLM_TEST_LEAK_MB_PER_STEP``)
is caught by the same measure. The 1,000-step proof on the main job is in BENCHMARKS.md.

Time: about 1.5 minutes: memory levels off only after steps, and the run goes through
``pretrain.launch`` for real, since its preloaded allocator is part of what is measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from apt import apt_install, can_install
from conftest import PY, explain, train
from pretrain.runtime import allocator

pytestmark = pytest.mark.slow
STEPS = 120
WARM = 40  # allocators and the data loader settle in the first steps
RUN = [
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "model.max_position_embeddings=64",
    "train.checkpoint_every=0",
    f"train.max_steps={STEPS}",
    "tracking.backend=none",
]


def growth_mb_per_step(out: Path) -> float:
    """The least-squares slope of rank 0's resident memory after the warm-up, in MB per step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    points = [
        (r["step"], r["perf/memory_current_gb"] * 1024)
        for r in rows
        if "perf/memory_current_gb" in r and r["step"] >= WARM
    ]
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


@pytest.fixture(scope="module")
def tcmalloc():
    if allocator.find("tcmalloc") is None and can_install():
        apt_install(allocator.PACKAGES["tcmalloc"])
    if allocator.find("tcmalloc") is None:
        pytest.skip("tcmalloc is not installed here and cannot be (needs root and apt-get)")


@pytest.mark.parametrize("leak_mb", [0, 1])
def test_resident_memory_levels_off_and_a_leaking_step_is_caught(tcmalloc, shards, tmp_path, leak_mb):
    out = tmp_path / "run"
    proc = train(
        shards,
        out,
        *RUN,
        ranks=2,
        launcher=[PY, "-m", "pretrain.launch"],
        env={"MLM_TEST_LEAK_MB_PER_STEP": str(leak_mb)},
    )
    assert proc.returncode == 0, explain(proc)
    assert "allocator tcmalloc" in proc.stdout, proc.stdout[-3000:]  # preloaded by the launcher
    slope = growth_mb_per_step(out)
    print(f"leak {leak_mb} MB/step: resident memory grew {slope:.3f} MB/step after step {WARM}", file=sys.stderr)
    if leak_mb:
        assert slope > 0.7 * leak_mb, slope
    else:
        assert abs(slope) < 0.25, slope  # 80 steps: under 20 MB of a ~0.5 GB process (0.05 measured)


def test_the_allocator_is_preloaded_unless_missing_or_declined(monkeypatch, tmp_path):
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    monkeypatch.setattr(allocator, "_search_dirs", lambda: [tmp_path])
    env, problem = allocator.preload({"LD_PRELOAD": "libother.so"})
    assert env["LD_PRELOAD"] == f"{tmp_path}/libtcmalloc_minimal.so.4 libother.so" and problem is None
    assert allocator.preload(env) == (env, None)  # already preloaded: left alone
    assert allocator.preload({"MLM_ALLOCATOR": "system"}) == ({"MLM_ALLOCATOR": "system"}, None)
    env, problem = allocator.preload({"MLM_ALLOCATOR": "nosuch"})
    assert "LD_PRELOAD" not in env and "not one of tcmalloc, jemalloc, system" in problem
    monkeypatch.setattr(allocator, "_search_dirs", lambda: [])
    env, problem = allocator.preload({})
    assert "LD_PRELOAD" not in env
    assert problem.startswith("tcmalloc not found (apt-get install libtcmalloc-minimal4"), problem


def test_gpu_ranks_get_no_preloaded_allocator_unless_asked(monkeypatch, tmp_path):
    """Unmeasured on GPU ranks: not preloaded there by default, and the start line says why."""
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (tmp_path / "nvidiactl").write_bytes(b"")
    monkeypatch.setattr(allocator, "_search_dirs", lambda: [tmp_path])
    monkeypatch.setattr(allocator, "GPU_DEVICE_NODES", (str(tmp_path / "nvidiactl"),))
    assert allocator.preload({}) == ({}, None)
    for ranks_on_cpu in ({"DS_ACCELERATOR": "cpu"}, {"CUDA_VISIBLE_DEVICES": ""}, {"MLM_ALLOCATOR": "tcmalloc"}):
        env, problem = allocator.preload(dict(ranks_on_cpu))
        assert env["LD_PRELOAD"] == f"{tmp_path}/libtcmalloc_minimal.so.4" and problem is None, ranks_on_cpu
    monkeypatch.delenv("MLM_ALLOCATOR", raising=False)
    monkeypatch.setattr(allocator, "in_use", lambda: "glibc")
    assert allocator.describe("cuda").startswith("glibc (not preloaded on GPU ranks, unmeasured there; MLM_ALLOCATOR")
    assert allocator.describe("cpu") == "glibc"
