"""Training FLOPs of the model, counted from its shape, and a measured matmul peak for MFU.

Counted: every matrix multiply, 2 FLOPs per multiply-add. Per layer and sequence of L tokens with
hidden size H and FFN size I:
  Q, K, V and output projections  4 x 2·L·H²
  attention scores Q·Kᵀ            2·L²·H
  attention-weighted sum of V      2·L²·H
  FFN (two matmuls)                2 x 2·L·H·I
MLM head, at the predicted tokens only (sparse) or at all L (dense): transform 2·H² and decoder 2·H·V
per token. Not counted: embedding look-ups (no matmul), layer norms, softmax, GELU, biases, dropout
and the loss (elementwise work, under 1% at BERT sizes). Padding tokens are counted: they are
computed. Training = forward + backward, and the backward of a matmul costs two matmuls of the same
size (gradients for the input and for the weight), so training = 3 x forward. This is the model
FLOPs of MFU (PaLM's definition): what the model needs, not what the hardware executed, so
activation recomputation would not raise it.
"""
from __future__ import annotations

import time

import torch


def _shape(config, vocab_size: int | None) -> tuple[int, int, int, int]:
    """(layers, hidden, intermediate, vocab) from a ``ModelConfig`` or a HF ``BertConfig``."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers")
    vocab = vocab_size if vocab_size is not None else getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError("mlm_flops_per_sequence: pass vocab_size (the config has none)")
    return int(layers), int(config.hidden_size), int(config.intermediate_size), int(vocab)


def mlm_flops_per_sequence(config, seq_len: int, num_predicted_per_seq: float, sparse_head: bool = True,
                           vocab_size: int | None = None) -> float:
    """Training FLOPs (forward + backward) for one sequence of ``seq_len`` tokens of which
    ``num_predicted_per_seq`` (may be fractional: an average) go through a sparse head."""
    layers, h, inter, vocab = _shape(config, vocab_size)
    length = float(seq_len)
    per_layer = 8 * length * h * h + 4 * length * length * h + 4 * length * h * inter
    head_tokens = float(num_predicted_per_seq) if sparse_head else length
    head = head_tokens * (2 * h * h + 2 * h * vocab)
    return 3.0 * (layers * per_layer + head)


def measure_matmul_peak_tflops(device: torch.device | str, dtype: torch.dtype = torch.float32,
                               seconds: float = 1.0, size: int | None = None, clock: str = "cpu") -> float:
    """Achievable dense-matmul throughput (TFLOP/s) of ``device`` in ``dtype``: square matmuls
    (4096 on a GPU, 1024 on a CPU) timed for about ``seconds`` after a warm-up.

    On a CPU, ``clock="cpu"`` divides by the process's CPU seconds per thread rather than wall time:
    what the process reaches with its threads to itself, however busy the machine is while it
    measures (a peak measured on a busy machine and cached would otherwise inflate every later MFU).
    ``clock="wall"`` is what a benchmark comparing wall times wants."""
    device = torch.device(device)
    n = size or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    by_cpu = device.type == "cpu" and clock == "cpu"
    threads = torch.get_num_threads() if by_cpu else 1
    now = time.process_time if by_cpu else time.perf_counter

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):                              # cuBLAS heuristics, CPU thread pool start-up
        torch.matmul(a, b, out=out)
    sync()
    iters, elapsed, start = 0, 0.0, now()
    while elapsed < seconds:
        # Fewer syncs once the time per matmul is known, without overshooting `seconds` by much.
        batch = 1 if iters == 0 else max(1, min(64, int((seconds - elapsed) / (elapsed / iters))))
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        sync()
        iters += batch
        elapsed = (now() - start) / threads
    return 2.0 * n ** 3 * iters / elapsed / 1e12
