"""Export a training checkpoint (any ZeRO stage) to a Hugging Face folder.

    python -m pretrain.export runs/tiny/checkpoints OUT_DIR            # latest complete checkpoint
    python -m pretrain.export runs/tiny/checkpoints/step00000200 OUT_DIR

The result loads with ``AutoModelForMaskedLM.from_pretrained(OUT_DIR)`` and works in
``pipeline("fill-mask", model=OUT_DIR)``: safetensors weights (fp32), config, and the tokenizer the
shards were made with (copied into every checkpoint).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import yaml

from pretrain.checkpointing import COMPLETE, latest_complete_tag

log = logging.getLogger("pretrain")
PREFIXES = ("module.", "_orig_mod.", "hf_model.")


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoint root, tag) from a root folder, a run folder or a tag folder."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path.parent, path.name
    for root in (path, path / "checkpoints"):
        tag = latest_complete_tag(root)
        if tag:
            return root, tag
    raise FileNotFoundError(f"{path}: no complete checkpoint here (expected a tag folder with {COMPLETE}, "
                            f"or a folder holding such tags)")


def fp32_state_dict(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights: gathered from ZeRO partitions (stages 1-3) or the model file (stage 0)."""
    folder = root / tag
    zero_stage = yaml.safe_load((folder / "config.yaml").read_text())["impl"]["zero_stage"]
    if zero_stage >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    else:
        state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    out = {}
    for key, value in state.items():
        while key.startswith(PREFIXES):
            key = next(key[len(p):] for p in PREFIXES if key.startswith(p))
        out[key] = value.float() if value.is_floating_point() else value
    return out


def export_checkpoint(root: str | Path, tag: str | None, out_dir: str | Path) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    root = Path(root)
    if tag is None:
        root, tag = resolve_checkpoint(root)
    folder = root / tag
    config = BertConfig.from_json_file(str(folder / "hf_config.json"))
    model = BertForMaskedLM(config)
    state = fp32_state_dict(root, tag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The decoder weight is tied to the word embeddings, so it may be absent from the file.
    missing = [k for k in missing if k not in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")]
    if missing or unexpected:
        raise RuntimeError(f"{folder}: weights do not match the model config: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder / "tokenizer").save_pretrained(out)
    log.info("exported %s -> %s", folder, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint root, run folder, or one tag folder")
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_checkpoint(args.checkpoint, None, args.out_dir)
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
