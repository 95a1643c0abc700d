"""The model: a Hugging Face ``BertForMaskedLM`` whose MLM head runs only where tokens are predicted.

Single-device code; ZeRO and distribution live in ``pretrain.engine``. The wrapped HF model stays
an ordinary ``BertForMaskedLM`` (``MLMModel.hf_model``) so that ``save_pretrained`` gives a folder
that ``AutoModelForMaskedLM.from_pretrained`` and ``pipeline("fill-mask")`` load, with the decoder
tied to the word embeddings.

Sparse prediction: about 15% of tokens are predicted, and the head's decoder (H x V, V = 30k) costs
as much as several encoder layers when run on every token, so the hidden states at the masked
positions are gathered first ([N, H]) and only those go through the head.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

from pretrain.config import ImplConfig, ModelConfig
from pretrain.masking import IGNORE_INDEX, SpecialIds


class MLMModel(torch.nn.Module):
    def __init__(self, hf_model: BertForMaskedLM, sparse_head: bool = True, pad_id: int = 0):
        super().__init__()
        self.hf_model = hf_model
        self.sparse_head = sparse_head
        self.pad_id = pad_id

    @property
    def config(self) -> BertConfig:
        return self.hf_model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                positions: torch.Tensor, labels: torch.Tensor):
        """``positions``: [N] flat indices into B*L; ``labels``: [N] ids (IGNORE_INDEX: not counted).

        Returns (loss_sum, num_correct, num_predicted): the cross-entropy summed over the predicted
        tokens in fp32 (the caller divides by the masked count of the whole step, all ranks and
        micro-steps together), and two int64 counts. Nothing here waits for the device.
        """
        if attention_mask is None:
            attention_mask = input_ids != self.pad_id
        hidden = self.hf_model.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = self.hf_model.cls
        if self.sparse_head:
            logits = head(hidden.reshape(-1, hidden.size(-1)).index_select(0, positions))
        else:
            logits = head(hidden).reshape(-1, self.config.vocab_size).index_select(0, positions)
        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        counted = labels != IGNORE_INDEX
        num_correct = ((logits.argmax(dim=-1) == labels) & counted).sum()
        return loss_sum, num_correct, counted.sum()


def bert_config(model_cfg: ModelConfig, vocab_size: int, special: SpecialIds, attention: str) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position_embeddings,
        hidden_dropout_prob=model_cfg.hidden_dropout,
        attention_probs_dropout_prob=model_cfg.attention_dropout,
        initializer_range=model_cfg.initializer_range,
        layer_norm_eps=model_cfg.layer_norm_eps,
        type_vocab_size=2,
        pad_token_id=special.pad,
        tie_word_embeddings=True,
        attn_implementation=attention,
    )


def build_model(model_cfg: ModelConfig, vocab_size: int, special: SpecialIds, impl: ImplConfig,
                seq_len: int | None = None) -> MLMModel:
    """A fresh BERT from ``model_cfg`` (seed torch first for a deterministic init), or, with
    ``model_cfg.init_from``, a local HF checkpoint whose own architecture wins (a checkpoint without
    an MLM head, such as a plain ``BertModel``, gets a freshly initialised head transform; the
    decoder is tied to its word embeddings). Always fp32: the engine casts for mixed precision."""
    if model_cfg.init_from:
        folder = model_cfg.init_from
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"model.init_from: {folder!r} has no config.json (a local Hugging Face "
                                    "model folder is needed; nothing is downloaded at run time)")
        found = BertConfig.from_pretrained(folder, local_files_only=True).vocab_size
        if found != vocab_size:
            raise ValueError(f"model.init_from: {folder!r} has vocab_size {found}, but the data's "
                             f"manifest says {vocab_size}: prepare the data with that model's tokenizer")
        hf_model = BertForMaskedLM.from_pretrained(folder, attn_implementation=impl.attention,
                                                   dtype=torch.float32, local_files_only=True)
    else:
        hf_model = BertForMaskedLM(bert_config(model_cfg, vocab_size, special, impl.attention))
    max_pos = hf_model.config.max_position_embeddings
    if seq_len is not None and seq_len > max_pos:
        raise ValueError(f"sequence length {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    hf_model.tie_weights()
    if hf_model.cls.predictions.decoder.weight is not hf_model.bert.embeddings.word_embeddings.weight:
        raise RuntimeError("the MLM decoder is not tied to the word embeddings (tie_word_embeddings=False?)")
    return MLMModel(hf_model, sparse_head=impl.sparse_head, pad_id=special.pad)
