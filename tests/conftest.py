"""Shared fixtures. Area-specific fixtures live next to their tests."""

from __future__ import annotations

import atexit
import base64
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

import suite_profile
import tiers
from s3_server import own_s3_server, s3_server  # noqa: F401 -- S3 servers for any test that asks

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
DEEPSPEED = str(Path(PY).with_name("deepspeed"))
sys.path.insert(0, str(REPO))

# Two cores on CI: one thread per process keeps multi-rank tests from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every launched process compiles this checkout's modules again where bytecode is not written (CI
# machines set PYTHONDONTWRITEBYTECODE): ~0.1 s of CPU each, ~300 processes a suite.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# The suite runs on the CPU (gloo, 2 ranks as 2 processes) on every machine: on a GPU machine it hides
# the GPUs from torch and DeepSpeed, unless MLM_TESTS_ON_GPU=1 (then what needs a CPU-only machine
# skips or fails, and the multi-rank tests need 2 GPUs).
if os.environ.get("MLM_TESTS_ON_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cpu"


# The measured matmul peak is cached per machine; tests keep theirs apart from the user's cache, in a
# folder that the process which made it (pytest-xdist's controller: its workers inherit the variable)
# removes when it exits; not a process forked from it that exits through atexit.
def _remove_cache(folder: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


if "MLM_PRETRAIN_CACHE" not in os.environ:
    os.environ["MLM_PRETRAIN_CACHE"] = tempfile.mkdtemp(prefix="mlm-pretrain-cache-")
    atexit.register(_remove_cache, os.environ["MLM_PRETRAIN_CACHE"], os.getpid())


# The modules that took longest (wall seconds under the README's command on a 2-core AVX2-only EPYC,
# 2026-11-26, with the rank pool): under pytest-xdist (``-n 3 --dist loadfile --no-loadscope-reorder``,
# the README's command: a module runs whole on one worker, so its module-scoped runs and servers are
# built once; without the last flag xdist orders modules by their number of tests) they start first,
# so that no long module is left to run alone at the end. Slurm's and the study's wait more than they
# compute, which is why they go early: the other workers fill the cores meanwhile.
LONGEST_FIRST = [
    "test_checkpoint_conversion",
    "test_slurm_pretrain",
    "test_study",
    "test_demo",
    "test_remote_faults",
    "test_clean_exit",
    "test_bf16_accumulation",
    "test_fail_safe",
    "test_train",
    "test_tracking_train",
    "test_bench",
    "test_evaluate",
    "test_checkpoint_mirror",
    "test_memory",
    "test_storage",
    "test_report",
    "test_modernbert",
    "test_faults",
    "test_remote_cache",
    "test_slurm_data_prep",
    "test_mlflow_ui",
    "test_resume_across_layouts",
    "test_mixture",
    "test_tracking_mlflow",
    "test_model",
    "test_data_prep_tasks",
]


def pytest_configure(config):
    for plugin in (suite_profile, tiers):  # where the time goes; the fast tier launches nothing
        if not config.pluginmanager.is_registered(plugin):
            config.pluginmanager.register(plugin)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: order within a module kept


def pytest_collection_finish(session):
    """The test modules have imported torch, transformers and the project: the cyclic collector need
    not scan those objects again at every full collection of a long session (as pretrain.train does)."""
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Ranks that a test kills cannot release DeepSpeed's /dev/shm segments (64 MiB each, RAM):
    remove the ones this session created, so that a long suite does not fill the machine's memory.
    Only those no live process maps: each pytest-xdist worker ends its own session, and the others'
    jobs may still be running (removing a live job's segment left its peer rank waiting forever)."""
    import glob
    import time

    from data_prep.common.stale_shm import mapped_files

    start = time.time()
    yield
    # Listed before the live mappings are read, and only segments a minute old: another worker's job
    # that is starting creates its segment a moment before it maps it (and its peer opens it by name);
    # one removed in between left that job's ranks waiting forever in DeepSpeed's set-up.
    found = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*")
    live = mapped_files()
    for path in found:
        try:
            created = os.stat(path).st_mtime
            if start <= created < time.time() - 60 and path not in live:
                os.unlink(path)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def mlflow_http_settings_of_a_fresh_process():
    """A tracker started in this process sets MLflow's HTTP timeout and retries process-wide, for its
    own requests (pretrain/tracking/mlflow_requests.py): a later test's MlflowClient in the same
    xdist worker then had 1 s and no retry, and a fresh server's first answer under a loaded suite
    took longer (the launcher test failed so in CI). Each test begins with the settings a user's
    process has."""
    names = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


PORTS_FROM, PORTS_PER_WORKER = 10000, 2500
_ports_taken = [0]


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999, where bind(0) and every outgoing
    connection take theirs), in a block of its own for each pytest-xdist worker (gw0: 10000-12499,
    gw1: 12500-14999, ...; the Slurm script's ports are 20000 + job id), taken in turn. A port that
    bind(0) had just handed out could be given to another worker's job or to a connection before the
    launcher bound it: a run failed with EADDRINUSE."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 4
    first = PORTS_FROM + PORTS_PER_WORKER * worker
    for _ in range(PORTS_PER_WORKER):
        port = first + _ports_taken[0] % PORTS_PER_WORKER
        _ports_taken[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")


@pytest.fixture(scope="session")
def wiki_articles():
    from data_prep.sample_corpus import wiki_articles

    return wiki_articles()


@pytest.fixture(scope="session")
def bert_uncased_dir() -> Path:
    from data_prep.sample_corpus import bert_uncased_dir

    return bert_uncased_dir()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A session fixture's folder, built by the first pytest-xdist worker that asks and read by all
    (each worker built its own before: the same bytes three times). ``build(folder)`` runs under a
    file lock; a build that failed leaves no ``.built`` mark and the next asker tries again."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common folder
    folder = root / name
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".built").is_file():
            if folder.exists():
                import shutil

                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            build(folder)
            (folder / ".built").touch()
    return folder


def data_prep(*args: str) -> None:
    """The data-prep CLI's ``main`` in this process (its command line is tested through ``python -m
    data_prep`` in test_data_prep*): the session's shards cost no process start-up."""
    from data_prep.cli import main

    code = main([str(a) for a in args])
    assert code == 0, f"data_prep {' '.join(map(str, args))} -> {code}"


def shard_argv(inputs, tokenizer, out=None, **options) -> list[str]:
    """``data_prep shard``'s command line: ``--input`` (one path), ``--tokenizer``, ``--out`` where
    given, then each option as ``--name value`` (``task_index=0``: ``--task-index 0``)."""
    argv = ["shard", "--input", str(inputs), "--tokenizer", str(tokenizer)]
    argv += ["--out", str(out)] if out is not None else []
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


@pytest.fixture(scope="session")
def wiki_txt_dir(tmp_path_factory, wiki_articles) -> Path:
    """~1,000 real articles as 4 blank-line-separated .txt files."""
    from data_prep.sample_corpus import write_sample_corpus

    return built_once(
        tmp_path_factory, "wiki_txt", lambda out: write_sample_corpus(out, "txt", num_files=4, max_docs=1000)
    )


@pytest.fixture(scope="session")
def wiki_article_files(tmp_path_factory, wiki_articles) -> Path:
    """600 real articles, one per .txt file (a headline, then paragraphs between blank lines): a
    corpus as people bring their own."""
    from data_prep.sample_corpus import write_article_files

    return built_once(tmp_path_factory, "wiki_article_files", lambda out: write_article_files(out, max_docs=600))


def _run(cmd, timeout=600, env: dict | None = None):
    """``cmd`` to its end, raising with its output if it fails; ``python -m MODULE ARGS`` is forked
    from the rank pool (tests/rank_pool.py), with the same arguments, environment and folder."""
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(c) for c in cmd]
    if cmd[:2] == [PY, "-m"]:
        proc = run_module(cmd[2], *cmd[3:], env=env, timeout=timeout)
    else:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def trainer_env(**extra: str) -> dict:
    """The environment of a launched job: one thread per process, this checkout importable, and none of
    the developer's MLFLOW_* settings steering a test run to another server or run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def node_launcher(ranks: int) -> list[str]:
    """DeepSpeed's per-node launcher for ``ranks`` local ranks on a free port, started as its runner
    (the ``deepspeed`` command) starts it on one node; append ``--module MODULE ARGS``. The runner
    would only add a process here, 3-4 s of CPU importing DeepSpeed (and mlflow) per launch; the tests
    of what it adds launch through ``deepspeed`` or ``pretrain.launch`` (test_train's SIGUSR1,
    test_faults' SIGTERM, test_fail_safe, the demo, the Slurm and study tests)."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    return [
        PY,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--log_level=info",
    ]


def train_cmd(
    data_dir, out_dir, *overrides, ranks: int = 1, config: str = "configs/tiny.yaml", launcher: list[str] | None = None
) -> list[str]:
    """One rank: plain python. More: DeepSpeed's per-node launcher, or ``launcher`` (``deepspeed``,
    ``pretrain.launch``) with ``--num_gpus`` on a free port."""
    # The end-of-run report costs 1-3 s of CPU per run; test_report asks for it.
    args = ["--config", config, f"data.dir={data_dir}", f"train.out_dir={out_dir}", "tracking.report=false", *overrides]
    if ranks == 1:
        return [PY, "-m", "pretrain.train", *args]
    if launcher is None:
        return [*node_launcher(ranks), "--module", "pretrain.train", *args]
    return [*launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module", "pretrain.train", *args]


def explain(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def command_of(proc) -> list[str]:
    """A process's command line, or [] once it has ended: a child found by ``children()`` may exit (or
    sit as a zombie until reaped) before its command line is read (a CI run failed on that race)."""
    import psutil  # lazy: only the tests that watch process trees need it

    try:
        return proc.cmdline()
    except psutil.NoSuchProcess:  # ZombieProcess is one
        return []


_POOLS: dict = {}  # this worker's rank pools by what they preload, started by the first job that uses one


def rank_pool(preload: tuple[str, ...] = ()):
    """The pool whose process has imported what a trainer rank imports, or the ``preload`` modules."""
    from rank_pool import RankPool

    if preload not in _POOLS or _POOLS[preload].proc.poll() is not None:  # none yet, or it died
        _POOLS[preload] = RankPool(Path(tempfile.mkdtemp(prefix="rank-pool-")), trainer_env(), REPO, preload)
    return _POOLS[preload]


@pytest.fixture(scope="session", autouse=True)
def rank_pools_closed():
    yield
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_module(module: str, *args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in the repository, to its end, output captured: forked from the rank
    pool on the CPU (the same module, arguments, environment and folder, without the imports)."""
    env = env or trainer_env()
    if os.environ.get("MLM_TESTS_ON_GPU") == "1":
        return subprocess.run(
            [PY, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
        )
    return rank_pool().run(module, list(args), env, 1, None, timeout)


def train(
    data_dir,
    out_dir,
    *overrides,
    ranks: int = 1,
    config: str = "configs/tiny.yaml",
    check: bool = False,
    env: dict | None = None,
    launcher: list[str] | None = None,
    timeout: float = 600,
):
    """The one way tests launch a training job; ``check`` raises with its output when it fails.
    Without a ``launcher``, the job's ranks are forked from this worker's rank pool (tests/rank_pool.py:
    the same ``python -m pretrain.train`` without ~8 s of imports per rank); with one, it runs for real."""
    if launcher is None and os.environ.get("MLM_TESTS_ON_GPU") != "1":
        args = [
            "--config",
            config,
            f"data.dir={data_dir}",
            f"train.out_dir={out_dir}",
            "tracking.report=false",
            *overrides,
        ]
        proc = rank_pool().run(
            "pretrain.train", args, trainer_env(**(env or {})), ranks, free_port() if ranks > 1 else None, timeout
        )
    else:
        proc = subprocess.run(
            train_cmd(data_dir, out_dir, *overrides, ranks=ranks, config=config, launcher=launcher),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=trainer_env(**(env or {})),
        )
    if check and proc.returncode != 0:
        raise AssertionError(explain(proc))
    return proc


def train_through(cmd: list[str], env: dict, metrics: Path, lines: int, meanwhile, timeout: float):
    """A launched training job that, once ``metrics`` holds ``lines`` lines, has ``meanwhile()`` done
    to it (a server stopped, say) and then runs to its end; its whole process group (launcher and
    ranks) is killed if it outlives ``timeout``. Returns it completed, stdout and stderr as text."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        for _ in range(1200):
            if metrics.is_file() and metrics.read_text().count("\n") >= lines or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        meanwhile()
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def shards(tmp_path_factory, wiki_txt_dir):
    """Real text -> a small WordPiece tokenizer -> shards of deliberately uneven sizes (2 tasks)."""

    def build(root: Path):
        data_prep(
            "tokenizer",
            "--input",
            f"{wiki_txt_dir}/*.txt",
            "--out",
            root / "tok",
            "--vocab-size",
            "4096",
            "--lowercase",
        )
        for task in range(2):
            data_prep(
                "shard",
                "--input",
                f"{wiki_txt_dir}/*.txt",
                "--tokenizer",
                root / "tok",
                "--out",
                root / "shards",
                "--seq-len",
                "64",
                "--shard-size",
                "700",
                "--block-size",
                "64",
                "--validation-fraction",
                "0.05",
                # the 4 files read in pairs (bundles of small files), 2 packing groups each: every
                # task has groups to write, and the groups' last shards make the sizes uneven
                "--group-chars",
                "130000",
                "--num-tasks",
                "2",
                "--task-index",
                str(task),
            )
        data_prep("finalize", root / "shards")

    root = built_once(tmp_path_factory, "train_data", build)
    manifest = json.loads((root / "shards" / "manifest.json").read_text())
    sizes = [s["sequences"] for s in manifest["shards"] if s["split"] == "train"]
    assert len(set(sizes)) > 1, f"want uneven shards, got {sizes}"
    return root / "shards"


@pytest.fixture(scope="session")
def two_sources(shards, wiki_txt_dir, tmp_path_factory) -> dict[str, Path]:
    """A data mixture's two sources: two different slices of the real corpus (wiki-00..02, wiki-03),
    sharded with the ``shards`` fixture's tokenizer at its sequence length. ``small`` repeats soon."""
    sources = (("big", "wiki-0[012].txt", "400"), ("small", "wiki-03.txt", "200"))

    def build(root: Path):
        for name, files, shard_size in sources:
            data_prep(
                "shard",
                "--input",
                f"{wiki_txt_dir}/{files}",
                "--tokenizer",
                shards.parent / "tok",
                "--out",
                root / name,
                "--seq-len",
                "64",
                "--shard-size",
                shard_size,
                "--block-size",
                "64",
                "--validation-fraction",
                "0.05",
            )
            data_prep("finalize", root / name)

    root = built_once(tmp_path_factory, "two_sources", build)
    return {name: root / name for name, _, _ in sources}


def ids_payload(shard_path, block: int) -> tuple[int, int]:
    """(byte offset, size) of block ``block``'s input_ids data inside a shard tar: where tests damage it."""
    with tarfile.open(shard_path) as tar:
        member = tar.getmembers()[2 * block]
    return member.offset_data, member.size


@pytest.fixture
def small_disk(tmp_path):
    """``make(kib)``: a folder on a tmpfs of that size, unmounted after the test."""
    import subprocess

    mounts = []

    def make(kib: int):
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)], capture_output=True, text=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(folder)
        return folder

    yield make
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
