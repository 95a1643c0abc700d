"""The attention kernel a run uses, chosen by timing the candidates on this device at the run's shape.

Which kernel is fastest depends on the device, the dtype and the shape, and not as one would guess:
on a 2-core AVX2 EPYC at mini's shape (32 x 4 heads x 128 x 64), forward + backward of SDPA's flash
kernel, its math path and an explicit matmul-softmax-matmul cost alike in fp32, while in bf16 the
math path took 49 ms, flash 138 ms and the explicit one 356 ms; on a Xeon with AMX the flash
kernel's backward cost ten times its forward (issue 38). So ``impl.attention: auto`` times each
candidate once, forward and backward, caches the answer beside the matmul peak (keyed by device,
threads, dtype and shape), and the run uses the fastest; the start line names it.

Candidates: SDPA restricted to one backend (``sdpa_flash``, ``sdpa_math``; on CUDA also
``sdpa_efficient`` and ``sdpa_cudnn``), and ``eager`` (Hugging Face's explicit attention). A backend
that cannot take an input (flash with a padding mask on CUDA) falls back to the math path
(``pretrain.model.mlm.MLMModel.use_attention``). The choice is recorded in the checkpoint, and a
resumed run keeps it at any layout, so that a resume computes with the same kernel.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pretrain.model.mlm import SDPA_BACKENDS
from pretrain.runtime.hardware import add_to_cache, cpu_info, default_cache_path, read_cache

log = logging.getLogger("pretrain")

CPU_CANDIDATES = ("sdpa_flash", "sdpa_math", "eager")
CUDA_CANDIDATES = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "eager")


def _eager(q, k, v):
    """What Hugging Face's eager attention computes (BERT's and ModernBERT's, without a mask)."""
    probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5, dim=-1)
    return torch.matmul(probs, v)


def _sdpa(backend: SDPBackend) -> Callable:
    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def time_candidates(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int],
                    candidates: tuple[str, ...], repeats: int = 3) -> dict[str, float]:
    """Seconds of one forward + backward of each candidate on random [batch, heads, seq, head_dim]
    inputs, the best of ``repeats`` after one untimed run; a candidate this device cannot run is left out."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timings = {}
    for name in candidates:
        fn = _eager if name == "eager" else _sdpa(SDPA_BACKENDS[name])
        best = float("inf")
        try:
            for i in range(repeats + 1):
                sync()
                start = time.perf_counter()
                fn(q, k, v).sum().backward()
                sync()
                if i:
                    best = min(best, time.perf_counter() - start)
        except RuntimeError as exc:           # e.g. "No available kernel" for this device or dtype
            log.debug("attention candidate %s cannot run here: %s", name, exc)
            continue
        timings[name] = best
    return timings


def cache_path() -> Path:
    return default_cache_path().with_name("attention.json")


def choose(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int],
           path: Optional[Path] = None) -> tuple[str, str]:
    """(the fastest candidate, what says so): cached per device, threads, dtype and shape."""
    if device.type == "cuda":
        where, candidates = torch.cuda.get_device_name(device), CUDA_CANDIDATES
    else:
        where, candidates = f"{cpu_info()['model']}|threads={torch.get_num_threads()}", CPU_CANDIDATES
    key = f"{device.type}|{where}|{str(dtype).removeprefix('torch.')}|{'x'.join(map(str, shape))}"
    path = path or cache_path()
    cache = read_cache(path)
    if key in cache:
        found = cache[key]
        return found["choice"], f"{_summary(found['ms'])}, measured {found['when']}, cached in {path}"
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        timings = time_candidates(device, dtype, shape, candidates)
    if not timings:
        raise RuntimeError(f"no attention candidate ran on {device} in {dtype}")
    ms = {name: round(seconds * 1e3, 3) for name, seconds in timings.items()}
    entry = {"choice": min(timings, key=timings.get), "ms": ms, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    add_to_cache(path, key, entry, "the attention timings")
    return entry["choice"], f"{_summary(ms)}, measured now"


def _summary(ms: dict) -> str:
    return "forward+backward " + ", ".join(f"{name} {value:.1f} ms" for name, value in sorted(ms.items(), key=lambda kv: kv[1]))


def resolve(model, wanted: str, device: torch.device, dtype: torch.dtype, micro_batch: int,
            seq_len: int) -> tuple[str, str]:
    """(the attention ``model`` should use, why) for ``impl.attention`` = ``wanted``: timed here for
    ``auto`` where Hugging Face runs SDPA or eager attention; flash_attention_2 and keyed dropout's
    attention (``model.attention_dropout`` > 0: training runs it eagerly) are kept as they are."""
    built = model.config._attn_implementation
    if built not in ("sdpa", "eager"):
        return built, "as built"
    if wanted != "auto":
        return wanted, "impl.attention"
    config = model.config
    heads = config.num_attention_heads
    return choose(device, dtype, (micro_batch, heads, seq_len, config.hidden_size // heads))
