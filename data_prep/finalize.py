"""``data_prep finalize``: merge the per-task manifests into ``manifest.json`` (the format documented in
``data_prep.common.manifest``), refusing an incomplete or inconsistent set of tasks. Shards are listed in the
dataset's order (``shard.shard_order``), which does not depend on the number of tasks."""

from __future__ import annotations

import fnmatch
import json
import os

from data_prep.common.atomic import json_bytes
from data_prep.common.errors import ShardError
from data_prep.common.manifest import FORMAT_VERSION, MANIFEST, Manifest, files_sha256
from data_prep.common.shards import block_checksums, index_shard
from data_prep.common.storage import Store, open_store, sha256_bytes

from .errors import DataPrepError
from .settings import SPLITS
from .shard import TASK_MANIFEST_GLOB, shard_order, task_manifest_name

_TOTAL_KEYS = ("shards", "sequences", "tokens", "padding", "documents")


def _load_task_manifests(store: Store, listing: dict[str, int]) -> dict[int, dict]:
    names = sorted(n for n in listing if "/" not in n and fnmatch.fnmatch(n, TASK_MANIFEST_GLOB))
    if not names:
        raise DataPrepError(f"{store.url()}: no task-*.json manifests (run `data_prep shard` first)")
    tasks: dict[int, dict] = {}
    for name in names:
        path = store.url(name)
        try:
            m = json.loads(store.read_bytes(name))
        except ValueError as exc:
            raise DataPrepError(f"{path}: unreadable task manifest ({exc})") from None
        if m.get("format_version") != FORMAT_VERSION or not isinstance(m.get("task"), int):
            raise DataPrepError(f"{path}: not a task manifest of format_version {FORMAT_VERSION}")
        if "groups" not in m:
            raise DataPrepError(
                f"{path}: written by an older data_prep, which cut shards by task rather than by "
                "packing group; re-run `data_prep shard` into a new --out folder"
            )
        if name != task_manifest_name(m["task"]):
            raise DataPrepError(f"{path}: holds task {m['task']}, expected in {task_manifest_name(m['task'])}")
        tasks[m["task"]] = m
    return tasks


def _setting_differences(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join("sources" if k == "sources" else f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys)


def finalize(data_dir: str | os.PathLike) -> Manifest:
    """Write ``DIR/manifest.json`` from ``DIR/task-*.json`` and return it (DIR a folder or an s3:// URL)."""
    store = open_store(data_dir)
    store.check(write=False)
    listing = store.list()
    tasks = _load_task_manifests(store, listing)
    _check_tasks_agree(store, tasks)
    first = tasks[min(tasks)]
    _check_tokenizer_copy(store, listing, first["tokenizer"])
    _check_groups_written_once(store, tasks)
    # one order whatever the number of tasks: the dataset is the same for any K
    shards = sorted((e for m in tasks.values() for e in m["shards"]), key=shard_order)
    _check_shards_listed(store, listing, shards)
    _add_block_index(store, shards)
    manifest = _merged_manifest(store, tasks, shards)
    store.write_bytes(MANIFEST, json_bytes(manifest.to_dict()))  # last: a folder without it is unfinished
    return manifest


def _refuse(store: Store, what: str, problems: list[str]) -> None:
    if problems:
        raise DataPrepError(f"{store.url()}: {what}:\n  " + "\n  ".join(problems))


def _check_tasks_agree(store: Store, tasks: dict[int, dict]) -> None:
    """One task count, tokenizer and settings in every task manifest, and every task there."""
    first_index = min(tasks)
    first, first_name = tasks[first_index], task_manifest_name(first_index)
    num_tasks = first["num_tasks"]
    problems = []
    for index, m in sorted(tasks.items()):
        name = task_manifest_name(index)
        if m["num_tasks"] != num_tasks:
            problems.append(f"{name}: written for {m['num_tasks']} tasks, {first_name} for {num_tasks}")
        elif m["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            problems.append(
                f"{name}: tokenizer sha256 {m['tokenizer']['sha256'][:12]} differs from "
                f"{first['tokenizer']['sha256'][:12]} of {first_name}"
            )
        elif m["settings_sha256"] != first["settings_sha256"]:
            problems.append(
                f"{name}: settings differ from {first_name} ({_setting_differences(m['settings'], first['settings'])})"
            )
        if not 0 <= index < num_tasks:
            problems.append(f"{name}: task index {index} is out of range for {num_tasks} tasks")
    _refuse(store, "task manifests disagree", problems)
    missing = [i for i in range(num_tasks) if i not in tasks]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise DataPrepError(
            f"{store.url()}: incomplete: {len(missing)} of {num_tasks} tasks have no task manifest "
            f"(missing task indices: {shown}); re-run those array tasks, then finalize"
        )


def _check_tokenizer_copy(store: Store, listing: dict[str, int], tokenizer: dict) -> None:
    tok_files = {n[len(tokenizer["path"]) + 1 :]: n for n in listing if n.startswith(tokenizer["path"] + "/")}
    tok_dir = store.url(tokenizer["path"])
    if not tok_files:
        raise DataPrepError(f"{tok_dir}: the tokenizer copy is missing")
    if files_sha256({short: store.read_bytes(n) for short, n in tok_files.items()}) != tokenizer["sha256"]:
        raise DataPrepError(f"{tok_dir}: files changed since the shards were written (sha256 differs)")


def _check_groups_written_once(store: Store, tasks: dict[int, dict]) -> None:
    owner: dict[tuple, int] = {}
    problems = []
    for index, m in sorted(tasks.items()):
        for g in m.get("groups", []):
            if tuple(g) in owner:
                problems.append(
                    f"{task_manifest_name(index)}: packing group {g} was also written by "
                    f"{task_manifest_name(owner[tuple(g)])}"
                )
            owner.setdefault(tuple(g), index)
    _refuse(store, "task manifests overlap", problems)


def _check_shards_listed(store: Store, listing: dict[str, int], shards: list[dict]) -> None:
    problems = []
    for e in shards:
        if e["name"] not in listing:
            problems.append(f"{e['name']}: missing")
        elif listing[e["name"]] != e["bytes"]:
            problems.append(f"{e['name']}: {listing[e['name']]} bytes, task manifest says {e['bytes']}")
    _refuse(store, "shards do not match their task manifests", problems)


def _add_block_index(store: Store, shards: list[dict]) -> None:
    """Block offsets and checksums for shards whose task manifests predate them (read from the tars)."""
    problems = []
    for e in shards:
        if "block_offsets" not in e or "block_crc32" not in e:
            try:
                data = store.read_bytes(e["name"])
                if sha256_bytes(data) != e["sha256"]:
                    raise ShardError(
                        f"{store.url(e['name'])}: its sha256 is not its task manifest's (changed "
                        "since data prep wrote it): re-run data_prep shard"
                    )
                e.setdefault("block_offsets", index_shard(store.url(e["name"]), data))
                e["block_crc32"] = block_checksums(data, e["block_offsets"])
            except ShardError as exc:
                problems.append(str(exc))
    _refuse(store, "shards whose tar headers do not read", problems)


def _merged_manifest(store: Store, tasks: dict[int, dict], shards: list[dict]) -> Manifest:
    first = tasks[min(tasks)]
    totals = {split: {k: sum(m["totals"][split][k] for m in tasks.values()) for k in _TOTAL_KEYS} for split in SPLITS}
    settings = {
        **first["settings"],
        "inputs": first["origin"]["inputs"],
        "tokenizer_source": first["origin"]["tokenizer"],
    }
    # Through the readers' own check: a task manifest that lost a key fails here, not in every trainer.
    return Manifest.from_dict(
        {
            "format_version": FORMAT_VERSION,
            "seq_len": first["seq_len"],
            "block_size": first["block_size"],
            "dtype": first["dtype"],
            "tokenizer": dict(first["tokenizer"]),
            "num_tasks": first["num_tasks"],
            "shards": shards,
            "totals": totals,
            "settings": settings,
        },
        where=f"{store.url(MANIFEST)} (from the task manifests)",
    )
