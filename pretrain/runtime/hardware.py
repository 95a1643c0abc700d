"""What the hardware really does: the precision ``impl.precision=auto`` picks, the peak that MFU
is measured against, and how the CPU's memory allocator is told to keep what it freed.

Precision. On CUDA, bf16 from compute capability 8.0 (A100, H100, L4, ...), fp32 before. On a CPU
the flags tell what runs, not what is fast. Without AVX-512-BF16 or AMX torch emulates bf16 (about
50x *slower* than fp32 on this project's AVX2 machines), so fp32. With them, bf16 may still lose
(a Xeon with AVX-512-BF16 and no AMX: the mini step 1.66x slower in bf16) or win by less than its
matmul suggests (a Xeon with AMX: matmul 7.7x, step 1.33x). So there ``auto`` times the model's own
step in both (``pretrain.runtime.step_speed``) and takes bf16 only when it is at least
``BF16_MARGIN`` faster. The timing is cached beside the peak (``step_precision.json``, keyed by CPU
model, threads, torch version and the model's shape), so a later start reads it; the ranks of a node
take turns on a file lock, so one measures and the others read. DeepSpeed's
``is_bf16_supported()`` answers True on every CPU, so it is not asked. An explicit ``bf16`` on an
emulating CPU is honoured, with a warning that gives the measured slowdown.

Peak. MFU = model FLOPs per second / the peak of the precision actually used. On known GPUs the peak
is the vendor's dense number (``GPU_PEAK_TFLOPS``). On CPUs (and unknown GPUs) it is a measured
square-matmul throughput with the thread count this process actually has, timed by the CPU seconds
it got (so a busy machine does not lower it), measured once per machine and cached (``~/.cache/mlm-pretrain/peak_tflops.json``, keyed by device model, threads and precision),
so that the MFU scale does not move across restarts on a busy machine. ``impl.peak_tflops``
overrides both.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import platform
import resource
import time
from pathlib import Path
from typing import Optional

import torch

from data_prep.common.atomic import write_atomic
from pretrain.model import fp8
from pretrain.model.flops import measure_matmul_peak_tflops
from pretrain.runtime.step_speed import BF16_MARGIN, StepProbe, StepTiming

log = logging.getLogger("pretrain")

# Dense (no sparsity) peaks in TFLOP/s from the vendors' datasheets, matched against
# torch.cuda.get_device_name() in this order (more specific names first). fp32 is the plain FP32
# number: torch does not use TF32 for fp32 matmuls unless told to.
GPU_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GB200", {"bf16": 2500.0, "fp16": 2500.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM, and GH200
    ("H800", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("RTX A6000", {"bf16": 154.8, "fp16": 154.8, "fp32": 38.7}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
    ("MI250", {"bf16": 362.1, "fp16": 362.1, "fp32": 47.9}),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}


def weights_precision(precision: str) -> str:
    """The precision the weights, DeepSpeed and checkpoints are kept in: fp8 is a bf16 run whose
    encoder matmuls run in float8 (pretrain.model.fp8)."""
    return "bf16" if precision == "fp8" else precision


def cpu_info() -> dict:
    """CPU model, the flags that decide bf16 speed, and torch's own view of them."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    relevant = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    native = _cpu_native_bf16(flags)
    return {
        "model": model,
        "flags": relevant,
        "native_bf16": native,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def _cpu_native_bf16(flags: set[str]) -> bool:
    # torch's own dispatch level too: ATEN_CPU_CAPABILITY=avx2 (or a build without AVX-512 kernels)
    # emulates bf16 even on a CPU that has the instructions.
    if not torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX512", "AMX")):
        return False
    probe_avx512 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    probe_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe_avx512 is not None and probe_amx is not None:
        return bool(probe_avx512() or probe_amx())
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """(does ``device`` compute bf16 natively, why we think so)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:
            return True, f"{name} (compute capability {major}.{minor}) has bf16 tensor cores"
        return False, f"{name} (compute capability {major}.{minor}) has no bf16 tensor cores"
    if device.type == "cpu":
        info = cpu_info()
        if info["native_bf16"]:
            have = [f for f in info["flags"] if f in ("avx512_bf16", "amx_bf16", "amx_tile")]
            return True, f"{info['model']} has {', '.join(have) or 'native bf16'}"
        return False, (
            f"{info['model']} (torch's {info['torch_capability']} kernels) has no native bf16 "
            "(AVX-512-BF16 or AMX): it would be emulated"
        )
    return False, f"unknown device type {device.type!r}"


def bf16_slowdown(device: torch.device, size: int = 256, seconds: float = 0.1) -> float:
    """fp32 matmul throughput / bf16 matmul throughput on ``device`` (> 1: bf16 is slower)."""
    fp32 = measure_matmul_peak_tflops(device, torch.float32, seconds=seconds, size=size)
    bf16 = measure_matmul_peak_tflops(device, torch.bfloat16, seconds=seconds, size=size)
    return fp32 / max(bf16, 1e-12)


def auto_precision(
    device: torch.device, probe: Optional[StepProbe] = None, cache_path: Optional[Path] = None
) -> tuple[str, str]:
    """What ``impl.precision=auto`` picks on ``device``, and why. On a CPU with native bf16 it times
    ``probe`` (the run's model) in both precisions; without a probe (a layout guessed before any
    model exists) it says bf16 there, unmeasured."""
    native, why = native_bf16(device)
    if not native:
        return "fp32", f"auto: fp32, {why}"
    if device.type != "cpu":
        return "bf16", f"auto: bf16, {why}"
    if probe is None:
        return "bf16", f"auto: bf16, {why} (step not measured)"
    timing, source = step_timing(probe, cache_path)
    choice = timing.choice()
    return choice, (
        f"auto: {choice}, {why}; the model's step measured {timing.fp32_s:.3f} s in fp32 and "
        f"{timing.bf16_s:.3f} s in bf16 ({timing.speedup:.2f}x; bf16 needs {BF16_MARGIN:.2f}x), {source}"
    )


def step_timing(probe: StepProbe, cache_path: Optional[Path] = None) -> tuple[StepTiming, str]:
    """The probe's timing from the cache, or measured now and cached (one process at a time)."""
    path = cache_path or default_cache_path().with_name("step_precision.json")
    key = (
        f"cpu|{cpu_info()['model']}|threads={torch.get_num_threads()}|torch={torch.__version__}|{probe.shape}"
        f"|batch={probe.batch}|seq={probe.seq_len}|masked={probe.n_masked}"
    )

    def measure() -> dict:
        timing = probe.measure()
        return {"fp32_s": timing.fp32_s, "bf16_s": timing.bf16_s}

    # Said before it starts: on a loaded machine it took 90 s, with nothing on the console
    announce = (
        f"impl.precision=auto: timing this model's step in fp32 and in bf16 ({probe.batch} x {probe.seq_len} "
        f"tokens, 4 passes each; once per machine and shape, then cached in {path})"
    )
    record, source = timed_once(path, key, "the step timing", announce, measure)
    return StepTiming(record["fp32_s"], record["bf16_s"]), source


def timed_once(path: Path, key: str, what: str, announce: str, measure) -> tuple[dict, str]:
    """A timing (``measure()``'s dict) from the cache at ``path`` under ``key``, or measured now, said
    first (``announce``), and cached, one process of the node at a time (another rank may be timing the
    same): (the record, where it came from). A cache that cannot be written (a read-only home) costs a
    warning, never the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as exc:
        log.warning("could not cache %s in %s: %s", what, path, exc)
        return measure(), "measured now, not cached"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = read_cache(path).get(key)
        if found:
            return found, f"measured {found['when']}, cached in {path}"
        start = time.perf_counter()
        log.info("%s", announce)
        record = {**measure(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        add_to_cache(path, key, record, what)
        return record, f"measured now in {time.perf_counter() - start:.1f} s, cached in {path}"


def resolve_precision(wanted: str, device: torch.device, probe: Optional[StepProbe] = None) -> tuple[str, str]:
    """(precision to use, the reason, for the log). ``fp16`` on a CPU is a config error, caught
    before any process group starts (``precision_problems``)."""
    if wanted == "auto":
        return auto_precision(device, probe)
    if wanted == "bf16" and device.type == "cpu":
        native, why = native_bf16(device)
        if not native:
            slower = bf16_slowdown(device)
            log.warning(
                "impl.precision=bf16 on a CPU without native bf16 (%s): a bf16 matmul measured %.1fx "
                "slower than fp32 here; impl.precision=auto would pick fp32",
                why,
                slower,
            )
            return "bf16", f"bf16 as configured; emulated, {slower:.1f}x slower than fp32"
    if wanted == "fp8" and device.type == "cpu":
        log.warning("impl.precision=fp8 on a CPU: the float8 values are multiplied in fp32 here (for checking)")
        return "fp8", "fp8 as configured; float8 values multiplied in fp32 on the CPU"
    return wanted, f"{wanted} as configured"


def precision_problems(wanted: str) -> list[str]:
    """Found before any process group starts: the device type is known from CUDA availability."""
    if wanted == "fp16" and not torch.cuda.is_available():
        return ["impl.precision: fp16 needs a GPU (DeepSpeed refuses fp16 on the CPU); use auto, bf16 or fp32"]
    if wanted == "fp8":
        return fp8.problems(torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    return []


def device_problems(impl) -> list[str]:
    """A run meant for GPUs (``impl.device=cuda``, or NCCL) that sees none: named now, before it
    trains for days on the CPU; and ``impl.device=cpu`` keeps a GPU machine's run on the CPU."""
    if torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = (f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no CUDA_VISIBLE_DEVICES") + (
        f", Slurm job {os.environ['SLURM_JOB_ID']}: was it submitted with --gpus-per-node?"
        if "SLURM_JOB_ID" in os.environ
        else ""
    )
    out = []
    if impl.device == "cuda":
        out.append(
            f"impl.device=cuda, but torch sees no CUDA GPU here (torch {torch.__version__}, {where}); "
            "impl.device=cpu to train on the CPU"
        )
    if impl.dist_backend == "nccl":
        out.append(f"impl.dist_backend=nccl needs CUDA GPUs, and torch sees none here ({where}); use auto or gloo")
    return out


def gpu_table_peak(name: str, precision: str) -> Optional[tuple[float, str]]:
    for key, peaks in GPU_PEAK_TFLOPS:
        if key.lower() in name.lower() and precision in peaks:
            return peaks[precision], f"table: {key} {precision} dense"
    return None


def device_key(device: torch.device) -> str:
    """What a timing cached for this device is keyed by, before the shape and settings it times."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_info()["model"]
    return f"{device.type}|{name}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def default_cache_path() -> Path:
    root = os.environ.get("MLM_PRETRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlm-pretrain"
    )
    return Path(root) / "peak_tflops.json"


def peak_tflops(
    device: torch.device, precision: str, override: float = 0.0, cache_path: Optional[Path] = None
) -> tuple[float, str]:
    """(peak TFLOP/s of one process in ``precision``, where the number comes from). fp8 is counted
    against the bf16 peak, as NVIDIA's MLPerf figures are: its MFU says how much faster than bf16."""
    precision = weights_precision(precision)
    if override > 0:
        return override, "impl.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_table_peak(name, precision)
        if found:
            return found
        model, threads = name, 0
    else:
        model, threads = cpu_info()["model"], torch.get_num_threads()
    key = f"{device.type}|{model}|threads={threads}|{precision}"
    path = cache_path or default_cache_path()
    cache = read_cache(path)
    if key in cache:
        return float(cache[key]["tflops"]), f"measured {cache[key]['when']}, cached in {path}"
    # Timed by CPU seconds on a CPU (see measure_matmul_peak_tflops): a busy machine does not lower it.
    # The best of 4 timings of 0.25 s; once, where one matmul alone outlasts a timing (bf16 emulated
    # on an AVX2 CPU: ~2 s per 1024^3 matmul, 37 s for the 16 that four timings took).
    size = 4096 if device.type == "cuda" else 1024
    timings = [measure_matmul_peak_tflops(device, DTYPES[precision], seconds=0.25, size=size)]
    while len(timings) < 4 and 2.0 * size**3 / (timings[0] * 1e12) < 0.25:
        timings.append(measure_matmul_peak_tflops(device, DTYPES[precision], seconds=0.25, size=size))
    value = max(timings)
    add_to_cache(path, key, {"tflops": value, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, "the measured peak")
    return value, f"measured now ({threads} threads), cached in {path}"


def add_to_cache(path: Path, key: str, record: dict, what: str) -> None:
    """``record`` under ``key`` in the JSON cache at ``path``, the other keys kept, written atomically."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(read_cache(path) | {key: record}, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only home must not stop training
        log.warning("could not cache %s in %s: %s", what, path, exc)


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


class MfuCheck:
    """MFU above 1 means the peak is wrong (too low): say so once, naming the peak used."""

    def __init__(self, peak: float, source: str):
        self.peak, self.source, self.warned = peak, source, False

    def __call__(self, mfu: float) -> float:
        if mfu > 1.0 and not self.warned:
            self.warned = True
            log.warning(
                "MFU %.2f is above 1: the peak %.3f TFLOP/s (%s) is too low for this machine; set "
                "impl.peak_tflops, or delete the cached value to re-measure",
                mfu,
                self.peak,
                self.source,
            )
        return mfu


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_cpu_memory() -> bool:
    """Make glibc's malloc, which torch's CPU allocator calls, keep freed memory for the next step.

    By default glibc serves every block over 32 MB with its own mmap and unmaps it on free, so the
    next step page-faults it in again, zeroed by the kernel: the logits at the masked positions
    (614 x 30,522 fp32, 75 MB on mini), their log-softmax and gradients, every step. Measured on
    mini in fp32 (2 cores): 88,000 page faults/s; with freed memory kept, 1,900/s and 10-20% more
    tokens/s. The price: freed blocks of varying size fragment the heap, so memory grows past the
    working set (1.6 -> 2.9 GB over 160 mini steps, then flat); ``impl.keep_freed_cpu_memory=false``
    skips this call. Returns False where the C library is not glibc (nothing changed)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def current_memory_gb(device) -> float:
    """The process's memory now: allocated on a GPU, resident on a CPU (what a leak makes grow, where
    the peak only tells the highest point)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_memory_gb(device) -> float:
    """The process's peak memory: allocated on a GPU, resident on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
