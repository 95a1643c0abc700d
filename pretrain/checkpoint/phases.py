"""A run that starts as a new phase of an earlier one (``train.init_from_checkpoint``), as BERT's and
NVIDIA's phase 2 at 512 tokens continues phase 1 at 128.

What comes from the earlier checkpoint: the model weights, the optimiser moments and its step count
(Adam's bias correction belongs to the moments; a count reset to 0 under full moments would
multiply the first updates by up to 1 / (1 - beta1)). Everything else is this run's own: data (another
sequence length or mixture), global batch, schedule (from its step 0), masking, optimiser
hyperparameters, step counter, samples and tokens seen, the tracking run.

The checkpoint may have been written at another world size, ZeRO stage or precision: it is
consolidated with ``pretrain.checkpoint.reshard`` into this run's ``out_dir`` (not the earlier run's folder,
which may be read-only or still in use), loaded, and the consolidated copy removed.

The model is the checkpoint's (its ``hf_config.json``: shape, dropout, positions), as with
``model.init_from``; ``model.*`` numbers other than ``arch`` do not apply. Refused before any process
group starts (``init_checkpoint_problems``): no complete checkpoint there, another architecture,
learned position embeddings shorter than the new data's sequence length, another tokenizer, an
optimiser whose moments do not carry over, and the run's own checkpoints folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from data_prep.common.manifest import Manifest
from pretrain.checkpoint import checkpointing, files, reshard, safe_load
from pretrain.config import loader as configlib
from pretrain.runtime import engine as eng

log = logging.getLogger("pretrain")

KEY = "train.init_from_checkpoint"
CONVERTED_DIR = "init_from_checkpoint"  # inside this run's out_dir, removed after loading


def resolve(path: str) -> tuple[Path, str]:
    """(checkpoints folder, tag) of ``path``: a tag folder, or a folder whose latest complete
    checkpoint is taken. Raises ConfigError naming what is there instead."""
    folder = Path(path)
    if (folder / files.COMPLETE).is_file():
        return folder.parent, folder.name
    tag = checkpointing.latest_complete_tag(folder)
    if tag is None:
        what = "does not exist" if not folder.exists() else "holds no complete checkpoint"
        hint = (
            " (give the run's checkpoints folder, e.g. runs/phase1/checkpoints)"
            if (folder / "checkpoints").is_dir()
            else ""
        )
        raise configlib.ConfigError([f"{KEY}={path!r}: {what}{hint}"])
    return folder, tag


def _saved(root: Path, tag: str, name: str) -> dict | None:
    try:
        text = (root / tag / name).read_text()
    except OSError:
        return None
    return yaml.safe_load(text) if name.endswith(".yaml") else json.loads(text)


def init_checkpoint_problems(cfg, manifest: Manifest) -> list[str]:
    """Everything that makes the checkpoint unusable as this run's start, by name."""
    if not cfg.train.init_from_checkpoint:
        return []
    try:
        root, tag = resolve(cfg.train.init_from_checkpoint)
    except configlib.ConfigError as exc:
        return exc.problems
    where = f"{KEY}: {root / tag}"
    if root.resolve() == checkpointing.checkpoint_root(cfg).resolve():
        return [f"{where} is this run's own checkpoints folder: a new phase needs another train.out_dir"]
    # As a resume checks its checkpoint (the first rank reads every byte), but a new phase starts only
    # from the checkpoint it names: a damaged one is refused, not replaced by an earlier one.
    damage = checkpointing.damage(root / tag, checksums=os.environ.get("RANK", "0") == "0")
    if damage:
        earlier = [t for t in checkpointing.complete_tags(root) if t < tag]
        instead = f", or start from an earlier one: {KEY}={root / earlier[-1]}" if earlier else ""
        return [f"{where} is damaged: {damage}; restore it{instead}"]
    unsafe = safe_load.code_problems(root / tag)
    if unsafe:
        return [f"{KEY}: {p}" for p in unsafe]
    model = _saved(root, tag, files.HF_CONFIG_FILE)
    if model is None:
        return [f"{where} has no readable {files.HF_CONFIG_FILE}: not a checkpoint of this trainer"]
    problems = []
    if model.get("model_type") != cfg.model.arch:
        problems.append(f"{where} holds a {model.get('model_type')!r} model, but model.arch is {cfg.model.arch!r}")
    positions = model.get("max_position_embeddings", 0)
    if model.get("model_type") == "bert" and positions < manifest.seq_len:
        problems.append(
            f"{where}: its model has max_position_embeddings {positions}, too short for the data's "
            f"seq_len {manifest.seq_len} (BERT's learned positions are parameters of that size: "
            f"train phase 1 with model.max_position_embeddings >= {manifest.seq_len})"
        )
    saved_manifest = checkpointing.saved_manifest(root, tag)
    if saved_manifest is None or saved_manifest.tokenizer.sha256 != manifest.tokenizer.sha256:
        problems.append(
            f"{where} was trained on data of another tokenizer than {cfg.data.dir}'s: prepare this "
            f"phase's data with the tokenizer of the checkpoint (its folder's tokenizer/)"
        )
    problems += _layout_problems(cfg, root / tag, where)
    return problems


def model_shape_file(cfg, resume_from: str | None) -> str | None:
    """The Hugging Face config the model is built from: the checkpoint's, whose shape wins over
    ``model.*`` (as with model.init_from); a resumed new phase reads its own checkpoint's copy."""
    if not cfg.train.init_from_checkpoint:
        return None
    root, tag = (
        (checkpointing.checkpoint_root(cfg), resume_from) if resume_from else resolve(cfg.train.init_from_checkpoint)
    )
    return str(root / tag / files.HF_CONFIG_FILE)


def saved_vocab_rows(cfg, resume_from: str | None) -> int | None:
    """The embedding rows of the checkpoint a run resumes from (its Hugging Face config's
    ``vocab_size``): a checkpoint written before ``model.vocab_multiple``, or with another one, keeps
    its shape. None for a fresh start, or a checkpoint without that file."""
    if not resume_from:
        return None
    try:
        saved = json.loads((checkpointing.checkpoint_root(cfg) / resume_from / files.HF_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return saved.get("vocab_size")


def _layout_problems(cfg, folder: Path, where: str) -> list[str]:
    saved = reshard.read_layout(folder)
    if saved is None:
        return [f"{where} has no {reshard.LAYOUT_FILE}: written by an older version, its moments cannot be read"]
    # Always converted (into this run's folder), so only what cannot be converted matters.
    wanted_other = {**reshard.config_layout(cfg), "world": -1}
    return [f"{where}: {p}" for p in reshard.check_convertible(saved, wanted_other)]


def start_from(engine, cfg, converts: bool | None = None) -> dict[str, Any]:
    """Load the weights and optimiser moments of ``train.init_from_checkpoint`` into ``engine`` (every
    rank calls); this run's optimiser hyperparameters stay. Returns what the tracker records.
    ``converts``: this rank converts into its run folder (rank 0; each node's first on node-local
    disks, where the checkpoint must be at the same path on every node)."""
    converts = dist.get_rank() == 0 if converts is None else converts
    root, tag = eng.rank0_value(resolve(cfg.train.init_from_checkpoint) if dist.get_rank() == 0 else None)
    saved = reshard.read_layout(root / tag)
    running = reshard.checkpoint_layout(engine)
    if saved["param_shapes"] != running["param_shapes"]:
        names = set(saved["param_shapes"]) | set(running["param_shapes"])
        differ = sorted(n for n in names if saved["param_shapes"].get(n) != running["param_shapes"].get(n))[:3]
        raise reshard.ReshardError(f"{KEY}: {root / tag} holds other parameters than the model, e.g. {differ}")
    optimizer = eng.inner_optimizer(engine)
    own = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in optimizer.param_groups]
    out = Path(cfg.train.out_dir) / CONVERTED_DIR / tag
    if dist.get_rank() == 0:
        log.info("%s: weights and optimiser moments from %s (saved at %s)", KEY, root / tag, reshard.describe(saved))
    if converts:
        out.parent.mkdir(parents=True, exist_ok=True)
    reshard.load_weights_and_moments(engine, reshard.ensure_universal(root / tag, saved, out=out, converts=converts))
    for group, values in zip(optimizer.param_groups, own):
        group.update(values)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out.parent, ignore_errors=True)
    state = _saved(root, tag, files.STATE_FILE) or {}
    return {
        "phase.init_from_checkpoint": str((root / tag).resolve()),
        "phase.init_from_tag": tag,
        "phase.init_from_step": state.get("step"),
        "phase.init_from_run_id": state.get("run_id") or "",
    }


def tracked_under(cfg, origin: dict):
    """The config the tracker gets: a new phase's MLflow run is a child of the earlier phase's run
    (unless something else, e.g. a study, set the parent), so the UI shows the phases together."""
    parent = origin.get("phase.init_from_run_id")
    if not parent or cfg.tracking.parent_run_id:
        return cfg
    return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, parent_run_id=parent))
