"""Where the suite's time goes, printed at the end of every run: per test module its wall seconds, the
CPU seconds of the worker and of every process it waited for (launched jobs, their ranks, servers),
and the Python processes it started, by kind. Processes are seen by polling the worker's descendants
(every 0.2 s; each launched Python process imports torch and lives longer than that); Slurm's jobs
run under slurmd, not under the worker, and are counted by their ``sbatch``/``srun`` only.

The figures go to the terminal summary and, as JSON, to ``$MLM_TEST_PROFILE`` when it is set.
Imported by conftest.py; works with and without pytest-xdist (the workers send their records to the
controller, which prints one table)."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections import defaultdict

import psutil
import pytest

SUITE_START = time.time()
BUDGET_S = 60  # a module over this much wall time says why in its docstring


def _says_why(path) -> bool:
    import ast

    try:
        return "Time:" in (ast.get_docstring(ast.parse(path.read_text())) or "")
    except (OSError, SyntaxError):
        return True


def process_kind(cmdline: list[str]) -> str | None:
    """What a launched process is, for the table; None for what is not a process worth a column."""
    line = " ".join(cmdline)
    name = os.path.basename(cmdline[0]) if cmdline else ""
    if (
        "deepspeed.launcher.launch" in line
        or name == "deepspeed"
        or "pretrain.launch" in line
        or "pretrain/launch" in line
        or "deepspeed.launcher.runner" in line
    ):
        return "launcher"
    if "rank_pool.py" in line:
        return "pool_fork"  # a job's rank (or module run) forked by tests/rank_pool.py; and the pool
    if "pretrain.train" in line or "pretrain.study" in line:
        return "trainer"
    if "data_prep" in line:
        return "data_prep"
    if "mlflow" in line or "gunicorn" in line or "uvicorn" in line:
        return "mlflow"
    if name == "weed" or "weed " in line:
        return "s3"
    if name in ("sbatch", "srun", "squeue", "scontrol", "sacct", "slurmctld", "slurmd", "munged"):
        return "slurm"
    if "chrom" in name:
        return "browser"
    if name.startswith("python"):
        return "python"
    return None


class _Watcher:
    """Polls the worker's descendants and remembers each new one's kind (pids are not reused within
    a module often enough to matter: a pid seen again with another command line counts again)."""

    def __init__(self):
        self.me = psutil.Process()
        self.seen: dict[int, str] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True, name="suite-profile").start()

    def _loop(self):
        while True:
            try:
                children = self.me.children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                try:
                    cmd = child.cmdline()
                except psutil.Error:
                    continue
                key = " ".join(cmd)
                with self.lock:
                    if self.seen.get(child.pid) == key:
                        continue
                    self.seen[child.pid] = key
                    kind = process_kind(cmd)
                    if kind is not None:
                        self.counts[kind] += 1
            time.sleep(0.2)

    def take(self) -> dict[str, int]:
        with self.lock:
            counts, self.counts = dict(self.counts), defaultdict(int)
        return counts


_watcher: _Watcher | None = None
_modules: dict[str, dict] = {}


def _cpu() -> tuple[float, float]:
    from rank_pool import RANKS_CPU_S  # ranks forked by the rank pool: reaped by the pool, not by us

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    pool = RANKS_CPU_S["reported"] - RANKS_CPU_S["reaped"]
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime + pool


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _watcher
    if _watcher is None:
        _watcher = _Watcher()
    wall0 = time.time()
    own0, kids0 = _cpu()
    yield
    own1, kids1 = _cpu()
    rec = _modules.setdefault(
        item.nodeid.split("::")[0],
        {"wall_s": 0.0, "cpu_worker_s": 0.0, "cpu_children_s": 0.0, "tests": 0, "processes": defaultdict(int)},
    )
    rec["wall_s"] += time.time() - wall0
    rec["cpu_worker_s"] += own1 - own0
    rec["cpu_children_s"] += kids1 - kids0
    rec["tests"] += 1
    # A process is counted by the item running when the poll first sees it: launched Python processes
    # import torch and live for seconds, far longer than the 0.2 s between polls.
    for kind, n in _watcher.take().items():
        rec["processes"][kind] += n


def _plain(records: dict[str, dict]) -> dict[str, dict]:
    return {m: {**r, "processes": dict(r["processes"])} for m, r in records.items()}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the records over
        session.config.workeroutput["suite_profile"] = json.dumps(_plain(_modules))


def pytest_testnodedown(node, error):
    data = getattr(node, "workeroutput", {}).get("suite_profile")
    if data:
        for module, rec in json.loads(data).items():
            _modules[module] = {**rec, "processes": defaultdict(int, rec["processes"])}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workeroutput") or not _modules:
        return
    kinds = ["trainer", "pool_fork", "launcher", "data_prep", "python", "mlflow", "s3", "slurm", "browser"]
    rows = sorted(_plain(_modules).items(), key=lambda kv: -kv[1]["wall_s"])
    tr = terminalreporter
    tr.section("where the suite's time went (tests/suite_profile.py)")
    tr.write_line(
        f"{'module':34} {'tests':>5} {'wall s':>7} {'CPU s':>7} {'of it children':>14}  "
        + " ".join(f"{k:>9}" for k in kinds)
    )
    for module, r in rows:
        cpu = r["cpu_worker_s"] + r["cpu_children_s"]
        tr.write_line(
            f"{os.path.basename(module):34} {r['tests']:5d} {r['wall_s']:7.1f} {cpu:7.1f} "
            f"{r['cpu_children_s']:14.1f}  " + " ".join(f"{r['processes'].get(k, 0):9d}" for k in kinds)
        )
    total_cpu = sum(r["cpu_worker_s"] + r["cpu_children_s"] for _, r in rows)
    total_procs = {k: sum(r["processes"].get(k, 0) for _, r in rows) for k in kinds}
    wall = time.time() - SUITE_START
    tr.write_line(
        f"{'all':34} {sum(r['tests'] for _, r in rows):5d} {sum(r['wall_s'] for _, r in rows):7.1f} "
        f"{total_cpu:7.1f} {'':14}  " + " ".join(f"{total_procs[k]:9d}" for k in kinds)
    )
    unexplained = [m for m, r in rows if r["wall_s"] > BUDGET_S and not _says_why(config.rootpath / m)]
    if unexplained:
        tr.write_line(
            f"over {BUDGET_S} s of wall time without a 'Time:' paragraph in the module docstring "
            f"saying why: {', '.join(os.path.basename(m) for m in unexplained)}"
        )
    tr.write_line(f"suite wall time: {wall:.0f} s ({wall / 60:.1f} min) on {os.cpu_count()} cores")
    out = os.environ.get("MLM_TEST_PROFILE")
    if out:
        with open(out, "w") as f:
            json.dump({"wall_s": wall, "modules": dict(rows)}, f, indent=1)
