"""What a mixture must satisfy before any process group starts, and the ``plan`` verb.

All sources must share the tokenizer (its hash and vocabulary), the special ids and the sequence
length: one model reads them all. Their weights and folders are results settings: a change on
resume is refused by source name (``resume_problems``).

    python -m pretrain.data plan --config configs/mixture.yaml [dotted.overrides]

prints each source's sequences, share of the steps and epochs at ``train.max_steps``.
"""

from __future__ import annotations

import argparse
import sys

from data_prep.common.errors import ShardError
from data_prep.common.manifest import Manifest, load_manifest
from pretrain.config.schema import Config, ConfigError, load_config
from pretrain.data import make_train_stream
from pretrain.data.mixture import is_mixture, min_share_problems, resolve_sources
from pretrain.data.shard_reader import check_manifest

_SHARED = (
    ("seq_len", lambda m: m.seq_len),
    ("tokenizer sha256", lambda m: m.tokenizer.sha256),
    ("vocab_size", lambda m: m.tokenizer.vocab_size),
    ("special ids", lambda m: m.tokenizer.special_ids),
)


def mixture_problems(cfg: Config, first_manifest: Manifest) -> list[str]:
    """Every source after the first (``preflight`` checks that one as ``data.dir``) against the model
    and the first source, by name; and every source's share of a step."""
    if not is_mixture(cfg):
        return []
    sources = resolve_sources(cfg.data)
    first = sources[0]
    problems = min_share_problems(cfg)
    for src in sources[1:]:
        where = f"data.sources[{src.name}]"
        try:
            manifest = load_manifest(src.dir)
        except (ShardError, OSError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        splits = [cfg.data.train_split] + ([cfg.data.eval_split] if manifest.has_split(cfg.data.eval_split) else [])
        problems += [
            f"{where}: {p}"
            for p in check_manifest(manifest, src.dir, max_positions=cfg.model.max_position_embeddings, splits=splits)
        ]
        for label, get in _SHARED:
            if get(manifest) != get(first_manifest):
                problems.append(
                    f"{where}: {label} {get(manifest)!r} differs from the first source "
                    f"{first.name!r} ({get(first_manifest)!r}); all sources must be prepared with "
                    f"the same tokenizer and --seq-len"
                )
    return problems


def resume_problems(before: dict, now: dict, tag: str) -> list[str]:
    """The checkpoint's sources and weights against this run's, by source name (flattened configs)."""

    def table(flat: dict) -> dict[str, tuple]:
        sources = flat.get("data.sources") or []
        if not sources:
            return {"main": (flat.get("data.dir"), 1.0)}
        total = sum(s["weight"] for s in sources)
        return {s["name"]: (s["dir"], round(s["weight"] / total, 12)) for s in sources}

    old, new = table(before), table(now)
    if len(old) == 1 and len(new) == 1:
        return []  # one source: its data is checked by the manifest and the stream's fingerprint
    problems = [f"data.sources: {n!r} was a source of checkpoint {tag}, not of this run" for n in old if n not in new]
    problems += [f"data.sources: {n!r} is not a source of checkpoint {tag}" for n in new if n not in old]
    for n in [n for n in new if n in old]:
        if old[n][1] != new[n][1]:
            problems.append(f"data.sources[{n}]: weight share {old[n][1]:.4g} in checkpoint {tag}, {new[n][1]:.4g} now")
        if old[n][0] != new[n][0]:
            problems.append(f"data.sources[{n}]: dir {old[n][0]!r} in checkpoint {tag}, {new[n][0]!r} now")
    if list(old) != list(new) and not problems:
        problems.append(
            f"data.sources: the order of the sources changed since checkpoint {tag} (it seeds their orders)"
        )
    return problems


def plan(cfg: Config, world: int = 1) -> list[str]:
    """The plan's lines: each source's sequences, share of the steps and epochs at ``train.max_steps``."""
    manifest = load_manifest(cfg.data.dir)
    problems = check_manifest(manifest, cfg.data.dir, splits=[cfg.data.train_split], index_tars=False)
    problems += mixture_problems(cfg, manifest)
    if problems:
        raise ConfigError(problems, "data")
    micro = cfg.train.global_batch_size // world if cfg.train.global_batch_size % world == 0 else 1
    cfg.impl.micro_batch_size = micro  # the plan does not depend on how a step is cut
    stream = make_train_stream(cfg, manifest, 0, world)
    return [
        f"{cfg.train.max_steps} steps of {cfg.train.global_batch_size} sequences of {stream.seq_len} tokens",
        *stream.plan_lines(cfg.train.max_steps),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pretrain.data plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("verb", choices=["plan"])
    p.add_argument("--config", required=True, help="YAML file (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.max_steps=1000")
    args = p.parse_intermixed_args(argv)  # the verb, --config and overrides in any order
    try:
        lines = plan(load_config(args.config, args.overrides))
    except (ConfigError, ShardError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
