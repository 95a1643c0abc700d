"""``data_prep clean``: raw documents in, the documents worth training on out, and a report; in one
process or as five stages of Slurm jobs, with the same files either way. This module sequences the
stages; each lives in its own module.

The unit of work is the **group** of ``data_prep.groups`` (per bundle of input files, a run of
documents that closes at ``group_chars`` characters): which documents form a group depends only on the input, so
every file this command writes is named after a group, a task of a stage or is global, and its bytes
never depend on the number of tasks. ``K`` array tasks share the groups out as ``shard``'s tasks do.

1. ``--stage signatures`` (``signatures``; task I of K, the machine's cores in worker processes):
   per document of each owned group its identity, exact key, MinHash signature, word count, the
   language or quality rule that removes it and whether it copies a held-out document
   (``document``), saved as ``sig-<group>.npz`` beside the group's sorted key files
   (``sorted_keys``); then the task's marker ``sig-kK-tI.json`` listing its groups.
2. ``--stage exact`` (``dedup``; task I of K): the exact duplicates of the task's exact-key ranges,
   from every group's sorted keys: ``exact-kK-tI.npz`` (removed ids and their representatives).
3. ``--stage pairs`` (``dedup``; task I of K): the near-duplicate candidates of the task's (band,
   hash range) units, less every exact duplicate, checked on their full signatures:
   ``pairs-kK-tI.npz``, the confirmed pairs only.
4. ``--stage clusters`` (``clusters``; one job): refuses, naming them, while a task of a stage before it
   is missing; joins the confirmed pairs into clusters (each keeps the member with the smallest
   identity hash), applies the quality model's cut (``quality_cut``) and writes ``decisions.npz``
   (the step that removed each document) and ``decisions.json``.
5. ``--stage filter`` (``filter``; task I of K): per owned group, the kept records written whole as
   ``part-<group>.jsonl`` (or ``.parquet``) and a marker ``filter-<group>.json``; the task that
   finds every group's marker present writes ``report.json`` (the same bytes whoever writes it),
   removes part files no group wrote, and stale work folders.

Work files live in ``.clean/<settings hash>/`` beside the output (``work``: the job every stage
derives from the settings, the files' names and reading), each written whole (atomic), so a killed
task re-run skips finished groups (or its finished result) and writes the same bytes. Without
``--stage`` the five run in one process (K = 1). A finished folder whose ``report.json`` has the same
settings hash is left alone. ``reference`` is the in-memory clustering the staged path must match
(the tests' oracle).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass

from ..cleaned_folder import REPORT, format_table, one_line
from ..errors import DataPrepError
from ..txt_survey import log_txt_survey
from .clusters import stage_clusters
from .dedup import stage_exact, stage_pairs
from .filter import stage_filter
from .settings import CleanSettings
from .signatures import stage_signatures
from .work import Job, finished, make_job

log = logging.getLogger("data_prep")
# The stages, in order: the one list of them. ``data_prep clean --stage`` takes these names; the Slurm
# scripts spell them too (submit_clean.sh's stages, clean.sbatch's cases: only clusters is one job,
# every other an array), and tests/project/test_structure.py holds them to this list. CONTRIBUTING.md:
# how to add one.
STAGES = ("signatures", "exact", "pairs", "clusters", "filter")


@dataclass
class CleanResult:
    report: dict | None  # None until the last filter task of a staged run finishes
    skipped: bool
    seconds: float


def run_clean(s: CleanSettings, stage: str | None = None, num_tasks: int = 1, task: int = 0) -> CleanResult:
    """One stage of task ``task`` of ``num_tasks``, or (``stage`` None) all five in this process.
    Raises ``DataPrepError`` on bad input or settings before anything is written."""
    t0 = time.perf_counter()
    new_folder = stage is None and "://" not in s.out and not os.path.exists(os.path.expanduser(s.out))
    job = make_job(s, num_tasks)
    if stage in (None, "signatures"):
        log_txt_survey(job.sources, job.opts, log)
    try:
        return _run_stages(job, stage, num_tasks, task, t0)
    except DataPrepError:
        # Bad input found while reading (an empty file, damage past the first MiB): a folder this run
        # made holds nothing of use, so nothing is left behind.
        if new_folder:
            shutil.rmtree(os.path.expanduser(s.out), ignore_errors=True)
        raise


def _run_stages(job: Job, stage: str | None, num_tasks: int, task: int, t0: float) -> CleanResult:
    previous = finished(job)
    if previous is not None:
        log.info("clean: %s exists with the same settings and inputs, nothing to do", job.store.url(REPORT))
        return CleanResult(previous, skipped=True, seconds=time.perf_counter() - t0)
    report = None
    # each stage says how far along it is, and its own time when done (data_prep/progress.py)
    if stage in (None, "signatures"):
        stage_signatures(job, num_tasks, task)
    if stage in (None, "exact"):
        stage_exact(job, num_tasks, task)
    if stage in (None, "pairs"):
        stage_pairs(job, num_tasks, task)
    if stage in (None, "clusters"):
        stage_clusters(job, num_tasks)
    if stage in (None, "filter"):
        report = stage_filter(job, num_tasks, task)
        if report is None:
            log.info(
                "clean: task %d/%d: filtered in %.1f s; other tasks' groups still to come",
                task,
                num_tasks,
                time.perf_counter() - t0,
            )
    return CleanResult(report, skipped=False, seconds=time.perf_counter() - t0)


def print_summary(result: CleanResult, out: str) -> None:
    """The table, where the output is, then the one-line summary (last: ``tail -n 1`` shows it)."""
    if result.report is None:
        return
    print(format_table(result.report))
    if warning := result.report.get("quality_model", {}).get("warning"):
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    print(
        f"{out}: {result.report['totals']['out']['documents']:,} documents in {len(result.report['files'])} "
        f"file(s), report in {REPORT} ({result.seconds:.1f} s"
        f"{', unchanged since the last run' if result.skipped else ''})"
    )
    print(one_line(result.report))
