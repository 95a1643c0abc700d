"""Precision from what the hardware really does, and the peak MFU is measured against."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pretrain.runtime import hardware, step_speed
from pretrain.runtime.step_speed import BF16_MARGIN, StepTiming


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Fake the CPU capability probe: native bf16 or not."""

    def set_native(native: bool):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")

    return set_native


class FakeProbe:
    """A step whose two timings are given; counts how often it is measured."""

    def __init__(self, fp32_s: float, bf16_s: float, shape: str = "bert L2 H64"):
        self.timing, self.shape, self.batch, self.seq_len, self.n_masked, self.calls = (
            StepTiming(fp32_s, bf16_s),
            shape,
            4,
            64,
            38,
            0,
        )

    def measure(self, repeats: int = 3) -> StepTiming:
        self.calls += 1
        return self.timing


@pytest.fixture
def step_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLM_PRETRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "step_precision.json"


def test_auto_is_fp32_where_bf16_is_emulated_without_timing_a_step(cpu_bf16, step_cache):
    cpu_bf16(False)
    probe = FakeProbe(1.0, 0.1)
    precision, why = hardware.resolve_precision("auto", torch.device("cpu"), probe)
    assert precision == "fp32" and "emulated" in why and probe.calls == 0


@pytest.mark.parametrize(
    "fp32_s, bf16_s, chosen",
    [
        (0.60, 1.00, "fp32"),  # Xeon with AVX-512-BF16, no AMX: native, and 1.66x slower
        (1.00, 0.95, "fp32"),  # faster, by less than the margin
        (1.33, 1.00, "bf16"),  # Xeon with AMX: the mini step 1.33x faster
    ],
)
def test_auto_on_a_native_bf16_cpu_takes_the_faster_step_by_a_margin(cpu_bf16, step_cache, fp32_s, bf16_s, chosen):
    cpu_bf16(True)
    probe = FakeProbe(fp32_s, bf16_s)
    precision, why = hardware.resolve_precision("auto", torch.device("cpu"), probe)
    assert precision == chosen and probe.calls == 1
    assert f"{fp32_s:.3f} s in fp32 and {bf16_s:.3f} s in bf16 ({fp32_s / bf16_s:.2f}x" in why, why
    assert f"bf16 needs {BF16_MARGIN:.2f}x" in why and "measured now" in why


def test_the_step_timing_is_cached_per_model_shape(cpu_bf16, step_cache, caplog):
    cpu_bf16(True)
    probe = FakeProbe(1.0, 0.5)
    caplog.set_level("INFO")
    hardware.resolve_precision("auto", torch.device("cpu"), probe)
    # a timing says it is timing, before it starts (it took 90 s on a loaded machine)
    assert [r.getMessage() for r in caplog.records if "timing this model's step" in r.getMessage()]
    caplog.clear()
    again = FakeProbe(9.9, 9.9)  # the same shape: read from the cache, not measured
    precision, why = hardware.resolve_precision("auto", torch.device("cpu"), again)
    assert precision == "bf16" and again.calls == 0 and f"cached in {step_cache}" in why
    assert not [r for r in caplog.records if "timing this model's step" in r.getMessage()]
    (key,) = json.loads(step_cache.read_text())
    assert hardware.cpu_info()["model"] in key and f"threads={torch.get_num_threads()}" in key and "L2 H64" in key
    other = FakeProbe(0.5, 1.0, shape="bert L4 H256")
    assert hardware.resolve_precision("auto", torch.device("cpu"), other)[0] == "fp32" and other.calls == 1


@pytest.mark.slow
def test_ranks_of_a_node_measure_once(cpu_bf16, step_cache):
    """Two processes ask at once: one measures (holding the lock), the other reads its result."""
    script = (
        "import sys, torch; from pretrain.runtime import hardware; from test_hardware import FakeProbe\n"
        "torch.cpu._is_avx512_bf16_supported = lambda: True; torch.backends.cpu.get_cpu_capability = lambda: 'AVX512'\n"
        "class Slow(FakeProbe):\n"
        "    def measure(self, repeats=3):\n"
        "        import time; time.sleep(1.5); print('measured', flush=True); return super().measure()\n"
        "print(hardware.resolve_precision('auto', torch.device('cpu'), Slow(1.0, 0.5))[0])\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}:{Path(__file__).parents[1]}:{Path(__file__).parents[2]}",
    }
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [o.split()[-1] for o in outs] == ["bf16", "bf16"], outs
    assert sum(o.count("measured") for o in outs) == 1, outs


def test_the_real_step_is_timed_in_both_precisions():
    """The tiny model's own step, forward and backward, in fp32 and in a bf16 copy; the model is left
    as it was (fp32, no gradients)."""
    from pretrain.config.schema import ImplConfig, ModelConfig
    from pretrain.model.masking import SpecialIds
    from pretrain.model.mlm import build_model

    special = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=500)
    model = build_model(
        ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=64),
        500,
        special,
        ImplConfig(precision="fp32"),
    )
    probe = step_speed.step_probe(model, micro_batch=16, seq_len=64, masking_rate=0.15)
    assert (probe.batch, probe.n_masked) == (step_speed.PROBE_BATCH, round(0.15 * 4 * 64))
    timing = probe.measure(repeats=1)
    assert timing.fp32_s > 0 and timing.bf16_s > 0
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_auto_is_bf16_where_native_on_a_layout_guessed_before_the_model(cpu_bf16):
    cpu_bf16(True)
    precision, why = hardware.resolve_precision("auto", torch.device("cpu"))
    assert precision == "bf16" and "not measured" in why


def test_auto_is_fp32_where_torch_dispatches_avx2_kernels_only(cpu_bf16, monkeypatch):
    cpu_bf16(True)  # the CPU has the instructions, torch does not use them
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert hardware.resolve_precision("auto", torch.device("cpu"))[0] == "fp32"


def test_auto_on_cuda_follows_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert hardware.resolve_precision("auto", torch.device("cuda", 0))[0] == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert hardware.resolve_precision("auto", torch.device("cuda", 0))[0] == "bf16"


def test_explicit_bf16_on_an_emulating_cpu_warns_with_the_measured_slowdown(cpu_bf16, caplog, monkeypatch):
    cpu_bf16(False)
    monkeypatch.setattr(hardware, "bf16_slowdown", lambda device: 48.0)
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        precision, why = hardware.resolve_precision("bf16", torch.device("cpu"))
    assert precision == "bf16" and "48.0x" in why
    assert any("48.0x slower than fp32" in r.message for r in caplog.records)


def test_fp16_without_a_gpu_is_an_input_problem():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert hardware.precision_problems("fp16") == [
        "impl.precision: fp16 needs a GPU (DeepSpeed refuses fp16 on the CPU); use auto, bf16 or fp32"
    ]
    assert hardware.precision_problems("bf16") == hardware.precision_problems("auto") == []


def test_gpu_peaks_come_from_the_table_for_the_precision_used():
    assert hardware.gpu_table_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(989.4)
    assert hardware.gpu_table_peak("NVIDIA H100 PCIe", "bf16")[0] == pytest.approx(756.0)
    assert hardware.gpu_table_peak("NVIDIA A100-SXM4-80GB", "fp32")[0] == pytest.approx(19.5)
    assert hardware.gpu_table_peak("NVIDIA L40S", "bf16")[0] == pytest.approx(362.1)
    assert hardware.gpu_table_peak("NVIDIA L4", "bf16")[0] == pytest.approx(121.0)
    assert hardware.gpu_table_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 there
    assert hardware.gpu_table_peak("Some Future GPU", "bf16") is None


def test_cpu_peak_is_measured_once_per_machine_threads_and_precision(tmp_path, monkeypatch):
    calls = []
    real = hardware.measure_matmul_peak_tflops

    def counting(device, dtype, seconds=1.0, size=None):
        calls.append((dtype, torch.get_num_threads()))
        return real(device, dtype, seconds=0.02, size=128)

    monkeypatch.setattr(hardware, "measure_matmul_peak_tflops", counting)
    cache = tmp_path / "peak.json"
    cpu = torch.device("cpu")
    first, source = hardware.peak_tflops(cpu, "fp32", cache_path=cache)
    assert first > 0 and "measured now" in source and calls
    n = len(calls)
    again, source = hardware.peak_tflops(cpu, "fp32", cache_path=cache)
    assert again == first and "cached" in source and len(calls) == n  # the second start reuses it
    key = next(iter(__import__("json").loads(cache.read_text())))
    assert hardware.cpu_info()["model"] in key and f"threads={torch.get_num_threads()}" in key and "fp32" in key
    hardware.peak_tflops(cpu, "bf16", cache_path=cache)
    assert len(calls) > n  # another precision: measured
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        m = len(calls)
        hardware.peak_tflops(cpu, "fp32", cache_path=cache)
        assert len(calls) > m  # other threads: measured
    finally:
        torch.set_num_threads(threads)
    assert hardware.peak_tflops(cpu, "fp32", override=12.5) == (12.5, "impl.peak_tflops")


def test_a_matmul_slower_than_the_timing_budget_is_timed_once(tmp_path, monkeypatch):
    """bf16 emulated on an AVX2 CPU takes ~2 s per 1024^3 matmul: the peak is measured from one warm-up
    and one timed matmul, not the 16 that four 0.25 s timings with three warm-ups each would take."""
    calls = []

    def slow_matmul(a, b, out=None):  # 0.3 s of this process's CPU time, as a slow kernel spends
        calls.append(a.shape)
        start = time.process_time()
        while time.process_time() - start < 0.3:
            pass
        return out

    monkeypatch.setattr(torch, "matmul", slow_matmul)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        tflops, source = hardware.peak_tflops(torch.device("cpu"), "bf16", cache_path=tmp_path / "peak.json")
    finally:
        torch.set_num_threads(threads)
    assert "measured now" in source and len(calls) == 2, len(calls)
    assert tflops == pytest.approx(2.0 * 1024**3 / 0.3 / 1e12, rel=0.3)


def test_an_mfu_above_one_is_reported_naming_the_peak(caplog):
    check = hardware.MfuCheck(0.01, "measured now (2 threads)")
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert check(0.5) == 0.5
        assert not caplog.records
        check(1.7)
        check(1.8)
    assert len(caplog.records) == 1 and "0.010 TFLOP/s" in caplog.records[0].message


@pytest.mark.slow
def test_freed_cpu_memory_is_reused_without_page_faults():
    """Steps allocate the same large tensors again and again (75 MB of logits on mini). glibc's
    default unmaps them on free, so each step faults them back in; after keep_freed_cpu_memory
    (called at start-up, as the trainer does) the memory is reused."""
    import subprocess
    import sys

    probe = r"""
import resource, sys, torch
from pretrain.runtime import hardware
kept = hardware.keep_freed_cpu_memory() if sys.argv[1] == "keep" else False
def faults_per_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.empty(20_000_000).fill_(1.0)            # 80 MB, freed at once
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
print(kept, [faults_per_allocation() for _ in range(8)][-1])     # settled after a few
"""

    def steady_faults(mode: str) -> tuple[bool, float]:
        out = subprocess.run(
            [sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0] == "True", float(out[1])

    kept, after = steady_faults("keep")
    if not kept:
        pytest.skip("the C library is not glibc")
    _, default = steady_faults("default")
    assert default > 15_000  # 80 MB in 4 KiB pages, faulted in each time
    assert after < 0.05 * default


def test_a_run_meant_for_gpus_that_sees_none_is_an_input_error(monkeypatch):
    """impl.device=cuda (or NCCL) without a visible GPU: named, with Slurm's likely cause (issue 33)."""
    from pretrain.config.schema import ImplConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    (problem,) = hardware.device_problems(ImplConfig(device="cuda"))
    assert problem.startswith("impl.device=cuda, but torch sees no CUDA GPU here") and "--gpus-per-node" in problem
    assert "nccl needs CUDA GPUs" in hardware.device_problems(ImplConfig(dist_backend="nccl"))[0]
    assert hardware.device_problems(ImplConfig()) == [] and hardware.device_problems(ImplConfig(device="cpu")) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hardware.device_problems(ImplConfig(device="cuda", dist_backend="nccl")) == []


def test_each_rank_takes_a_gpu_that_exists(monkeypatch):
    """srun --gpus-per-task=1: every rank sees one GPU, index 0, whatever its local rank; the
    launchers keep the scheduler's device list that DeepSpeed's launcher would replace (issue 33)."""
    from pretrain.runtime import engine
    from pretrain.runtime.launcher import GIVEN_DEVICES, accelerator_env

    assert engine.cuda_index(3, 1) == 0 and engine.cuda_index(3, 8) == 3
    with pytest.raises(RuntimeError, match="local rank 4 but only 4 GPUs are visible"):
        engine.cuda_index(4, 4)
    env = accelerator_env({"CUDA_VISIBLE_DEVICES": "2,3", "DS_ACCELERATOR": "cuda"})
    assert env[GIVEN_DEVICES] == "2,3"
    monkeypatch.setenv(GIVEN_DEVICES, "2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what DeepSpeed's launcher sets
    engine._keep_given_devices()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_cpu_run_on_a_gpu_machine_hides_the_gpus_from_torch_too(monkeypatch):
    """DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES=0..N-1 even for its CPU accelerator; a rank told
    to train on the CPU hides the GPUs again, before torch looks for them (issue 33)."""
    from pretrain.runtime import engine

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("RANK", "0")
    engine.prepare_env()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_a_single_process_run_gets_rendezvous_variables_whatever_the_accelerator(monkeypatch):
    """`python -m pretrain.train` without a launcher, DS_ACCELERATOR unset (a GPU machine) or cpu."""
    from pretrain.runtime import engine

    for accelerator in (None, "cpu"):
        for name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "SLURM_PROCID",
            "DS_ACCELERATOR",
            "CUDA_VISIBLE_DEVICES",
        ):
            monkeypatch.setenv(name, "x")  # recorded, so that what prepare_env sets is undone after
            monkeypatch.delenv(name)
        if accelerator:
            monkeypatch.setenv("DS_ACCELERATOR", accelerator)
        engine.prepare_env()
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
