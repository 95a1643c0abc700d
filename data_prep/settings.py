"""The settings of ``data_prep shard``: one dataclass, optionally from a YAML file (``configs/data/``),
with command-line flags on top. Settings that change the shards are recorded in every task manifest
and must agree across tasks; ``workers``, ``batch_chars`` and ``log_every`` only change speed, and
``num_tasks``/``partition`` only change which task writes which shard (they are recorded so that
``finalize`` can check that the tasks belong together)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data_prep.common.shards import DEFAULT_BLOCK_SIZE

from .errors import DataPrepError

TXT_MODES = ("auto", "file", "blocks", "lines")  # how a .txt file becomes documents (reader.txt_rule)

SPLITS = ("train", "validation")
SPEED_ONLY = ("workers", "batch_chars", "log_every")


@dataclass
class ShardSettings:
    inputs: list[str] = field(default_factory=list)
    tokenizer: str = ""
    out: str = ""
    seq_len: int = 128
    num_tasks: int | None = None  # default: $SLURM_ARRAY_TASK_COUNT, else 1
    task_index: int | None = None  # default: from $SLURM_ARRAY_TASK_ID, else 0
    text_field: str = "text"
    txt_mode: str = "auto"  # how a .txt file becomes documents (data_prep.reader.txt_rule)
    hf_split: str = "train"  # split of a save_to_disk DatasetDict or hub dataset
    partition: str = "auto"  # auto | files | documents (see data_prep.reader)
    seed: int = 0
    validation_fraction: float = 0.0  # of documents, chosen by a hash of the text (and seed)
    shard_size: int = 16384  # sequences per shard (the last shard of a group's split holds the rest)
    group_chars: int = 1 << 26  # a packing group closes at this many characters (see data_prep.groups)
    block_size: int = DEFAULT_BLOCK_SIZE
    workers: int = 1  # tokenizer processes; 1 = in-process (Rust threads use all cores)
    batch_chars: int = 1 << 20  # characters per tokenizer batch
    log_every: float = 30.0  # seconds between progress lines when stderr is not a terminal

    def problems(self) -> list[str]:
        p = []
        if not self.inputs:
            p.append("--input: at least one file, glob, folder or hub:NAME is required")
        if not self.tokenizer:
            p.append("--tokenizer: a tokenizer folder is required")
        if not self.out:
            p.append("--out: an output folder is required")
        if self.seq_len < 3:
            p.append(f"--seq-len {self.seq_len} is too small: [CLS] x [SEP] needs at least 3 tokens")
        if self.num_tasks is not None and self.num_tasks < 1:
            p.append(f"--num-tasks {self.num_tasks}: must be at least 1")
        elif self.task_index is not None and self.num_tasks is not None and not 0 <= self.task_index < self.num_tasks:
            p.append(
                f"--task-index {self.task_index} is out of range for {self.num_tasks} task(s) "
                f"(valid: 0..{self.num_tasks - 1})"
            )
        if self.txt_mode not in TXT_MODES:
            p.append(f"--txt-mode must be one of {', '.join(TXT_MODES)}, got {self.txt_mode!r}")
        if not 0.0 <= self.validation_fraction < 1.0:
            p.append(f"--validation-fraction {self.validation_fraction}: must be in [0, 1)")
        if self.seed < 0:
            p.append(f"--seed {self.seed}: must be >= 0")
        for name in ("shard_size", "group_chars", "block_size", "workers", "batch_chars"):
            if getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        return p

    def resolved(self, environ: dict | None = None) -> "ShardSettings":
        """Task count and index filled in from Slurm's array variables; raises on any problem."""
        env = os.environ if environ is None else environ
        s = dataclasses.replace(self, inputs=list(self.inputs))
        if s.num_tasks is None:
            s.num_tasks = _env_int(env, "SLURM_ARRAY_TASK_COUNT", 1)
        if s.task_index is None:
            task_id = _env_int(env, "SLURM_ARRAY_TASK_ID", 0)
            # --array=1-8 or 0-14:2 number tasks from MIN in steps of STEP; we want 0..COUNT-1
            first = _env_int(env, "SLURM_ARRAY_TASK_MIN", 0)
            step = _env_int(env, "SLURM_ARRAY_TASK_STEP", 1) or 1
            s.task_index = (task_id - first) // step
            if not 0 <= s.task_index < s.num_tasks:
                raise DataPrepError(
                    f"task index {s.task_index} (from $SLURM_ARRAY_TASK_ID={task_id}) is out of range "
                    f"for {s.num_tasks} task(s); pass --task-index/--num-tasks"
                )
        problems = s.problems()
        if problems:
            raise DataPrepError("bad settings:\n  " + "\n  ".join(problems))
        return s

    def result_settings(self) -> dict:
        """Settings that change the shards (``inputs``/``tokenizer`` enter as resolved sources and hash)."""
        d = dataclasses.asdict(self)
        for name in SPEED_ONLY + ("inputs", "tokenizer", "out", "task_index"):
            d.pop(name)
        return d


def _env_int(env, name: str, default: int) -> int:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise DataPrepError(f"${name}={value!r} is not an integer") from None


def settings_sha256(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """A ``--config`` file: YAML holding a mapping, or a ``DataPrepError`` naming the file."""

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise DataPrepError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise DataPrepError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise DataPrepError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def load_settings_file(path: str | os.PathLike) -> dict:
    """A YAML file of ``ShardSettings`` fields (``inputs`` may be a string or a list); unknown keys and
    wrong types fail here, naming the file and key."""
    path = Path(path)
    data = read_yaml_mapping(path)
    fields = {f.name: f for f in dataclasses.fields(ShardSettings)}
    defaults = ShardSettings()
    problems, out = [], {}
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{key}: unknown setting (known: {', '.join(fields)})")
            continue
        if key == "inputs" and isinstance(value, str):
            value = [value]
        expected = type(getattr(defaults, key)) if getattr(defaults, key) is not None else int
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or isinstance(value, bool):
            problems.append(f"{key}: expected {expected.__name__}, got {value!r}")
            continue
        if key == "inputs" and not all(isinstance(v, str) for v in value):
            problems.append(f"inputs: expected a list of strings, got {value!r}")
            continue
        out[key] = value
    if problems:
        raise DataPrepError(f"{path}:\n  " + "\n  ".join(problems))
    return out
