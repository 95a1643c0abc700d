"""What a study is: a training config, a grid of dotted keys, and one fully resolved config per variant.

A study file is an ordinary training config (``base:`` composition works) plus a ``study:`` section::

    base: tiny.yaml
    train: {max_steps: 2000}
    study:
      name: masking
      ranks: 1
      grid:
        masking.rate: [0.15, 0.3, 0.4]
        masking.strategy: [token, whole_word, span]

Command-line ``key=v1,v2,...`` adds (or replaces) a grid axis, ``key=value`` sets a value every
variant shares (and takes the key out of the grid), ``study.key=value`` sets the study section.
Every variant gets the same config except for its grid values, plus what the study itself sets:
its own ``train.out_dir`` under the study folder, ``train.resume=auto`` and the tracking keys.
All variants are built and checked before anything runs; every problem is reported at once.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep.common.errors import ShardError
from data_prep.common.manifest import load_manifest
from pretrain.config import loader as configlib
from pretrain.config.loader import ConfigError
from pretrain.config.schema import Config, upgrade_saved

# Keys the study sets per variant; a grid or a shared override on them would break the bookkeeping.
RESERVED_KEYS = ("train.out_dir", "train.resume", "tracking.run_name", "tracking.parent_run_id")


@dataclass
class StudySection:
    name: str = ""  # "" -> the config file's name
    out_dir: str = ""  # "" -> runs/study-<name>
    ranks: int = 1  # ranks per variant (local: processes; Slurm: one node's GPUs)
    grid: dict = field(default_factory=dict)  # dotted key -> list of values

    def check(self) -> list[str]:
        p = []
        if not re.fullmatch(r"[A-Za-z0-9._-]*", self.name):
            p.append(f"name: letters, digits, '.', '_' and '-' only, got {self.name!r}")
        if self.ranks < 1:
            p.append(f"ranks: must be >= 1, got {self.ranks}")
        for key, values in self.grid.items():
            if not isinstance(values, list) or not values:
                p.append(f"grid.{key}: expected a non-empty list of values, got {values!r}")
            elif len({repr(v) for v in values}) != len(values):
                p.append(f"grid.{key}: repeated values {values}")
            if key in RESERVED_KEYS or str(key).startswith("tracking."):
                p.append(f"grid.{key}: set by the study for each variant; it cannot vary")
        return p


@dataclass
class Variant:
    index: int
    name: str  # folder and MLflow run name, from the grid values
    values: dict[str, Any]  # grid key -> this variant's value
    cfg: Config

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.train.out_dir)


@dataclass
class Study:
    section: StudySection
    config_path: str
    dir: Path
    shared: dict[str, Any]  # command-line values every variant shares
    variants: list[Variant]

    @property
    def grid_keys(self) -> list[str]:
        return list(self.section.grid)


def split_args(args: list[str]) -> tuple[dict[str, Any], dict[str, list], dict[str, Any], list[str]]:
    """(study section values, grid axes, shared values, problems) from ``key=value`` arguments."""
    section, axes, shared, problems = {}, {}, {}, []
    for text in args:
        try:
            keys, value = configlib.parse_override(text)
        except ConfigError as exc:
            problems += exc.problems
            continue
        key, raw = ".".join(keys), text.split("=", 1)[1].strip()
        if keys[0] == "study":
            section[".".join(keys[1:])] = value
        elif "," in raw and raw[:1] not in "[{'\"":
            # v1,v2,...: one axis; each item parsed as YAML like a single override value
            axes[key] = [configlib.parse_override(f"x={item}")[1] for item in raw.split(",")]
        else:
            shared[key] = value
    return section, axes, shared, problems


def variant_name(values: dict[str, Any]) -> str:
    """``rate=0.15-strategy=span``: last key components, unless two grid keys share one."""
    last = [k.split(".")[-1] for k in values]
    parts = [f"{k if last.count(k.split('.')[-1]) > 1 else k.split('.')[-1]}={_text(v)}" for k, v in values.items()]
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", "-".join(parts)) or "base"


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _set(data: dict, dotted: str, value: Any) -> None:
    node = data
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


def load_study(config_path: str, args: list[str] = ()) -> Study:
    """The study from its file and command-line arguments, every variant's config built and checked.
    Raises ConfigError naming every problem of every variant."""
    data = configlib.load_yaml(config_path)
    section_data = data.pop("study", None) or {}
    if not isinstance(section_data, dict):
        raise ConfigError([f"study: expected a mapping, got {section_data!r}"], config_path)
    section_args, axes, shared, problems = split_args(list(args))
    section_data = {**section_data, "grid": dict(section_data.get("grid") or {})}
    for key, value in section_args.items():
        _set(section_data, key, value)
    section_data["grid"].update(axes)
    for key in shared:
        section_data["grid"].pop(key, None)
        if key in RESERVED_KEYS:
            problems.append(f"{key}: set by the study for each variant (use study.out_dir for the study's folder)")
    try:
        section = configlib.build(StudySection, section_data, source=f"{config_path} (study section)")
    except ConfigError as exc:
        raise ConfigError(problems + [f"study.{p}" for p in exc.problems], config_path) from None
    section.name = section.name or Path(config_path).stem
    study_dir = Path(section.out_dir or f"runs/study-{section.name}").resolve()

    variants: list[Variant] = []
    names: dict[str, dict] = {}
    keys = list(section.grid)
    world_before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(section.ranks)  # Config.check reads the world size from here
    try:
        for index, combo in enumerate(itertools.product(*(section.grid[k] for k in keys))):
            values = dict(zip(keys, combo))
            name = variant_name(values)
            if name in names:
                problems.append(f"variants {names[name]} and {values} get the same folder name {name!r}")
            names[name] = values
            variant_data = copy.deepcopy(data)
            for key, value in {
                **shared,
                **values,
                "train.out_dir": str(study_dir / name),
                "train.resume": "auto",
                "tracking.run_name": name,
            }.items():
                _set(variant_data, key, value)
            try:
                cfg = configlib.build(Config, variant_data, source=name)
                variants.append(Variant(index, name, values, cfg))
            except ConfigError as exc:
                problems += [f"variant {name}: {p}" for p in exc.problems]
    finally:
        if world_before is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = world_before
    problems += _data_problems(variants)
    problems += _reuse_problems(variants)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)), config_path)
    return Study(section, str(config_path), study_dir, shared, variants)


def _reuse_problems(variants: list[Variant]) -> list[str]:
    """A variant folder that already holds a run of other settings that change results (another
    seed, say, fixed on the command line) would be skipped as finished or resumed as if it were
    this variant: refused, naming each difference, before anything starts."""
    # lazy: the trainer's own list of the settings a resume may not change pulls in torch (~1.5 s)
    from pretrain.guards.preflight import RESULTS_GROUPS, RESULTS_KEYS

    problems = []
    for variant in variants:
        saved_file = variant.out_dir / "variant.yaml"
        if not saved_file.is_file():
            continue
        before = configlib.flatten(upgrade_saved(configlib.load_yaml(str(saved_file))))
        now = configlib.flatten(configlib.redact(configlib.to_dict(variant.cfg)))  # as saved
        for key in sorted(set(before) | set(now)):
            if (key.split(".")[0] in RESULTS_GROUPS or key in RESULTS_KEYS) and before.get(key) != now.get(key):
                problems.append(
                    f"variant {variant.name}: {variant.out_dir} holds a run with {key}={before.get(key)!r}, this "
                    f"study has {now.get(key)!r}: give this study its own study.out_dir"
                )
    return problems


def _data_problems(variants: list[Variant]) -> list[str]:
    """The trainer's own input checks, once per distinct data folder and model, before any launch."""
    # lazy: pulls in torch (~1.5 s), kept off `python -m pretrain.study`'s start-up (usage errors answer at once)
    from pretrain.data.stream import check_manifest

    problems, seen = [], set()
    for v in variants:
        cfg = v.cfg
        key = (
            cfg.data.dir,
            cfg.data.train_split,
            cfg.data.eval_split,
            cfg.model.max_position_embeddings,
            cfg.model.init_from,
        )
        if key in seen:
            continue
        seen.add(key)
        try:
            manifest = load_manifest(cfg.data.dir)
        except ShardError as exc:
            problems.append(f"data.dir: {exc}")
            continue
        has_eval = manifest.has_split(cfg.data.eval_split)
        problems += [
            f"{cfg.data.dir}/manifest.json: {p}"
            for p in check_manifest(
                manifest,
                cfg.data.dir,
                max_positions=cfg.model.max_position_embeddings,
                splits=[cfg.data.train_split] + ([cfg.data.eval_split] if has_eval else []),
            )
        ]
        if cfg.model.init_from:
            from pretrain.guards.preflight import init_from_problems  # lazy: torch, as above

            problems += init_from_problems(cfg, manifest)
    return problems


def describe(study: Study) -> dict:
    """The plan as plain data (written to the study folder and logged to the parent run)."""
    return {
        "name": study.section.name,
        "config": study.config_path,
        "ranks": study.section.ranks,
        "grid": study.section.grid,
        "shared": study.shared,
        "variants": [{"index": v.index, "name": v.name, "values": v.values} for v in study.variants],
    }


def with_tracking(cfg: Config, tracking_uri: str, parent_run_id: str) -> Config:
    """The variant's config as the study launches it: a child run of the study's run, in its store."""
    tracking = dataclasses.replace(cfg.tracking, tracking_uri=tracking_uri, parent_run_id=parent_run_id)
    return dataclasses.replace(cfg, tracking=tracking)
