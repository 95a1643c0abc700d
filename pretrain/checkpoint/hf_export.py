"""Export a training checkpoint (any ZeRO stage) to a Hugging Face folder.

    python -m pretrain.export runs/tiny/checkpoints OUT_DIR            # latest complete checkpoint
    python -m pretrain.export runs/tiny/checkpoints/step00000200 OUT_DIR

The result loads with ``AutoModelForMaskedLM.from_pretrained(OUT_DIR)`` and works in
``pipeline("fill-mask", model=OUT_DIR)``: safetensors weights (fp32), config, and the tokenizer the
shards were made with (copied into every checkpoint). Both architectures export: the model class
comes from ``model_type`` in the checkpoint's ``hf_config.json`` (``BertForMaskedLM`` or
``ModernBertForMaskedLM``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from data_prep.common.errors import ShardError
from data_prep.common.manifest import load_manifest
from pretrain.checkpoint import safe_load
from pretrain.checkpoint.checkpointing import checkpoint_root, latest_complete_tag, tag_for_step
from pretrain.checkpoint.files import COMPLETE, EXPORT_SOURCE, FINAL_EXPORT, HF_CONFIG_FILE, TOKENIZER_DIR
from pretrain.checkpoint.reshard import consolidate, read_layout
from pretrain.runtime import engine as eng
from pretrain.runtime.launcher import accelerator_env
from pretrain.tracking import console

log = logging.getLogger("pretrain")
PREFIXES = ("module.", "_orig_mod.", "hf_model.")


def final_export_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / FINAL_EXPORT


def step_export_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / f"hf_step{step:08d}"


def exported_from(export_dir: str | Path) -> str | None:
    """The checkpoint tag an export was made from; None when it is missing or unfinished."""
    source = Path(export_dir) / EXPORT_SOURCE
    return source.read_text().strip() if source.is_file() else None


def export_to(root: Path, tag: str, out: Path, weights: Optional[dict] = None) -> None:
    """Export checkpoint ``tag`` to ``out`` atomically: a kill leaves the old folder or none.
    ``weights``: the checkpoint's fp32 weights gathered from the engine, when its folder here does not
    hold every rank's shards (node-local disks)."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(root, tag, tmp, weights)
    (tmp / EXPORT_SOURCE).write_text(tag + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def export_and_log(cfg, step: int, tracker, final: bool, engine=None) -> None:
    """The trainer's export of its checkpoint at ``step`` (to ``hf_final``, or ``hf_step<N>``) by the
    first rank, handed to the tracker; every rank calls, and waits for it. With ``engine`` (the
    checkpoint's folder on rank 0 lacks the other nodes' shards), the weights come from the engine."""
    weights = eng.full_fp32_weights(engine, keep=dist.get_rank() == 0) if engine is not None else None
    if dist.get_rank() == 0:
        out = final_export_dir(cfg.train.out_dir) if final else step_export_dir(cfg.train.out_dir, step)
        with console.chatter_to_file():
            export_to(checkpoint_root(cfg), tag_for_step(step), out, weights)
        tracker.log_model(str(out), step, final=final)
    dist.barrier()


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoint root, tag) from a root folder, a run folder or a tag folder."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path.parent, path.name
    for root in (path, path / "checkpoints"):
        tag = latest_complete_tag(root)
        if tag:
            return root, tag
    raise FileNotFoundError(
        f"{path}: no complete checkpoint here (expected a tag folder with {COMPLETE}, or a folder holding such tags)"
    )


def fp32_state_dict(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights and the module's buffers. The resharder's reader takes every layout the
    trainer writes (ZeRO 1/2 partitions, BF16_Optimizer's, ZeRO 3's, stage 0's module or its fp32
    masters); DeepSpeed's zero_to_fp32 reads neither BF16_Optimizer's files nor stage 0."""
    folder = root / tag
    problems = safe_load.code_problems(folder)
    if problems:
        raise safe_load.UnsafeCheckpoint("; ".join(problems))
    layout = read_layout(folder)
    if layout is None:  # written before layout.json: ZeRO's own files, stages 1-3
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with safe_load.weights_only():
            state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    else:
        params, _, _, model_states = consolidate(folder, layout, moments=())  # the weights alone
        module = model_states.get("module") or {}
        state = {name: module[name] for name in model_states.get("buffer_names") or [] if name in module}
        state.update({name: held["fp32"] for name, held in params.items()})
    return hf_names(state)


def hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's parameter names as the Hugging Face model's, floats as fp32."""
    out = {}
    for key, value in state.items():
        while key.startswith(PREFIXES):
            key = next(key[len(p) :] for p in PREFIXES if key.startswith(p))
        out[key] = value.float() if value.is_floating_point() else value
    return out


def hf_masked_lm(hf_config_json: str | Path):
    """An untrained ``*ForMaskedLM`` (BERT or ModernBERT, from ``model_type``) for a saved config."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    fields = json.loads(Path(hf_config_json).read_text())
    model_type = fields.pop("model_type", None)
    if model_type not in ("bert", "modernbert"):
        raise RuntimeError(
            f"{hf_config_json}: model_type {model_type!r} is not one this trainer makes ('bert' or 'modernbert')"
        )
    # SDPA runs everywhere; a run trained with flash attention exports the same weights.
    config = AutoConfig.for_model(model_type, **fields)
    return AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Second names of shared parameters (the decoder tied to the word embeddings, BERT's decoder
    bias to its head bias): ZeRO checkpoints may hold them under one name only."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def _tokenizer_vocab_size(folder: Path) -> int | None:
    """The data's vocabulary (the manifest saved beside the checkpoint); None when it is not there."""
    try:
        return load_manifest(folder).tokenizer.vocab_size
    except ShardError:
        return None


def export_checkpoint(root: str | Path, tag: str | None, out_dir: str | Path, weights: Optional[dict] = None) -> Path:
    from transformers import AutoTokenizer

    root = Path(root)
    if tag is None:
        root, tag = resolve_checkpoint(root)
    folder = root / tag
    state = fp32_state_dict(root, tag) if weights is None else hf_names(weights)
    # Built once the weights are gathered, not beside the rank files being read: one copy less at
    # the peak. The model takes the gathered tensors themselves (assign), not copies of them.
    model = hf_masked_lm(folder / HF_CONFIG_FILE)
    tied = tied_parameter_names(model)  # before assigning: it unties them until tie_weights() below
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"{folder}: weights do not match the model config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    tokens = _tokenizer_vocab_size(folder)
    if tokens is not None and model.config.vocab_size > tokens:
        # model.vocab_multiple's padding rows were never predicted: the export has the tokenizer's size,
        # so that AutoTokenizer and the model agree for everyone who loads it.
        model.resize_token_embeddings(tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder / TOKENIZER_DIR)
    if model.config.model_type == "modernbert":
        # ModernBERT has no segment embeddings: a BERT tokenizer's token_type_ids would be refused.
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    tokenizer.save_pretrained(out)
    log.info("exported %s (%s) -> %s", folder, model.config.model_type, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pretrain.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="checkpoint root, run folder, or one tag folder")
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    accelerator_env(os.environ)  # without a GPU, DeepSpeed (read for ZeRO files) is told so instead of warning
    try:
        out = export_checkpoint(args.checkpoint, None, args.out_dir)
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
