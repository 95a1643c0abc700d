"""Stage 5, ``--stage filter`` (task I of K): per owned group, the kept records written whole as
``part-<group>.jsonl`` (or ``.parquet``), the removed ones too where asked, and a marker; the task
that finds every group's marker present writes ``report.json`` (the same bytes whoever writes it) and
removes part files no group wrote and stale work folders."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from data_prep.common.atomic import json_bytes
from data_prep.common.storage import Store

from ..cleaned_folder import FORMAT, REMOVED_FIELD, REPORT, VERSION, is_part, part_name
from ..errors import DataPrepError
from ..groups import GroupKey
from .work import WORK, Job, load_npz, map_npz, sig_name

SNIPPET = 240


def _filter_marker(key: GroupKey) -> str:
    return f"filter-{key.tag}.json"


class _Removed:
    """The step that removed each removed document, by global id: the sorted arrays of
    ``decisions.npz`` (10 bytes a removed document), read group by group (a dict of every removed
    document would cost each filter task ~100 bytes a removed document of the whole corpus)."""

    def __init__(self, ids: np.ndarray, codes: np.ndarray, names: list[str]):
        self.ids, self.codes, self.names = ids, codes, names

    def of_group(self, start: int, n: int) -> dict[int, str]:
        lo, hi = np.searchsorted(self.ids, [start, start + n])
        return {gid: self.names[c] for gid, c in zip(self.ids[lo:hi].tolist(), self.codes[lo:hi].tolist())}


def _decisions(job: Job) -> tuple[dict, _Removed]:
    """decisions.json, and the step that removed each removed document."""
    text = job.store.read_text(job.work + "decisions.json")
    if text is None:
        raise DataPrepError(f"{job.store.url(job.work)}: no decisions yet: run the clusters stage first")
    decisions = json.loads(text)
    arrays = map_npz(job.store, job.work + "decisions.npz")  # each task reads its groups' pages
    return decisions, _Removed(arrays["ids"], arrays["codes"], decisions["reasons"])


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[:SNIPPET] + "..."


def _encode(records: list[dict], output_format: str) -> bytes:
    if output_format == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def _write_part(store: Store, name: str, records: list[dict], output_format: str) -> dict:
    data = _encode(records, output_format)
    store.write_bytes(name, data)
    return {"name": name, "documents": len(records), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def stage_filter(job: Job, num_tasks: int, task: int) -> dict | None:
    """This task's groups written; returns the report when this task completed the set."""
    s, store, work = job.s, job.store, job.work
    decisions, decided = _decisions(job)
    offsets, sizes, start = {}, {}, 0
    for source, group, n in decisions["groups"]:
        offsets[GroupKey(source, group)] = start
        sizes[GroupKey(source, group)] = n
        start += n
    wanted = {i for idxs in decisions["examples"].values() for i in idxs}
    wanted |= {c[k] for c in decisions["clusters"] for k in ("kept", "removed") if c[k] is not None}
    done = {n.removeprefix(work) for n in store.list(work.rstrip("/"))}

    key, local, kept, removed, snippets = None, 0, [], [], {}

    def close():
        if key is None or _filter_marker(key) in done:
            return
        fmt = s.output_format
        marker = {
            "file": _write_part(store, part_name(key.tag, fmt), kept, fmt) if kept else None,
            "removed_file": _write_part(store, part_name(key.tag, fmt, removed=True), removed, fmt)
            if removed
            else None,
            "snippets": snippets,
        }
        store.write_bytes(work + _filter_marker(key), json_bytes(marker))

    filtered, group_removed = None, {}
    for k, record in job.owned(num_tasks, task, stage="filter"):
        if k != key:
            close()
            key, local, kept, removed, snippets = k, 0, [], [], {}
            if _filter_marker(key) not in done and key in offsets:  # language and quality removals
                filtered = load_npz(store, work + sig_name(key), only=("removed_by",))["removed_by"]
                group_removed = decided.of_group(offsets[key], sizes[key])
        if key not in offsets:
            raise DataPrepError(
                f"the inputs changed since the signatures stage (group {key.tag} is new): clean into a new --out"
            )
        i = offsets[key] + local
        local += 1
        if _filter_marker(key) in done:
            continue
        why = filtered[local - 1] or group_removed.get(i, "")
        if why:
            if s.write_removed:
                removed.append({**record, REMOVED_FIELD: why})
        else:
            kept.append(record)
        if i in wanted:
            snippets[str(i)] = [str(record.get("id", f"#{i}")), _snippet(record[s.text_field])]
    close()
    return _finish(job, decisions)


def _example(snippet: list[str], score: float | None) -> dict:
    return {"id": snippet[0], "snippet": snippet[1], **({"score": score} if score is not None else {})}


def _finish(job: Job, decisions: dict) -> dict | None:
    """``report.json`` once every group has its filter marker (by whichever task sees that first: the
    same bytes from any of them); part files and work folders of earlier runs removed."""
    store, work = job.store, job.work
    listing = store.list()
    keys = [GroupKey(src, grp) for src, grp, _ in decisions["groups"]]
    if any(work + _filter_marker(k) not in listing for k in keys):
        return None
    files, removed_files, snippets = [], [], {}
    for k in keys:
        marker = json.loads(store.read_text(work + _filter_marker(k)))
        files += [marker["file"]] if marker["file"] else []
        removed_files += [marker["removed_file"]] if marker["removed_file"] else []
        snippets.update({int(i): v for i, v in marker["snippets"].items()})
    blank = ["", ""]
    report = {
        "format": FORMAT,
        "version": VERSION,
        "settings": job.s.result_settings(),
        "settings_sha256": job.digest,
        "sources": job.identity["sources"],
        "decontaminated_against": job.identity["decontaminated_against"],
        "text_field": job.s.text_field,
        "files": files,
        "removed_files": removed_files,
        "totals": decisions["totals"],
        "removed": decisions["removed"],
        "clusters": [
            {
                "size": c["size"],
                "kept_id": snippets[c["kept"]][0],
                "kept_snippet": snippets[c["kept"]][1],
                "removed_id": snippets.get(c["removed"], blank)[0],
                "removed_snippet": snippets.get(c["removed"], blank)[1],
            }
            for c in decisions["clusters"]
        ],
        "examples": {
            why: [_example(snippets[i], decisions.get("scores", {}).get(str(i))) for i in idxs]
            for why, idxs in sorted(decisions["examples"].items())
        },
    }
    if "quality_model" in decisions:
        report["quality_model"] = {**decisions["quality_model"], "sha256": job.identity["quality_model_sha256"]}
    names = {f["name"] for f in files + removed_files}
    stale = [n for n in listing if is_part(n) and n not in names]
    stale += [n for n in listing if n.startswith(WORK + "/") and not n.startswith(work)]
    # what killed tasks left half-written (every group is done: nothing writes these names any more)
    stale += [n for n in listing if ".tmp" in n and (n.startswith(work) or is_part(n.split(".tmp")[0]))]
    if stale:
        store.delete(stale)
    # the folders of earlier settings too, not only their files (an empty one stayed on a local disk)
    for folder in sorted({"/".join(n.split("/")[:2]) for n in stale if n.startswith(WORK + "/")}):
        store.delete_folder(folder)
    store.write_bytes(REPORT, json_bytes(report))  # last: a folder without it is unfinished
    return report
