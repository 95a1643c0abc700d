"""What the model is and how it learns: the architecture (``model``), the masking and the optimiser
settings of the schema (``pretrain.config.schema`` assembles them with the rest)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

# Defaults that differ by architecture; a field absent from an arch's table does not apply to it.
# BERT (Devlin et al.): post-LayerNorm, learned absolute positions, GELU FFN, one dropout rate
# (hidden_dropout) for embeddings, attention output and FFN output. ModernBERT (Warner et al. 2024):
# pre-LayerNorm without biases, rotary positions, GeGLU FFN, global attention every
# global_attn_every_n_layers layers and a local_attention-token sliding window in the others,
# separate embedding/MLP dropouts (none by default).
ARCH_DEFAULTS: dict[str, dict[str, object]] = {
    "bert": {"hidden_dropout": 0.1, "attention_dropout": 0.1, "layer_norm_eps": 1e-12},
    "modernbert": {
        "attention_dropout": 0.0,
        "layer_norm_eps": 1e-5,
        "embedding_dropout": 0.0,
        "mlp_dropout": 0.0,
        "global_attn_every_n_layers": 3,
        "local_attention": 128,
        "rope_theta": 160_000.0,
        "local_rope_theta": 10_000.0,
    },
}
ARCH_SPECIFIC = sorted({name for table in ARCH_DEFAULTS.values() for name in table})


# The fields of model.* that a checkpoint's own shape decides when the run starts from one
# (model.init_from, train.init_from_checkpoint): ours -> the Hugging Face config's name.
SHAPE_FIELDS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
}


@dataclass
class ModelConfig:
    # An encoder of architecture `arch` built from these numbers, or (init_from) a local Hugging Face
    # checkpoint of that architecture for continued pretraining, whose own shape then wins over the
    # numbers below.
    arch: Literal["bert", "modernbert"] = "bert"
    init_from: Optional[str] = None
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 1024  # ModernBERT: the width of each GeGLU half (its Wi is H x 2I)
    max_position_embeddings: int = 512
    initializer_range: float = 0.02
    # Embedding and decoder rows rounded up to a multiple of this (bert-base-uncased's 30,522 -> 30,528,
    # as MosaicBERT; ModernBERT's 50,368 already is one): the decoder's matmuls run on aligned shapes.
    # The extra rows are never predicted (outside the softmax and the argmax); the export has the
    # tokenizer's size. 1: no padding. A resume keeps its checkpoint's rows.
    vocab_multiple: int = 64
    # Which tokens a token attends to in a packed row (d0 [SEP] d1 [SEP] ...): all of the row's
    # (RoBERTa's FULL-SENTENCES), or only its own document's, with positions restarting per document
    # (DOC-SENTENCES; packed BERT's and ModernBERT's per-document attention). The documents are
    # found from the separators (pretrain.model.documents), so any shard trains either way.
    attention_scope: Literal["row", "document"] = "row"
    # Left unset (null), the fields below take the arch's value from ARCH_DEFAULTS. One that does
    # not apply to the chosen arch is refused by name rather than silently ignored.
    attention_dropout: Optional[float] = None  # both: on attention probabilities (ModernBERT: and its output)
    layer_norm_eps: Optional[float] = None  # both (ModernBERT's norm_eps)
    hidden_dropout: Optional[float] = None  # bert: embeddings, attention output, FFN output
    embedding_dropout: Optional[float] = None  # modernbert
    mlp_dropout: Optional[float] = None  # modernbert: inside the GeGLU, before its output matmul
    global_attn_every_n_layers: Optional[int] = None  # modernbert: layer i is global when i % n == 0
    local_attention: Optional[int] = None  # modernbert: window of the local layers (|i - j| <= window/2)
    rope_theta: Optional[float] = None  # modernbert: rotary base of the global layers
    local_rope_theta: Optional[float] = None  # modernbert: rotary base of the local layers

    def with_shape_of(self, hf_config) -> "ModelConfig":
        """This config with the shape a Hugging Face config states (what a run started from a
        checkpoint trains, whatever ``SHAPE_FIELDS`` said)."""
        return dataclasses.replace(self, **{ours: getattr(hf_config, theirs) for ours, theirs in SHAPE_FIELDS.items()})

    def __post_init__(self):
        for name, value in ARCH_DEFAULTS.get(self.arch, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def check(self) -> list[str]:
        p = []
        applies = ARCH_DEFAULTS.get(self.arch, {})
        for name in ARCH_SPECIFIC:
            if name not in applies and getattr(self, name) is not None:
                owners = " and ".join(a for a, table in ARCH_DEFAULTS.items() if name in table)
                hint = {
                    "hidden_dropout": " (ModernBERT has embedding_dropout, attention_dropout and mlp_dropout)",
                    "embedding_dropout": " (BERT has one hidden_dropout)",
                    "mlp_dropout": " (BERT has one hidden_dropout)",
                }.get(name, "")
                p.append(f"{name}: applies to arch {owners} only, not {self.arch!r}{hint}; remove it")
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
            "vocab_multiple",
            "global_attn_every_n_layers",
            "local_attention",
            "rope_theta",
            "local_rope_theta",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                p.append(f"{name}: must be positive, got {value}")
        if self.num_heads > 0 and self.hidden_size % self.num_heads:
            p.append(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.arch == "modernbert" and self.local_attention is not None and self.local_attention % 2:
            p.append(
                f"local_attention: must be even (a token sees local_attention/2 on each side), "
                f"got {self.local_attention}"
            )
        for name in ("hidden_dropout", "attention_dropout", "embedding_dropout", "mlp_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                p.append(f"{name}: must be in [0, 1), got {value}")
        if self.init_from:
            p.extend(self.init_from_problems())
        return p

    def init_from_problems(self) -> list[str]:
        """``init_from`` is a local Hugging Face folder of this ``arch`` (the data's side is checked in preflight)."""
        if not os.path.isdir(self.init_from):
            return [f"init_from: {self.init_from!r} is not a local folder (nothing is downloaded at run time)"]
        try:
            with open(os.path.join(self.init_from, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError) as exc:
            return [f"init_from: {self.init_from}/config.json unreadable ({exc})"]
        if model_type != self.arch:
            return [
                f"init_from: {self.init_from} holds a {model_type!r} model, but arch is {self.arch!r} "
                f"(set model.arch: {model_type})"
            ]
        return []


@dataclass
class MaskingConfig:
    # Prediction and corruption are decoupled (Wettig et al. 2023): `rate` of the non-special tokens
    # are predicted (the loss covers them); of those, mask_replace_prob become [MASK],
    # random_replace_prob a random token and the rest stay visible, so rate x (mask_replace_prob +
    # random_replace_prob) of the tokens are corrupted. BERT's 80/10/10 is 0.8 and 0.1; 100/0/0 is 1
    # and 0. The names are Hugging Face's (DataCollatorForLanguageModeling), where the rate is
    # mlm_probability; elsewhere (ModernBERT's packer) `mask_prob` is the rate, hence not that name.
    rate: float = 0.15  # fraction of non-special tokens selected for prediction
    # A masking-rate schedule (Yang et al. 2023): linear from `rate` at step 0 to `rate_end` at the last
    # step of train.max_steps (pretrain.model.masking.rate_at_step); null keeps `rate` throughout.
    rate_end: Optional[float] = None
    mask_replace_prob: float = 0.8  # of the selected: replaced by [MASK]
    random_replace_prob: float = 0.1  # of the selected: replaced by a random non-special token; rest unchanged
    strategy: Literal["token", "whole_word", "span"] = "token"
    span_geometric_p: float = 0.2  # SpanBERT: span length ~ Geometric(p), clipped to span_max
    span_max: int = 10
    # Static shapes (torch.compile / CUDA graphs): ceil(rate * L) slots per row, filled with the
    # stochastically rounded rate x the row's non-special tokens; unused slots get label -100.
    # Otherwise each token is selected independently. Token strategy only.
    fixed_count: bool = False
    # true: a new mask every time a sequence is seen, keyed by (seed, the sequence's id, the step), so
    # a sample gets the same mask at any layout. false: static, as original BERT's pre-generated
    # masks: each sequence keeps one mask for the whole run, keyed by (seed, the sequence's id in its
    # split), whatever the step, epoch or resume.
    dynamic: bool = True
    seed: int = 0

    def check(self) -> list[str]:
        p = []
        if not 0.0 < self.rate < 1.0:
            p.append(f"rate: must be in (0, 1), got {self.rate}")
        if self.rate_end is not None and not 0.0 < self.rate_end < 1.0:
            p.append(f"rate_end: must be in (0, 1) or null, got {self.rate_end}")
        mask, random = self.mask_replace_prob, self.random_replace_prob
        if mask < 0 or random < 0 or mask + random > 1.0 + 1e-9:
            p.append(f"mask_replace_prob + random_replace_prob must be within [0, 1], got {mask} + {random}")
        if not 0.0 < self.span_geometric_p <= 1.0:
            p.append(f"span_geometric_p: must be in (0, 1], got {self.span_geometric_p}")
        if self.fixed_count and self.strategy != "token":
            p.append(f"fixed_count: works with strategy 'token' only, not {self.strategy!r}")
        if self.span_max < 1:
            p.append(f"span_max: must be >= 1, got {self.span_max}")
        return p


@dataclass
class OptimConfig:
    name: Literal["adamw", "lamb"] = "adamw"
    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 100
    schedule: Literal["linear", "cosine", "constant", "wsd"] = "linear"
    min_lr_ratio: float = 0.0  # the lr decays to lr * min_lr_ratio at train.max_steps
    # wsd (warmup-stable-decay): the decay takes the last decay_steps steps, or decay_fraction of
    # train.max_steps when decay_steps is 0 (pretrain/model/schedule.py; a longer run decays at its new end).
    decay_steps: int = 0
    decay_fraction: float = 0.1
    # Continued pretraining: parameters model.init_from does not hold (an encoder saved without its
    # MLM head gets a fresh one) learn this many times faster, so the new head catches up with the
    # pretrained encoder instead of the encoder drifting to meet a random head.
    fresh_params_lr_multiplier: float = 1.0

    def check(self) -> list[str]:
        p = []
        if self.lr <= 0:
            p.append(f"lr: must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            p.append(f"betas: expected two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            p.append(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            p.append(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.decay_steps < 0 or not 0 < self.decay_fraction <= 1:
            p.append(
                f"decay_steps must be >= 0 and decay_fraction in (0, 1], got {self.decay_steps}, {self.decay_fraction}"
            )
        if self.fresh_params_lr_multiplier <= 0:
            p.append(f"fresh_params_lr_multiplier: must be positive, got {self.fresh_params_lr_multiplier}")
        if self.grad_clip < 0:
            p.append(f"grad_clip: must be >= 0 (0 disables), got {self.grad_clip}")
        return p
