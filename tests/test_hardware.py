"""Precision from what the hardware really does, and the peak MFU is measured against."""
from __future__ import annotations

import logging

import pytest
import torch

from pretrain.runtime import hardware


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Fake the CPU capability probe: native bf16 or not."""
    def set_native(native: bool):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    return set_native


def test_auto_is_fp32_where_bf16_is_emulated_and_bf16_where_native(cpu_bf16):
    cpu_bf16(False)
    precision, why = hardware.resolve_precision("auto", torch.device("cpu"))
    assert precision == "fp32" and "emulated" in why
    cpu_bf16(True)
    precision, why = hardware.resolve_precision("auto", torch.device("cpu"))
    assert precision == "bf16" and "auto" in why


def test_auto_is_fp32_where_torch_dispatches_avx2_kernels_only(cpu_bf16, monkeypatch):
    cpu_bf16(True)                                    # the CPU has the instructions, torch does not use them
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
    assert hardware.precision_problems("fp16") and not hardware.precision_problems("bf16")


def test_gpu_peaks_come_from_the_table_for_the_precision_used():
    assert hardware.gpu_table_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(989.4)
    assert hardware.gpu_table_peak("NVIDIA H100 PCIe", "bf16")[0] == pytest.approx(756.0)
    assert hardware.gpu_table_peak("NVIDIA A100-SXM4-80GB", "fp32")[0] == pytest.approx(19.5)
    assert hardware.gpu_table_peak("NVIDIA L40S", "bf16")[0] == pytest.approx(362.1)
    assert hardware.gpu_table_peak("NVIDIA L4", "bf16")[0] == pytest.approx(121.0)
    assert hardware.gpu_table_peak("Tesla V100-SXM2-32GB", "bf16") is None      # no bf16 there
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
    assert again == first and "cached" in source and len(calls) == n          # the second start reuses it
    key = next(iter(__import__("json").loads(cache.read_text())))
    assert hardware.cpu_info()["model"] in key and f"threads={torch.get_num_threads()}" in key and "fp32" in key
    hardware.peak_tflops(cpu, "bf16", cache_path=cache)
    assert len(calls) > n                                                       # another precision: measured
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        m = len(calls)
        hardware.peak_tflops(cpu, "fp32", cache_path=cache)
        assert len(calls) > m                                                   # other threads: measured
    finally:
        torch.set_num_threads(threads)
    assert hardware.peak_tflops(cpu, "fp32", override=12.5) == (12.5, "impl.peak_tflops")


def test_an_mfu_above_one_is_reported_naming_the_peak(caplog):
    check = hardware.MfuCheck(0.01, "measured now (2 threads)")
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert check(0.5) == 0.5
        assert not caplog.records
        check(1.7)
        check(1.8)
    assert len(caplog.records) == 1 and "0.010 TFLOP/s" in caplog.records[0].message


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
        out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0] == "True", float(out[1])

    kept, after = steady_faults("keep")
    if not kept:
        pytest.skip("the C library is not glibc")
    _, default = steady_faults("default")
    assert default > 15_000                              # 80 MB in 4 KiB pages, faulted in each time
    assert after < 0.05 * default
