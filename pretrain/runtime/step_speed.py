"""The model's own training step timed in fp32 and in bf16 on a CPU: what ``impl.precision=auto``
decides by there.

A square matmul does not tell whether a bf16 step wins. On a Xeon with AMX the bf16 matmul is
7.7x fp32 but the mini step only 1.33x (the rest of a step is not matmul); on a Xeon with
AVX-512-BF16 and no AMX the bf16 step is 1.66x *slower* than fp32, though the flags say native.
So the step itself is timed: the model the run builds, forward (sparse MLM head at the masked
positions) and backward, at the run's sequence length and masking rate, in each precision, the
weights in that precision as DeepSpeed keeps them (bf16 everywhere but the optimiser's fp32 copy).
The optimiser step is left out: it is the same fp32 update in both.

Timed by the process's CPU seconds per thread, as the matmul peak is (``pretrain.model.flops``): a
busy machine slows both precisions, not the comparison. The two alternate, and each keeps its
fastest repeat.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

# bf16 must beat fp32 by this much to be chosen: it rounds every activation and gradient to 8
# mantissa bits, which a few percent of speed does not pay for.
BF16_MARGIN = 1.10
PROBE_BATCH = 4  # sequences per timed step: enough for full-size matmuls, seconds even for BERT-large


@dataclass(frozen=True)
class StepTiming:
    fp32_s: float
    bf16_s: float

    @property
    def speedup(self) -> float:
        """fp32 time / bf16 time: above 1, bf16 is faster."""
        return self.fp32_s / max(self.bf16_s, 1e-12)

    def choice(self) -> str:
        return "bf16" if self.speedup >= BF16_MARGIN else "fp32"


@dataclass(frozen=True)
class StepProbe:
    """What to time: ``model`` (fp32, as built for the run) at ``batch`` x ``seq_len`` with
    ``n_masked`` predicted positions. ``shape`` names it in the cache."""

    model: torch.nn.Module
    batch: int
    seq_len: int
    n_masked: int
    shape: str

    def measure(self, repeats: int = 3) -> StepTiming:
        return time_step(self.model, self.batch, self.seq_len, self.n_masked, repeats)


def step_probe(model: torch.nn.Module, micro_batch: int | str, seq_len: int, masking_rate: float) -> StepProbe:
    """A run's step to time: its model at its sequence length and masking rate, ``PROBE_BATCH``
    sequences at most."""
    mc = model.config
    shape = (
        f"{mc.model_type} L{mc.num_hidden_layers} H{mc.hidden_size} A{mc.num_attention_heads} "
        f"I{mc.intermediate_size} V{mc.vocab_size} attn={mc._attn_implementation} "
        f"sparse={getattr(model, 'sparse_head', True)}"
        + (" checkpointed" if getattr(model, "checkpointed", False) else "")  # its own speed and memory
    )
    batch = PROBE_BATCH if micro_batch == "auto" else min(micro_batch, PROBE_BATCH)
    return StepProbe(model, batch, seq_len, round(masking_rate * batch * seq_len), shape)


def probe_inputs(vocab_size: int, batch: int, seq_len: int, n_masked: int):
    """Fixed random ids, masked positions and labels (their own generator: the run's RNG is untouched)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    n = max(1, min(n_masked, batch * seq_len))
    positions = torch.randperm(batch * seq_len, generator=gen)[:n].sort().values
    return ids, positions, ids.reshape(-1).index_select(0, positions)


def _one_step(model: torch.nn.Module, inputs) -> float:
    ids, positions, labels = inputs
    for p in model.parameters():
        p.grad = None
    threads = torch.get_num_threads()
    start = time.process_time()
    loss_sum, _, _ = model(ids, None, positions, labels)
    loss_sum.backward()
    return (time.process_time() - start) / threads


def time_step(model: torch.nn.Module, batch: int, seq_len: int, n_masked: int, repeats: int = 3) -> StepTiming:
    """The fastest of ``repeats`` forward + backward passes of ``model`` in fp32 and of a bf16 copy."""
    inputs = probe_inputs(model.config.vocab_size, batch, seq_len, n_masked)
    models = {"fp32": model, "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    was_training = model.training
    best = {}
    try:
        for m in models.values():
            m.train()
            _one_step(m, inputs)  # warm-up: thread pool, kernel choice, allocator
        for _ in range(repeats):
            for name, m in models.items():
                best[name] = min(best.get(name, float("inf")), _one_step(m, inputs))
    finally:
        for p in model.parameters():
            p.grad = None
        model.train(was_training)
    return StepTiming(fp32_s=best["fp32"], bf16_s=best["bf16"])
