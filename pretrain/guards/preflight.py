"""Every input problem, found before any process group exists (exit 2, all reported at once).

Checked here: the data (manifest against the model, every shard present and indexable), continued
pretraining (``model.init_from`` against the data's tokenizer), the precision against the device,
and a resume: the checkpoint must be complete, and the settings that change results must be those
it was written with. Settings that change only speed (``impl``), bookkeeping (logging, evaluation
and checkpoint cadence, ``out_dir``, tracking) and a longer ``train.max_steps`` may change.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from data_prep.common.commands import location, python_command
from data_prep.common.manifest import Manifest, load_manifest
from data_prep.common.storage import open_store
from data_prep.common.tokenizer_cache import tokenizer_dir
from pretrain.checkpoint import checkpointing, files, reshard
from pretrain.checkpoint.mirror import mirror_problems
from pretrain.checkpoint.phases import init_checkpoint_problems
from pretrain.config import loader as configlib
from pretrain.config.loader import ConfigError
from pretrain.config.objective import SHAPE_FIELDS
from pretrain.config.schema import Config
from pretrain.data import make_train_stream, mixture_checks
from pretrain.data.shard_cache import cache_dir_problems
from pretrain.data.stream import DataError, check_manifest
from pretrain.runtime import engine, hardware

# Groups and keys whose change would make the resumed run a different experiment.
RESULTS_GROUPS = ("model", "masking", "optim")
RESULTS_KEYS = ("train.global_batch_size", "train.seed", "data.seed", "data.train_split", "train.init_from_checkpoint")
MANIFEST_KEYS = ("seq_len", "block_size")
log = logging.getLogger("pretrain")


def check_inputs(cfg: Config, checked: str = "the run's inputs") -> tuple[Manifest, Optional[str]]:
    """(manifest, checkpoint tag to resume from or None); raises ConfigError listing every problem
    under ``checked`` (what was checked: the run, its config); each problem names its own file."""
    manifest = load_manifest(cfg.data.dir)
    splits = [cfg.data.train_split] + ([cfg.data.eval_split] if manifest.has_split(cfg.data.eval_split) else [])
    # Also reads every shard's tar headers (cheap), so a damaged one is an input error now, not
    # a crash hours into the run.
    problems = check_manifest(manifest, cfg.data.dir, max_positions=cfg.model.max_position_embeddings, splits=splits)
    problems += mixture_checks.mixture_problems(cfg, manifest)  # every other source of data.sources, by name
    if any(open_store(d).local_dir is None for d in [cfg.data.dir, *(s.dir for s in cfg.data.sources)]):
        problems += cache_dir_problems(
            cfg.data.cache_dir, cfg.data.cache_limit_gb, max((e.bytes for e in manifest.shards), default=0)
        )
    if open_store(cfg.data.dir).local_dir is not None:  # a bucket's tokenizer is downloaded as plain files
        problems += checkpointing.tokenizer_problems(tokenizer_dir(manifest, cfg.data.dir))
    problems += init_from_problems(cfg, manifest)
    problems += hardware.precision_problems(cfg.impl.precision)
    problems += hardware.device_problems(cfg.impl)
    problems += engine.deepspeed_problems()
    mirror = mirror_problems(cfg.train.checkpoint_mirror)
    problems += mirror
    tag = None
    try:
        tag = None if mirror else checkpointing.resume_tag(cfg)  # which may come from the mirror
    except ConfigError as exc:
        problems += exc.problems
    if tag is not None:
        problems += resume_problems(cfg, manifest, checkpointing.checkpoint_root(cfg), tag)
    else:  # a new phase of an earlier run (a resumed one has its own checkpoint)
        problems += init_checkpoint_problems(cfg, manifest)
    if problems:
        raise ConfigError(problems, checked)
    unchecked = [e.name for e in manifest.shards if e.block_crc32 is None]
    if unchecked and os.environ.get("RANK", "0") == "0":
        log.warning(
            "%s: %d of %d shards have no block checksums (a manifest from before block_crc32): their blocks "
            "are checked for shape and token range only, so a shard replaced after data prep that still "
            "decodes would be trained on; `%s` adds them",
            cfg.data.dir,
            len(unchecked),
            len(manifest.shards),
            python_command("data_prep", "finalize", location(cfg.data.dir)),
        )
    if (
        cfg.train.eval_every
        and not cfg.data.sources
        and not manifest.has_split(cfg.data.eval_split)
        and os.environ.get("RANK", "0") == "0"
    ):
        log.warning(
            "train.eval_every=%d, but %s has no %r split: no held-out evaluation will run (prepare the "
            "data with data_prep shard --validation-fraction, or set train.eval_every=0)",
            cfg.train.eval_every,
            cfg.data.dir,
            cfg.data.eval_split,
        )
    return manifest, tag


def tokenizer_vocab(folder: Path) -> Optional[dict[str, int]]:
    """token -> id from a ``tokenizer.json`` or a WordPiece ``vocab.txt``; None if neither is there."""
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
    if (folder / "vocab.txt").is_file():
        lines = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
        return {tok: i for i, tok in enumerate(lines)}
    return None


def init_from_problems(cfg: Config, manifest: Manifest) -> list[str]:
    """Continued pretraining: the checkpoint must fit the data, and speak the data's tokenizer."""
    if not cfg.model.init_from:
        return []
    folder = Path(cfg.model.init_from)
    try:
        model_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"model.init_from: {folder}/config.json unreadable ({exc})"]
    problems = []
    if model_cfg.get("vocab_size") != manifest.tokenizer.vocab_size:
        problems.append(
            f"model.init_from: {folder} has vocab_size {model_cfg.get('vocab_size')}, the data's "
            f"tokenizer {manifest.tokenizer.vocab_size}: prepare the data with that model's tokenizer"
        )
    if model_cfg.get("max_position_embeddings", 512) < manifest.seq_len:
        problems.append(
            f"model.init_from: {folder} has max_position_embeddings "
            f"{model_cfg.get('max_position_embeddings')} < the data's seq_len {manifest.seq_len}"
        )
    data_tok = tokenizer_dir(manifest, cfg.data.dir)
    model_vocab, data_vocab = tokenizer_vocab(folder), tokenizer_vocab(data_tok)
    if model_vocab is None:
        problems.append(
            f"model.init_from: {folder} has no tokenizer.json or vocab.txt, so it cannot be checked "
            f"against the data's tokenizer ({data_tok}): copy the model's tokenizer files beside it"
        )
    elif data_vocab is not None and model_vocab != data_vocab:
        differ = sorted(set(model_vocab.items()) ^ set(data_vocab.items()), key=lambda kv: kv[1])[:3]
        problems.append(
            f"model.init_from: {folder}'s vocabulary differs from the one the data was tokenized "
            f"with ({data_tok}), e.g. {differ}: prepare the data with the model's tokenizer"
        )
    return problems


def resume_problems(cfg: Config, manifest: Manifest, root: Path, tag: str) -> list[str]:
    """Each setting that changes results and differs from the checkpoint's, by name."""
    try:
        saved = checkpointing.saved_config(root, tag)
    except (OSError, ValueError) as exc:
        return [f"{root / tag}: {files.CONFIG_FILE} unreadable ({exc}); cannot check the resume"]
    now = configlib.flatten(configlib.redact(configlib.to_dict(cfg)))  # as saved: credentials masked
    # A setting added since the checkpoint was written had its default then.
    before = {**configlib.flatten(configlib.to_dict(Config())), **configlib.flatten(saved)}
    keys = [k for k in sorted(set(now) | set(before)) if k.split(".")[0] in RESULTS_GROUPS or k in RESULTS_KEYS]
    if cfg.model.init_from or cfg.train.init_from_checkpoint:
        # the checkpoint's own shape decides these, and its config.yaml records that shape
        keys = [k for k in keys if k.removeprefix("model.") not in SHAPE_FIELDS]
    problems = [
        f"{k}: the checkpoint {tag} was trained with {before.get(k, '<unset>')!r}, now {now.get(k, '<unset>')!r}"
        for k in keys
        if now.get(k) != before.get(k)
    ]
    problems += mixture_checks.resume_problems(before, now, tag)
    saved_steps = before.get("train.max_steps", 0)
    if cfg.train.max_steps < saved_steps:
        problems.append(
            f"train.max_steps: may only grow on resume (the checkpoint {tag} has "
            f"{saved_steps}, now {cfg.train.max_steps})"
        )
    saved_manifest = checkpointing.saved_manifest(root, tag)
    if saved_manifest is not None:
        for key in MANIFEST_KEYS:
            if getattr(saved_manifest, key) != getattr(manifest, key):
                problems.append(
                    f"data: {key} was {getattr(saved_manifest, key)} for checkpoint {tag}, the data in "
                    f"{cfg.data.dir} has {getattr(manifest, key)}"
                )
        if saved_manifest.tokenizer.sha256 != manifest.tokenizer.sha256:
            problems.append(
                f"data: the checkpoint {tag} was trained on data from another tokenizer than {cfg.data.dir}'s"
            )
    problems += data_position_problems(cfg, manifest, root / tag)
    problems += layout_problems(cfg, root, tag)
    if problems:
        problems.append(
            "(settings that change results may not change on resume; start a new run with "
            "train.resume=none or another train.out_dir)"
        )
    return problems


def data_position_problems(cfg: Config, manifest: Manifest, folder: Path) -> list[str]:
    """The checkpoint's data position must apply to this data at this world size and micro-batch."""
    try:
        saved = json.loads((folder / files.STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        return [f"{folder}: {files.STATE_FILE} unreadable ({exc}): not a checkpoint of this version"]
    try:
        stream = make_train_stream(cfg, manifest, 0, cfg.world_size())
        stream.load_state_dict(saved.get("data", {}))
    except DataError as exc:
        return [str(exc)]
    return []


def layout_problems(cfg: Config, root: Path, tag: str) -> list[str]:
    """Another world size, ZeRO stage or precision is converted on load; what cannot be is refused now."""
    saved = reshard.read_layout(root / tag)
    if saved is None:
        return []
    return [f"train.resume={tag}: {p}" for p in reshard.check_convertible(saved, reshard.config_layout(cfg))]
