"""Every file name in a checkpoint folder, in one place. A checkpoint folder is ``<out_dir>/checkpoints``:

latest                       the tag of the newest complete checkpoint (written last)
step00000100/                one tag folder per checkpoint
    COMPLETE                 every rank's files are on disk; only then does the tag count
    file_list.json           every other file's size and sha256, written just before COMPLETE
    config.yaml              the resolved config of the run that wrote it
    train_state.json         the TrainState without RNG, readable without DeepSpeed
    manifest.json            the data manifest the run trained on
    hf_config.json           the Hugging Face model config, for export
    layout.json              world size, ZeRO stage, precision, parameter shapes (for resharding)
    tokenizer/               the tokenizer the data was made with
    universal/               the checkpoint converted for another layout, made on first need
    mp_rank_00_model_states.pt, [bf16_]zero_pp_rank_<r>_mp_rank_00_{optim,model}_states.pt
                             DeepSpeed's own files
"""

from __future__ import annotations

import re
from pathlib import Path

from data_prep.common.manifest import MANIFEST

LATEST = "latest"  # DeepSpeed's own pointer file name; we write it ourselves, last
COMPLETE = "COMPLETE"
FILE_LIST = "file_list.json"  # every other file of the tag folder: size and sha256 (damage found at resume)
CONFIG_FILE = "config.yaml"
STATE_FILE = "train_state.json"
MANIFEST_FILE = MANIFEST  # the same name as in the shard folder: data_prep owns it
HF_CONFIG_FILE = "hf_config.json"
LAYOUT_FILE = "layout.json"
TOKENIZER_DIR = "tokenizer"
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
UNIVERSAL_DIR = "universal"  # a conversion to another layout, cached inside the tag folder
LOCK_FILE = ".lock"  # in out_dir, not in a tag folder: one job writes a run at a time
SHARED_PROBE = ".shared-probe"  # in out_dir: rank 0's token at start; a rank that cannot read it has its own disk
NODE_LISTINGS = ".nodes"  # in a mirrored tag: each other node's uploaded files, merged into FILE_LIST
# The trainer's exports inside its out_dir: hf_final (the end of the run) and hf_step<N> (export_every).
FINAL_EXPORT = "hf_final"
TAG_PATTERN = re.compile(r"step\d{8}")  # a checkpoint's tag folder; nothing else in checkpoints/ or a mirror


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def is_tag(name: str) -> bool:
    """A checkpoint tag (not an export, the report, ``latest`` or anything a user put beside them)."""
    return TAG_PATTERN.fullmatch(name) is not None


EXPORT_SOURCE = "EXPORTED_FROM"  # inside an export: the checkpoint tag it was made from, written last


RANK_FILE = r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_"  # DeepSpeed's per-rank files start so


def rank_files(folder: Path, suffix: str) -> list[Path]:
    """DeepSpeed's ``[bf16_]zero_pp_rank_<r>_mp_rank_00_<suffix>`` files in rank order."""
    pattern = re.compile(RANK_FILE + re.escape(suffix) + "$")
    found = {int(m.group(1)): folder / f.name for f in Path(folder).iterdir() if (m := pattern.match(f.name))}
    return [found[r] for r in sorted(found)]


def rank_of_file(name: str) -> int | None:
    """The rank that wrote a per-rank DeepSpeed file (its path in a tag folder); None for shared ones."""
    match = re.match(RANK_FILE, Path(name).name)
    return int(match.group(1)) if match else None
