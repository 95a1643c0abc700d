"""Stage 4, ``--stage clusters`` (one job, the join): the removals of every stage before it (the
rules' and decontamination's per group, the exact and pairs tasks' files) joined into the decisions:
confirmed pairs into clusters (each keeps the member with the smallest identity), then the quality
model's cut (``quality_cut``) over what every other step kept; writes ``decisions.npz`` (the step that
removed each document) and ``decisions.json`` (counts, examples, the largest clusters)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from data_prep.common.atomic import json_bytes

from ..progress import Steps
from .quality_cut import quality_model_cut
from .sorted_keys import Components, clusters_of
from .work import Job, by_group, corpus, group_sig, load_npz, result_names, save_npz, sig_name

EXAMPLES = 3
CLUSTERS = 5


def _exact_removed(job: Job, num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(removed, representatives) of every exact task, by removed id."""
    parts = [load_npz(job.store, name) for name in result_names(job, "exact", num_tasks)]
    removed = np.concatenate([np.zeros(0, np.int64)] + [p["removed"] for p in parts])
    reps = np.concatenate([np.zeros(0, np.int64)] + [p["reps"] for p in parts])
    order = np.argsort(removed)
    return removed[order], reps[order]


@dataclass
class _Tally:
    """What was removed, by reason: documents, words and the first examples (global ids), counted
    the same way for the rules' removals and the duplicates'."""

    words_in: int = 0
    removed: dict = dataclasses.field(default_factory=dict)
    examples: dict = dataclasses.field(default_factory=dict)
    scores: dict = dataclasses.field(default_factory=dict)  # the quality model's score of each example

    def count(self, why: np.ndarray, words: np.ndarray, gids: np.ndarray, scores: np.ndarray | None = None) -> None:
        """Documents ``gids`` (ascending), removed for ``why`` (a reason each), of ``words`` words each;
        the first EXAMPLES of a reason are its examples, with their scores where finite."""
        for reason in sorted(set(why.tolist())):
            at = np.flatnonzero(why == reason)
            entry = self.removed.setdefault(reason, {"documents": 0, "words": 0})
            entry["documents"] += len(at)
            entry["words"] += int(words[at].sum())
            examples = self.examples.setdefault(reason, [])
            for i in at[: EXAMPLES - len(examples)].tolist():
                examples.append(int(gids[i]))
                if scores is not None and scores[i] == scores[i]:
                    self.scores[str(int(gids[i]))] = round(float(scores[i]), 4)

    def documents(self) -> int:
        return sum(e["documents"] for e in self.removed.values())


def stage_clusters(job: Job, num_tasks: int) -> None:
    """The join: the removals of every stage before it (the rules' and decontamination's per group,
    the exact and pairs tasks' files) into the decisions; memory is 4 bytes a document and what the
    duplicates need, not the candidates or the confirmed pairs (read one task's file at a time)."""
    groups, offsets, n = corpus(job, num_tasks)
    # the files it reads: every group's signatures twice (the rules' removals, the decisions' words)
    # and every pairs task's file
    steps = Steps("clean clusters", 2 * len(groups) + num_tasks, "files read", job.s.log_every)
    tally = _Tally()
    decont = _rules_and_contamination(job, groups, offsets, tally, steps.advance)
    exact_removed, exact_reps = _exact_removed(job, num_tasks)
    joined = Components(n)
    for name in result_names(job, "pairs", num_tasks):  # one task's confirmed pairs at a time
        joined.add(load_npz(job.store, name, ("pairs",))["pairs"])
        steps.advance()
    near_removed, near_reps = _near_clusters(job, groups, offsets, joined.labels())
    del joined  # here and below: what a document or a removal needs is freed once used
    clusters_found = _biggest_clusters(exact_removed, exact_reps, near_removed, near_reps)
    del exact_reps, near_reps
    gone = np.sort(np.concatenate([decont, exact_removed, near_removed]))
    model_removed, model_report = quality_model_cut(job, groups, offsets, gone)
    del gone
    names = ["", "decontamination", "exact_duplicate", "near_duplicate"] + ["quality_model"] * bool(model_report)
    parts = [decont, exact_removed, near_removed, model_removed][: len(names) - 1]
    codes = np.concatenate([np.full(len(p), c + 1, np.uint16) for c, p in enumerate(parts)])
    ids = np.concatenate(parts)
    del parts, decont, exact_removed, near_removed, model_removed
    order = np.argsort(ids)
    ids, codes = ids[order], codes[order]
    del order
    removals = list(by_group(offsets, ids))
    steps.total -= len(groups) - len(removals)  # a group with nothing removed is not read again
    for g, at in removals:
        sig = group_sig(job, groups[g][0], "words", "quality_scores")
        scores = sig.quality_scores if len(sig.quality_scores) else np.full(len(sig.words), np.nan)
        local = ids[at] - offsets[g]
        tally.count(np.array(names)[codes[at]], sig.words[local], ids[at], scores[local])
        steps.advance()
    steps.close()
    save_npz(job.store, job.work + "decisions.npz", ids=ids, codes=codes)
    _write_decisions(job, groups, n, names, tally, clusters_found, model_report)


def _rules_and_contamination(job: Job, groups, offsets, tally: _Tally, advance) -> np.ndarray:
    """Per group, what language and quality removed (counted, never held) and its words; returns
    the global ids of the copies of held-out files (marked by the signatures stage)."""
    contaminated = [np.zeros(0, np.int64)]
    for (key, _), offset in zip(groups, offsets):
        d = load_npz(job.store, job.work + sig_name(key), ("words", "removed_by", "contaminated"))
        words, removed_by = d["words"], d["removed_by"]
        tally.words_in += int(words.sum())
        gone = np.flatnonzero(removed_by != "")
        tally.count(removed_by[gone], words[gone], gone + offset)
        contaminated.append(np.flatnonzero(d["contaminated"]) + offset)
        advance()
    return np.concatenate(contaminated)


def _near_clusters(job: Job, groups, offsets, label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(removed, representatives) of the components of the confirmed pairs, each keeping its member
    with the smallest identity (its key, read from its group's signatures)."""

    def ident_of(members: np.ndarray) -> np.ndarray:
        ident = np.empty(len(members), "S16")
        for g, at in by_group(offsets, members):
            ident[at] = group_sig(job, groups[g][0], "keys").keys[members[at] - offsets[g]]
        return ident

    return clusters_of(label, ident_of)


def _biggest_clusters(exact_removed, exact_reps, near_removed, near_reps) -> list[dict]:
    """The CLUSTERS largest clusters (an exact duplicate belongs to its representative's near
    cluster): size, the member kept, the smallest member removed."""
    final_exact = exact_reps.copy()
    if len(near_removed) and len(exact_reps):
        at = np.minimum(np.searchsorted(near_removed, exact_reps), len(near_removed) - 1)
        hit = near_removed[at] == exact_reps
        final_exact[hit] = near_reps[at[hit]]
    final = np.concatenate([final_exact, near_reps])
    dup_ids = np.concatenate([exact_removed, near_removed])
    reps, counts = np.unique(final, return_counts=True)
    top = np.lexsort((reps, -counts))[:CLUSTERS]
    return [
        {"size": int(counts[i]) + 1, "kept": int(reps[i]), "removed": int(dup_ids[final == reps[i]].min())} for i in top
    ]


def _write_decisions(
    job: Job, groups, n: int, names: list[str], tally: _Tally, clusters_found: list, model_report: dict
) -> None:
    job.store.write_bytes(
        job.work + "decisions.json",
        json_bytes(
            {
                "settings_sha256": job.digest,
                "reasons": names,
                "groups": [[k.source, k.group, c] for k, c in groups],
                "totals": {
                    "in": {"documents": n, "words": tally.words_in},
                    "out": {
                        "documents": n - tally.documents(),
                        "words": tally.words_in - sum(e["words"] for e in tally.removed.values()),
                    },
                },
                "removed": dict(sorted(tally.removed.items())),
                "examples": dict(sorted(tally.examples.items())),
                "clusters": clusters_found,
                **({"quality_model": model_report, "scores": tally.scores} if model_report else {}),
            }
        ),
    )
