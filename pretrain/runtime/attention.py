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
that cannot take an input (flash with a mask on CUDA) falls back to the next of ``SDPA_FALLBACKS``
(``pretrain.model.mlm.MLMModel.use_attention``), and each candidate is timed as the model runs it:
ModernBERT's local layers with their sliding-window mask (where flash falls back on CUDA), weighted
by their share of the layers. In ``model.attention_scope: document`` every layer has a
block-diagonal document mask (and the local layers their window within it), so the candidates are
timed under one. The choice is recorded in the checkpoint, and a resumed run keeps it at any
layout, so that a resume computes with the same kernel.

FlexAttention is not a candidate on the CPU: torch 2.13 has no FlexAttention backward there
("FlexAttention does not support backward on CPU"). Its forward, compiled, took 6.8 ms against
SDPA flash's 6.6 ms with a document mask at mini's shape (2-core AVX-512-BF16 EPYC, fp32), so
nothing is lost.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from pretrain.model.mlm import sdpa_chain
from pretrain.runtime.hardware import add_to_cache, cpu_info, default_cache_path, read_cache

log = logging.getLogger("pretrain")

CPU_CANDIDATES = ("sdpa_flash", "sdpa_math", "eager")
BUILT_IN = ("flash_attention_2", "flex_attention")  # chosen when the model is built, not switched after
CUDA_CANDIDATES = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "eager")


def _eager(q, k, v, mask=None):
    """What Hugging Face's eager attention computes (BERT's and ModernBERT's)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _sdpa(name: str) -> Callable:
    def run(q, k, v, mask=None):
        with sdpa_kernel(sdpa_chain(name), set_priority=True):  # as MLMModel.encode runs it
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


def window_mask(seq_len: int, window: int, batch: int, device: torch.device) -> torch.Tensor:
    """ModernBERT's local layers' mask as Hugging Face passes it to SDPA: [B, 1, L, L] bool, True
    where |i - j| <= window / 2."""
    pos = torch.arange(seq_len, device=device)
    return ((pos[:, None] - pos[None, :]).abs() <= window // 2).expand(batch, 1, seq_len, seq_len)


def document_mask(seq_len: int, batch: int, device: torch.device, length: int = 40) -> torch.Tensor:
    """A document-scope mask for timing: [B, 1, L, L] bool, documents of ``length`` tokens, each row's
    boundaries shifted differently (SDPA's dense kernels cost the same for any such mask)."""
    shift = torch.arange(batch, device=device)[:, None] * 7 % length
    documents = (torch.arange(seq_len, device=device)[None, :] + shift) // length
    return (documents[:, :, None] == documents[:, None, :])[:, None]


def local_layers(config) -> tuple[Optional[int], float]:
    """(the sliding window, the share of layers that use it) of a ModernBERT config; (None, 0) else."""
    window, every = getattr(config, "local_attention", None), getattr(config, "global_attn_every_n_layers", None)
    if config.model_type != "modernbert" or not window or not every:
        return None, 0.0
    layers = config.num_hidden_layers
    return window, sum(1 for i in range(layers) if i % every) / layers


def time_candidates(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    candidates: tuple[str, ...],
    repeats: int = 3,
    window: Optional[int] = None,
    local_share: float = 0.0,
    documents: bool = False,
) -> dict[str, float]:
    """Seconds of one forward + backward of each candidate on random [batch, heads, seq, head_dim]
    inputs, the best of ``repeats`` after one untimed run; a candidate this device cannot run is left
    out. With a ``window``, the mean over the layers: ``local_share`` of them under its mask. With
    ``documents``, every layer's mask keeps attention inside documents (model.attention_scope)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    inside = document_mask(shape[2], shape[0], device) if documents else None
    layers = [(inside, 1.0 - local_share)]
    if window is not None:
        local = window_mask(shape[2], window, shape[0], device)
        layers.append((local if inside is None else local & inside, local_share))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timings = {}
    for name in candidates:
        fn = _eager if name == "eager" else _sdpa(name)
        total = 0.0
        try:
            for mask, share in layers:
                if share <= 0:
                    continue
                best = float("inf")
                for i in range(repeats + 1):
                    sync()
                    start = time.perf_counter()
                    fn(q, k, v, mask).sum().backward()
                    sync()
                    if i:
                        best = min(best, time.perf_counter() - start)
                total += share * best
        except RuntimeError as exc:  # e.g. "No available kernel" for this device or dtype
            log.debug("attention candidate %s cannot run here: %s", name, exc)
            continue
        timings[name] = total
    return timings


def cache_path() -> Path:
    return default_cache_path().with_name("attention.json")


def choose(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    path: Optional[Path] = None,
    window: Optional[int] = None,
    local_share: float = 0.0,
    documents: bool = False,
) -> tuple[str, str]:
    """(the fastest candidate, what says so): cached per device, threads, dtype, shape, (ModernBERT)
    sliding window and share of local layers, and attention scope."""
    if device.type == "cuda":
        where, candidates = torch.cuda.get_device_name(device), CUDA_CANDIDATES
    else:
        where, candidates = f"{cpu_info()['model']}|threads={torch.get_num_threads()}", CPU_CANDIDATES
    key = f"{device.type}|{where}|{str(dtype).removeprefix('torch.')}|{'x'.join(map(str, shape))}"
    if window is not None:
        key += f"|window={window}@{local_share:.3f}"
    if documents:
        key += "|documents"
    path = path or cache_path()
    cache = read_cache(path)
    if key in cache:
        found = cache[key]
        return found["choice"], f"{_summary(found['ms'])}, measured {found['when']}, cached in {path}"
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        timings = time_candidates(
            device, dtype, shape, candidates, window=window, local_share=local_share, documents=documents
        )
    if not timings:
        raise RuntimeError(f"no attention candidate ran on {device} in {dtype}")
    ms = {name: round(seconds * 1e3, 3) for name, seconds in timings.items()}
    # chosen from the numbers recorded: two candidates within a rounding step of each other are a tie,
    # settled by the candidates' order, never by digits the cache does not show
    entry = {"choice": min(ms, key=ms.get), "ms": ms, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    add_to_cache(path, key, entry, "the attention timings")
    return entry["choice"], f"{_summary(ms)}, measured now"


def _summary(ms: dict) -> str:
    return "forward+backward " + ", ".join(
        f"{name} {value:.1f} ms" for name, value in sorted(ms.items(), key=lambda kv: kv[1])
    )


def resolve(
    model, wanted: str, device: torch.device, dtype: torch.dtype, micro_batch: int, seq_len: int
) -> tuple[str, str]:
    """(the attention ``model`` should use, why) for ``impl.attention`` = ``wanted``: timed here for
    ``auto`` where Hugging Face runs SDPA or eager attention; flash_attention_2 and keyed dropout's
    attention (``model.attention_dropout`` > 0: training runs it eagerly) are kept as they are."""
    built = model.config._attn_implementation
    if built not in ("sdpa", "eager"):
        return built, "as built"
    if wanted in BUILT_IN:  # it could not run here: the model was built with SDPA instead
        return "sdpa", f"impl.attention={wanted} cannot run here"
    if wanted != "auto":
        return wanted, "impl.attention"
    config = model.config
    heads = config.num_attention_heads
    window, local_share = local_layers(config)
    return choose(
        device,
        dtype,
        (micro_batch, heads, seq_len, config.hidden_size // heads),
        window=window,
        local_share=local_share,
        documents=getattr(model, "attention_scope", "row") == "document",
    )
