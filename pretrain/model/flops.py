"""Training FLOPs of the model, counted from its shape, and a measured matmul peak for MFU.

Counted: every matrix multiply, 2 FLOPs per multiply-add. Per layer and sequence of L tokens with
hidden size H and FFN size I:
  Q, K, V and output projections  4 x 2·L·H²
  attention scores Q·Kᵀ            2·P·H
  attention-weighted sum of V      2·P·H
  FFN, BERT (two matmuls)          2 x 2·L·H·I
  FFN, ModernBERT's GeGLU (three)  3 x 2·L·H·I   (Wi is H x 2I: value and gate halves; Wo is I x H)
P is the number of (query, key) pairs a layer attends: L² for global attention; for ModernBERT's
local layers, the pairs within the window (|i - j| <= local_attention / 2), about L·(local_attention
+ 1) when L is much longer than the window. MLM head, at the predicted tokens only (sparse) or at all
L (dense): transform 2·H² and decoder 2·H·V per token, for both architectures. Not counted: embedding
look-ups (no matmul), norms, softmax, GELU, rotary embeddings, biases, dropout and the loss
(elementwise work, under 1% at BERT sizes). Padding tokens are counted: they are computed. Training
= forward + backward, and the backward of a matmul costs two matmuls of the same size (gradients for
the input and for the weight), so training = 3 x forward. This is the model FLOPs of MFU (PaLM's
definition): what the model needs, not what the hardware executed, so activation recomputation
would not raise it, and SDPA computing a local layer's masked-out scores (flash attention skips
them) does not either.
"""

from __future__ import annotations

import time

import torch


def _get(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _arch(config) -> str:
    """'bert' or 'modernbert' from a ``ModelConfig`` (arch) or a HF config (model_type)."""
    arch = _get(config, "arch", "model_type") or "bert"
    if arch not in ("bert", "modernbert"):
        raise ValueError(f"mlm_flops_per_sequence: unknown architecture {arch!r}")
    return arch


def attention_layer_windows(config) -> list[int | None]:
    """Per layer: None for global attention, else the half-window w (a token attends |i - j| <= w)."""
    layers = int(_get(config, "num_hidden_layers", "num_layers"))
    if _arch(config) == "bert":
        return [None] * layers
    half = int(_get(config, "local_attention")) // 2
    types = getattr(config, "layer_types", None)  # HF ModernBertConfig
    if types is None:  # our ModelConfig
        every = int(_get(config, "global_attn_every_n_layers"))
        types = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(layers)]
    return [half if t == "sliding_attention" else None for t in types]


def attended_pairs(seq_len: int, half_window: int | None) -> int:
    """(query, key) pairs in a sequence of ``seq_len`` when each token attends the tokens at most
    ``half_window`` away (None: all of them)."""
    if half_window is None or half_window >= seq_len - 1:
        return seq_len * seq_len
    w = half_window  # each token itself, plus w neighbours per side minus those past the ends
    return seq_len * (2 * w + 1) - w * (w + 1)


def mlm_flops_per_sequence(
    config, seq_len: int, num_predicted_per_seq: float, sparse_head: bool = True, vocab_size: int | None = None
) -> float:
    """Training FLOPs (forward + backward) for one sequence of ``seq_len`` tokens of which
    ``num_predicted_per_seq`` (may be fractional: an average) go through a sparse head. ``config``:
    our ``ModelConfig`` or a Hugging Face ``BertConfig`` / ``ModernBertConfig``."""
    vocab = vocab_size if vocab_size is not None else getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError("mlm_flops_per_sequence: pass vocab_size (the config has none)")
    h, inter = int(config.hidden_size), int(config.intermediate_size)
    ffn_matmuls = 3 if _arch(config) == "modernbert" else 2
    length = float(seq_len)
    layers = 0.0
    for half_window in attention_layer_windows(config):
        layers += (
            8 * length * h * h + 4 * attended_pairs(seq_len, half_window) * h + ffn_matmuls * 2 * length * h * inter
        )
    head_tokens = float(num_predicted_per_seq) if sparse_head else length
    head = head_tokens * (2 * h * h + 2 * h * int(vocab))
    return 3.0 * (layers + head)


def measure_matmul_peak_tflops(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    seconds: float = 1.0,
    size: int | None = None,
    clock: str = "cpu",
) -> float:
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

    warm_up = now()
    for _ in range(3):  # cuBLAS heuristics, CPU thread pool start-up
        torch.matmul(a, b, out=out)
        sync()
        if (now() - warm_up) / threads >= seconds:  # one matmul outlasts the budget (bf16 emulated: ~2 s)
            break
    iters, elapsed, start = 0, 0.0, now()
    while elapsed < seconds:
        # Fewer syncs once the time per matmul is known, without overshooting `seconds` by much.
        batch = 1 if iters == 0 else max(1, min(64, int((seconds - elapsed) / (elapsed / iters))))
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        sync()
        iters += batch
        elapsed = (now() - start) / threads
    return 2.0 * n**3 * iters / elapsed / 1e12
