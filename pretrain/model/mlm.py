"""The model: a Hugging Face ``BertForMaskedLM`` or ``ModernBertForMaskedLM`` (``model.arch``) whose
MLM head runs only where tokens are predicted.

Single-device code; ZeRO and distribution live in ``pretrain.runtime.engine``. The wrapped HF model stays an
ordinary ``*ForMaskedLM`` (``MLMModel.hf_model``) so that ``save_pretrained`` gives a folder that
``AutoModelForMaskedLM.from_pretrained`` and ``pipeline("fill-mask")`` load, with the decoder tied to
the word embeddings. The trainer calls both architectures the same way: token ids plus a padding
mask (or None: no padding), never unpadded indices. With flash attention, Hugging Face unpads the
batch from that mask itself (varlen kernels); SDPA takes the mask as it is.

Sparse prediction: about 15% of tokens are predicted, and the head's decoder (H x V, V = 30k) costs
as much as several encoder layers when run on every token, so the hidden states at the masked
positions are gathered first ([N, H]) and only those go through the head. ModernBERT's own
``sparse_prediction`` option does the same with a boolean mask, whose data-dependent shape makes the
host wait for the device; the gather by ``positions`` does not.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import (
    AutoConfig,
    BertConfig,
    BertForMaskedLM,
    ModernBertConfig,
    ModernBertForMaskedLM,
    PreTrainedModel,
)

from pretrain.config.schema import ImplConfig, ModelConfig
from pretrain.model import documents as docs
from pretrain.model.keyed_dropout import KEYED_ATTENTION
from pretrain.model.masking import IGNORE_INDEX, SpecialIds
from pretrain.model.mlm_loss import fused_linear_cross_entropy, mask_padding

log = logging.getLogger("pretrain")
MASKED_LM_CLASSES = {"bert": BertForMaskedLM, "modernbert": ModernBertForMaskedLM}
# impl.attention's names for one SDPA backend (MLMModel.use_attention, pretrain.runtime.attention).
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}
# What runs where the chosen backend cannot take an input (flash on CUDA: a padding mask, ModernBERT's
# sliding-window mask, fp32): the memory-efficient kernel takes any mask in any dtype, cuDNN's
# many, and the math path (fp32 [B, H, L, L] scores) only what no other can. The CPU has flash and math only.
SDPA_FALLBACKS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
# The Hugging Face config key that records model.attention_scope in checkpoints and exports, so that
# whoever scores packed rows with the export (pretrain.eval.cli.mlm_eval) keeps the trained scope.
SCOPE_KEY = "pretrain_attention_scope"


def sdpa_chain(name: str) -> list:
    """The SDPA backends in priority order for ``impl.attention`` = ``name`` (an ``sdpa_*`` name)."""
    first = SDPA_BACKENDS[name]
    return [first, *(b for b in SDPA_FALLBACKS if b != first)]


class MLMModel(torch.nn.Module):
    def __init__(
        self,
        hf_model: PreTrainedModel,
        sparse_head: bool = True,
        fused_loss: bool = True,
        vocab_size: int | None = None,
        attention_scope: str = "row",
        sep_id: int | None = None,
    ):
        super().__init__()
        arch = hf_model.config.model_type
        if arch not in MASKED_LM_CLASSES:
            raise ValueError(f"unsupported model type {arch!r}; supported: {', '.join(MASKED_LM_CLASSES)}")
        self.hf_model = hf_model
        self.arch = arch
        self.sparse_head = sparse_head
        # The decoder and the cross-entropy in row chunks (pretrain.model.mlm_loss); needs sparse_head.
        self.fused_loss = fused_loss and sparse_head
        # The tokenizer's ids: the decoder's rows past them (model.vocab_multiple's padding) are never predicted.
        self.vocab_size = vocab_size or hf_model.config.vocab_size
        # Every batch predicts the same number of tokens (masking.fixed_count): torch.compile may then
        # trace the fused loss with its chunks; otherwise the loss runs eagerly (mlm_loss).
        self.fixed_predictions = False
        # SDPA backends in priority order (use_attention); None: PyTorch's own choice.
        self.sdpa_backends: list | None = None
        self.attention = hf_model.config._attn_implementation  # what use_attention last set
        # Names of parameters that model.init_from did not provide; the optimiser may give them a
        # higher learning rate (optim.fresh_params_lr_multiplier). Empty for a model built fresh.
        self.fresh_parameters: set[str] = set()
        # model.attention_scope: "document" keeps attention inside each packed document, found from
        # the [SEP]s of the row (pretrain.model.documents), positions restarting per document.
        if attention_scope not in ("row", "document"):
            raise ValueError(f"attention_scope must be row or document, got {attention_scope!r}")
        if attention_scope == "document" and sep_id is None:
            raise ValueError("attention_scope document needs the [SEP] id that ends each document")
        self.attention_scope, self.sep_id = attention_scope, sep_id
        # Dropout keyed by each row's sample id and the step (pretrain.model.keyed_dropout.install).
        self.dropout_key = None
        self.checkpointed = False  # the layers run again in the backward (checkpoint_layers)

    @property
    def config(self):
        return self.hf_model.config

    def key_dropout(self, sample_ids: torch.Tensor, step: int) -> None:
        """The next forward's dropout masks: keyed by each row's sample id and ``step``, so that they
        are the same at any layout (pretrain.model.keyed_dropout)."""
        self.dropout_key.set(sample_ids, step)

    def use_attention(self, name: str) -> None:
        """Run attention as ``name``: ``eager`` (Hugging Face's explicit attention), ``sdpa`` (PyTorch
        picks the kernel) or ``sdpa_<backend>`` (that SDPA backend first, then ``SDPA_FALLBACKS`` for
        the inputs it cannot take). Keyed attention-probability dropout (pretrain.model.keyed_dropout) stays: in
        training it runs its own eager attention, and SDPA with these backends in evaluation."""
        built = self.config._attn_implementation
        if name == built and built not in ("sdpa", "eager"):
            self.attention = name  # flash_attention_2 or keyed dropout's, kept as built
            return
        if name not in (*SDPA_BACKENDS, "sdpa", "eager"):
            raise ValueError(f"unknown attention {name!r}")
        if built in ("sdpa", "eager", "flash_attention_2"):  # (a resume keeps an SDPA choice where flash-attn is)
            self.config._attn_implementation = "eager" if name == "eager" else "sdpa"
        self.sdpa_backends = sdpa_chain(name) if name in SDPA_BACKENDS else None
        self.attention = name

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, L, H] final hidden states (ModernBERT's include its final norm). In document scope the
        padding mask is not needed: padding is a group of its own that no document sees."""
        if self.attention_scope == "document":
            inputs = self._document_inputs(input_ids)
        else:
            inputs = {"attention_mask": attention_mask}
        with self.attention_backends():
            return self.hf_model.base_model(input_ids=input_ids, **inputs).last_hidden_state

    def attention_backends(self):
        """The SDPA backends ``use_attention`` chose, as a context around the forward."""
        return sdpa_kernel(self.sdpa_backends, set_priority=True) if self.sdpa_backends else nullcontext()

    def recompute_context(self):
        """The context of a backward: where activation checkpointing runs the layers again there
        (``checkpoint_layers``), the forward's SDPA backends; else nothing (the default step unchanged)."""
        return self.attention_backends() if self.checkpointed else nullcontext()

    def checkpoint_layers(self) -> None:
        """``impl.activation_checkpointing``: each encoder layer keeps only its input for the backward and
        runs again there (torch's non-reentrant checkpoint; Hugging Face's layers take it)."""
        hf = self.hf_model
        # activation_checkpointing_enable since transformers 5.2x; gradient_checkpointing_enable before
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        self.checkpointed = True

    def _document_inputs(self, input_ids: torch.Tensor) -> dict:
        """Masks and position ids that keep each token inside its document (pretrain.model.documents),
        in the form the built attention takes: a boolean mask for SDPA (and keyed dropout's
        attention), an additive one for Hugging Face's eager attention; ModernBERT gets one per kind
        of layer, its local layers' within their window."""
        documents = docs.document_ids(input_ids, self.sep_id)
        built = self.config._attn_implementation
        if built not in ("sdpa", "eager", "flex_attention", KEYED_ATTENTION):
            raise NotImplementedError(f"model.attention_scope=document with attention {built!r}")
        window = self.config.sliding_window if self.arch == "modernbert" else None
        if built == "flex_attention":
            full = docs.block_mask(documents)
            local = docs.block_mask(documents, window) if window is not None else None
        else:
            full = docs.same_document(documents)
            local = docs.within_window(full, window) if window is not None else None
            if built == "eager":
                dtype = self.hf_model.get_input_embeddings().weight.dtype
                full = docs.as_additive(full, dtype)
                local = docs.as_additive(local, dtype) if local is not None else None
        attention_mask = full if local is None else {"full_attention": full, "sliding_attention": local}
        return {"attention_mask": attention_mask, "position_ids": docs.document_positions(documents)}

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """MLM logits for hidden states of any leading shape."""
        if self.arch == "bert":
            return self.hf_model.cls(hidden)
        return self.hf_model.decoder(self.hf_model.head(hidden))

    def head_transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head up to its decoder (dense, activation, norm)."""
        if self.arch == "bert":
            return self.hf_model.cls.predictions.transform(hidden)
        return self.hf_model.head(hidden)

    @property
    def decoder(self) -> torch.nn.Linear:
        """The head's last layer, H -> V; its weight is the word embeddings'."""
        return self.hf_model.get_output_embeddings()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        positions: torch.Tensor,
        labels: torch.Tensor,
        per_token: bool = False,
        want_correct: bool = True,
    ):
        """``attention_mask``: [B, L], False at padding; None means the batch has no padding, and no
        mask is built (SDPA then runs its unmasked fast path on the global layers).
        ``positions``: [N] flat indices into B*L; ``labels``: [N] ids (IGNORE_INDEX: not counted).

        Returns (loss_sum, num_correct, num_predicted): the cross-entropy summed over the predicted
        tokens in fp32 (the caller divides by the masked count of the whole step, all ranks and
        micro-steps together), and two int64 counts. Nothing here waits for the device.
        ``per_token``: the same three per position ([N] fp32 losses, [N] bools), for sums that must
        not depend on how rows are batched (evaluation, ``pretrain.eval.heldout``).
        ``want_correct=False``: num_correct is 0 without the argmax over the vocabulary, which costs
        a fifth of all the model's matmuls where matmuls are cheap (steps that do not log it).
        """
        hidden = self.encode(input_ids, attention_mask)
        if self.fused_loss and not (per_token and torch.is_grad_enabled()):
            return self._fused_loss(hidden, positions, labels, per_token, want_correct)
        if self.sparse_head:
            logits = self.head(hidden.reshape(-1, hidden.size(-1)).index_select(0, positions))
        else:
            logits = self.head(hidden).reshape(-1, self.config.vocab_size).index_select(0, positions)
        logits = mask_padding(logits.float(), self.vocab_size)  # one fp32 copy serves the loss and the accuracy
        counted = labels != IGNORE_INDEX
        if per_token:
            token_loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
            return token_loss, (logits.argmax(dim=-1) == labels) & counted, counted
        loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        if not want_correct:
            return loss_sum, torch.zeros((), dtype=torch.long, device=labels.device), counted.sum()
        num_correct = ((logits.argmax(dim=-1) == labels) & counted).sum()
        return loss_sum, num_correct, counted.sum()

    def _fused_loss(self, hidden, positions, labels, per_token: bool, want_correct: bool):
        picked = self.head_transform(hidden.reshape(-1, hidden.size(-1)).index_select(0, positions))
        decoder = self.decoder
        loss_sum, token_loss, correct = fused_linear_cross_entropy(
            picked,
            decoder.weight,
            decoder.bias,
            labels,
            want_correct=want_correct or per_token,
            vocab_size=self.vocab_size,
            fixed_rows=self.fixed_predictions,
        )
        counted = labels != IGNORE_INDEX
        if per_token:
            return token_loss, correct, counted
        num_correct = correct.sum() if want_correct else torch.zeros((), dtype=torch.long, device=labels.device)
        return loss_sum, num_correct, counted.sum()


def attention_implementation(impl: ImplConfig, scope: str = "row") -> str:
    """The attention kernel Hugging Face should use: ``impl.attention`` unless it cannot run here.

    flash_attention_2 needs a CUDA GPU of compute capability 8.0+ (Ampere or newer), the flash-attn
    package and 16-bit weights; anywhere else (a CPU, ``impl.precision: fp32``) SDPA runs instead,
    with a warning when flash attention was asked for by name.

    In document scope (``model.attention_scope``) the GPU's kernel is FlexAttention: its block mask
    is built on the device from the row's separators and skips the blocks between documents.
    flash-attn's varlen kernel would take the documents as ``cu_seqlens``, but their number sets
    that tensor's shape, which the host must read every step (or pad to the worst case, B x L / 2
    sequences, mostly empty thread blocks). FlexAttention has no backward on the CPU (torch 2.13),
    where SDPA takes a boolean mask instead."""
    if impl.attention == "flex_attention":
        return _flex_attention_or_sdpa()
    chosen = _attention_for_rows(impl)
    if scope == "document" and chosen == "flash_attention_2":
        from transformers.utils import is_torch_flex_attn_available

        if is_torch_flex_attn_available():
            log.info("attention: flex_attention (model.attention_scope=document: a block mask per document)")
            return "flex_attention"
        log.warning("attention: FlexAttention is not available: document scope runs SDPA with a mask")
        return "sdpa"
    return chosen


def _flex_attention_or_sdpa() -> str:
    """``impl.attention: flex_attention`` (document scope: the config checks it) where it can run."""
    from transformers.utils import is_torch_flex_attn_available

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device (FlexAttention has no backward on a CPU)")
    if not is_torch_flex_attn_available():
        reasons.append("this torch has no FlexAttention")
    if reasons:
        log.warning("impl.attention=flex_attention cannot run here (%s): using sdpa", "; ".join(reasons))
        return "sdpa"
    return "flex_attention"


def _attention_for_rows(impl: ImplConfig) -> str:
    wanted = impl.attention
    if wanted.startswith("sdpa_"):  # one SDPA backend: MLMModel.use_attention
        return "sdpa"
    if wanted not in ("auto", "flash_attention_2"):
        return wanted
    from transformers.utils import is_flash_attn_2_available

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device")
    elif torch.cuda.get_device_capability()[0] < 8:
        reasons.append(f"GPU compute capability {torch.cuda.get_device_capability()} < (8, 0)")
    if not is_flash_attn_2_available():
        reasons.append("the flash-attn package (>= 2.3.3) is not installed")
    if impl.precision == "fp32":
        reasons.append("impl.precision is fp32 (flash attention needs bf16 or fp16)")
    if not reasons:
        return "flash_attention_2"
    if wanted == "flash_attention_2":
        log.warning("impl.attention=flash_attention_2 cannot run here (%s): using sdpa", "; ".join(reasons))
    return "sdpa"


def _shared_sizes(model_cfg: ModelConfig, vocab_size: int, special: SpecialIds, attention: str) -> dict:
    """The Hugging Face config keys that both architectures name alike."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position_embeddings,
        initializer_range=model_cfg.initializer_range,
        pad_token_id=special.pad,
        tie_word_embeddings=True,
        attn_implementation=attention,
    )


def bert_config(model_cfg: ModelConfig, vocab_size: int, special: SpecialIds, attention: str) -> BertConfig:
    return BertConfig(
        **_shared_sizes(model_cfg, vocab_size, special, attention),
        hidden_dropout_prob=model_cfg.hidden_dropout,
        attention_probs_dropout_prob=model_cfg.attention_dropout,
        layer_norm_eps=model_cfg.layer_norm_eps,
        type_vocab_size=2,
    )


def modernbert_config(model_cfg: ModelConfig, vocab_size: int, special: SpecialIds, attention: str) -> ModernBertConfig:
    return ModernBertConfig(
        **_shared_sizes(model_cfg, vocab_size, special, attention),
        norm_eps=model_cfg.layer_norm_eps,
        attention_dropout=model_cfg.attention_dropout,
        embedding_dropout=model_cfg.embedding_dropout,
        mlp_dropout=model_cfg.mlp_dropout,
        global_attn_every_n_layers=model_cfg.global_attn_every_n_layers,
        local_attention=model_cfg.local_attention,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": model_cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": model_cfg.local_rope_theta},
        },
        bos_token_id=special.cls,
        cls_token_id=special.cls,
        eos_token_id=special.sep,
        sep_token_id=special.sep,
    )


CONFIG_BUILDERS = {"bert": bert_config, "modernbert": modernbert_config}


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def _pretrained(model_cfg: ModelConfig, vocab_size: int, attention: str, resuming: bool = False):
    """``model.init_from``'s checkpoint, and the names of the weights it did not hold (they start fresh;
    said in one line unless ``resuming``: a resume loads its checkpoint's weights over all of them)."""
    folder = model_cfg.init_from
    problems = model_cfg.init_from_problems()
    if problems:
        raise ValueError("model." + "; model.".join(problems))
    found = AutoConfig.from_pretrained(folder, local_files_only=True)
    if found.vocab_size != vocab_size:
        raise ValueError(
            f"model.init_from: {folder!r} has vocab_size {found.vocab_size}, but the data's "
            f"manifest says {vocab_size}: prepare the data with that model's tokenizer"
        )
    hf_model, loading = MASKED_LM_CLASSES[model_cfg.arch].from_pretrained(
        folder, attn_implementation=attention, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    fresh = set(loading["missing_keys"])
    if fresh and not resuming:  # one line instead of transformers' load report
        log.info(
            "model.init_from: %d weight tensors are not in %s and start fresh (%s)",
            len(fresh),
            folder,
            ", ".join(sorted({k.rsplit(".", 1)[0] for k in fresh})[:4]) + (", ..." if len(fresh) > 4 else ""),
        )
    return hf_model, fresh


def _new_model(model_cfg: ModelConfig, rows: int, special: SpecialIds, attention: str, shape_from: str | None):
    """A freshly initialised model of ``model_cfg``'s shape, or of ``shape_from``'s (a new phase)."""
    if shape_from:
        config = MASKED_LM_CLASSES[model_cfg.arch].config_class.from_json_file(shape_from)
        config._attn_implementation = attention
        if model_cfg.arch == "modernbert":  # rotary positions: no parameter, a longer context may follow
            config.max_position_embeddings = max(config.max_position_embeddings, model_cfg.max_position_embeddings)
    else:
        config = CONFIG_BUILDERS[model_cfg.arch](model_cfg, rows, special, attention)
    return MASKED_LM_CLASSES[model_cfg.arch](config)


def build_model(
    model_cfg: ModelConfig,
    vocab_size: int,
    special: SpecialIds,
    impl: ImplConfig,
    seq_len: int | None = None,
    shape_from: str | None = None,
    vocab_rows: int | None = None,
    resuming: bool = False,
) -> MLMModel:
    """A fresh encoder of ``model_cfg.arch`` from ``model_cfg`` (seed torch first for a deterministic
    init), or, with ``model_cfg.init_from``, a local HF checkpoint of that architecture whose own
    shape wins (a checkpoint without an MLM head, such as a plain ``BertModel``, gets a freshly
    initialised head; the decoder is tied to its word embeddings). ``shape_from``: a Hugging Face
    config.json whose shape wins over ``model_cfg`` (a new phase of an earlier run, whose weights
    are loaded afterwards). ``vocab_rows``: the embedding's rows (a resumed checkpoint's), instead of
    ``vocab_size`` rounded up to ``model_cfg.vocab_multiple``. ``resuming``: the weights come from a
    checkpoint next, so init_from's fresh ones are not announced. Always fp32: the engine casts for
    mixed precision."""
    rows = vocab_rows or padded_vocab(vocab_size, model_cfg.vocab_multiple)
    attention = attention_implementation(impl, model_cfg.attention_scope)
    if model_cfg.init_from:
        hf_model, fresh = _pretrained(model_cfg, vocab_size, attention, resuming)
    else:
        hf_model, fresh = _new_model(model_cfg, rows, special, attention, shape_from), set()
    if model_cfg.init_from and rows != vocab_size:
        # Rows past the tokenizer's are never read (no such id) nor predicted: their values do not matter.
        hf_model.resize_token_embeddings(rows, mean_resizing=False)
    max_pos = hf_model.config.max_position_embeddings
    if seq_len is not None and seq_len > max_pos:
        raise ValueError(f"sequence length {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    setattr(hf_model.config, SCOPE_KEY, model_cfg.attention_scope)
    hf_model.tie_weights()
    if hf_model.get_output_embeddings().weight is not hf_model.get_input_embeddings().weight:
        raise RuntimeError("the MLM decoder is not tied to the word embeddings (tie_word_embeddings=False?)")
    log.info("model: %s, attention %s", model_cfg.arch, attention)
    model = MLMModel(
        hf_model,
        sparse_head=impl.sparse_head,
        fused_loss=impl.fused_mlm_loss,
        vocab_size=vocab_size,
        attention_scope=model_cfg.attention_scope,
        sep_id=special.sep,
    )
    if impl.attention in SDPA_BACKENDS:
        model.use_attention(impl.attention)
    if impl.activation_checkpointing:
        model.checkpoint_layers()
    # What init_from did not provide (e.g. the MLM head of an encoder saved without one): the
    # optimiser may give these a higher learning rate (optim.fresh_params_lr_multiplier).
    tied = {id(hf_model.get_input_embeddings().weight)}
    model.fresh_parameters = {
        name for name, p in model.named_parameters() if name.removeprefix("hf_model.") in fresh and id(p) not in tied
    }
    return model
