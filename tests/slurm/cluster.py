"""A real Slurm (Debian's slurmctld + slurmd + munge) on this one machine, for launcher tests.

One controller and ``nodes`` simulated compute nodes ``n1..nN``: each slurmd runs in its own UTS and
mount namespace (hostname ``nI``, a private /etc/hosts mapping every ``nI`` to 127.0.0.1) on its own
port, all sharing the host's loopback network. Jobs therefore see ``SLURM_JOB_NODELIST=n[1-2]`` and
``MASTER_ADDR=n1`` resolves, as on a real cluster. Everything the daemons write (config, state, spool,
pid and log files, the munge key and socket) lives in one private lab folder, and ports are picked
free, so two clusters on one machine do not meet.

Needs root (slurmd and namespaces) and the Debian packages; when they are missing and we are root
they are installed with apt-get. Anything that prevents starting raises :class:`ClusterUnavailable`
with the reason, which the pytest fixture turns into a skip.

pytest: ``from tests.slurm.cluster import slurm_cluster`` in a test module, then use the
``slurm_cluster`` fixture (one cluster per session, shared by all modules; stopped at session end).
By hand: ``python tests/slurm/cluster.py up`` prints the exports for the client commands,
``python tests/slurm/cluster.py down LAB`` stops it.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # also when run as a script (``python tests/slurm/cluster.py up``)
from apt import apt_install, can_install  # noqa: E402

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "squeue",
    "sinfo",
    "scancel",
    "munged",
    "mungekey",
    "unshare",
    "mount",
)
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the test cluster; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<{path}: {e}>"


def ensure_installed() -> None:
    """Install the Slurm and munge packages when a binary is missing (root + apt-get only)."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if not can_install():
        raise ClusterUnavailable(
            f"Slurm binaries missing ({', '.join(missing)}); installing {' '.join(PACKAGES)} needs root and apt-get"
        )
    done = apt_install(*PACKAGES)
    if done.returncode != 0:
        raise ClusterUnavailable(
            f"`apt-get install {' '.join(PACKAGES)}` failed ({done.returncode}):\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    still = [b for b in BINARIES if shutil.which(b) is None]
    if still:
        raise ClusterUnavailable(f"after apt-get install, still missing: {', '.join(still)}")


def venv_bin() -> Path:
    """The environment the jobs run in: the checkout's own .venv, else the interpreter running us."""
    own = REPO / ".venv" / "bin"
    return own if (own / "python").exists() else Path(sys.executable).parent


def run_python(env: dict, *args: str, timeout: float = 300) -> None:
    """A step a test runs here rather than under Slurm (with the project's interpreter), failing
    with its output."""
    r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"python {' '.join(args)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


@dataclass
class JobRecord:
    """One job (or one array element) as ``scontrol show job`` reports it."""

    job_id: int
    array_job_id: int | None
    array_task_id: int | None
    state: str
    exit_code: str  # "rc:signal", e.g. "0:0", "1:0", "0:15"
    restarts: int
    fields: dict

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"


def _parse_show_job(text: str) -> list[JobRecord]:
    out = []
    for line in text.splitlines():
        if not line.startswith("JobId="):
            continue
        # Values have no spaces except in a few free-text fields we do not read (Command has none here).
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))
        out.append(
            JobRecord(
                job_id=int(fields["JobId"]),
                array_job_id=int(fields["ArrayJobId"]) if "ArrayJobId" in fields else None,
                array_task_id=int(fields["ArrayTaskId"]) if fields.get("ArrayTaskId", "").isdigit() else None,
                state=fields.get("JobState", "?"),
                exit_code=fields.get("ExitCode", "?"),
                restarts=int(fields.get("Restarts", "0") or 0),
                fields=fields,
            )
        )
    return out


class SlurmCluster:
    def __init__(self, lab: Path, nodes: int = 2):
        if nodes < 2:
            raise ValueError("nodes must be >= 2 (simulated nodes n1..nN)")
        self.lab = Path(lab)
        self.nodes = nodes
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = self.lab / "etc" / "slurm.conf"
        self.munge_socket = self.lab / "munge" / "run" / "munge.socket.2"
        self.started = False
        self.ctld_port = _free_port()
        self.node_ports = [_free_port() for _ in self.node_names]

    @property
    def node_local(self) -> Path:
        """A path that each node's jobs see as their own disk (like /local/scratch on a real cluster):
        in node ``nI``'s mount namespace it is ``node_disk("nI")``; outside, an empty folder."""
        return self.lab / "node-local"

    def node_disk(self, name: str) -> Path:
        """Node ``name``'s own disk, as the tests see it from outside the nodes."""
        return self.lab / "node-disks" / name

    # ----------------------------------------------------------------------------------- environment
    def client_env(self, **extra: str) -> dict:
        """Environment for client commands and, through sbatch's default --export=ALL, for the jobs:
        the project's venv first on PATH, one thread per process, no hub access, a shared cache for
        DeepSpeed's JIT-built ops."""
        env = dict(os.environ)
        vbin = venv_bin()
        env.update(
            SLURM_CONF=str(self.conf),
            PATH=f"{vbin}:{env.get('PATH', '/usr/bin:/bin')}",
            VIRTUAL_ENV=str(vbin.parent),
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
            TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions")),
        )
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del env[k]  # a pytest itself running inside a Slurm job must not leak its job into ours
        env.update(extra)
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.client_env())
        kw.setdefault("cwd", REPO)
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {r.returncode}:\n{r.stdout}{r.stderr}")
        return r

    # ------------------------------------------------------------------------------------ lifecycle
    def _write_conf(self) -> None:
        for d in ("etc", "log", "run", "spool/ctld"):
            (self.lab / d).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8 / self.nodes)
        lab = self.lab
        lines = [
            "ClusterName=mlmtest",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            # cred_expire also sets how long a requeued job waits before it may start again
            # (default 120 s); 15 s keeps the requeue test short and still lets the nodes clean up.
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=15",
            f"StateSaveLocation={lab}/spool/ctld",
            f"SlurmdSpoolDir={lab}/spool/slurmd-%n",
            f"SlurmctldPidFile={lab}/run/slurmctld.pid",
            f"SlurmdPidFile={lab}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={lab}/log/slurmctld.log",
            f"SlurmdLogFile={lab}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups on a CI container: track processes by parentage, no task confinement.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=10",
            # Finished jobs stay visible to `scontrol show job` long enough for the tests to read them.
            "MinJobAge=600",
            # The scheduler wakes on events; a short interval keeps dependent/requeued jobs snappy.
            "SchedulerParameters=sched_interval=2,bf_interval=2",
        ]
        for name, port in zip(self.node_names, self.node_ports):
            # RealMemory: without it a node has 1 MB and any --mem is refused.
            lines.append(
                f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # A hosts file for the nodes' private mount namespaces: our node names resolve to loopback.
        base = [
            ln
            for ln in Path("/etc/hosts").read_text().splitlines()
            if not any(re.search(rf"\s{n}(\s|$)", ln) for n in self.node_names)
        ]
        base += [f"127.0.0.1\t{n}" for n in self.node_names]
        (self.lab / "etc" / "hosts").write_text("\n".join(base) + "\n")

    def _start_munge(self) -> None:
        m = self.lab / "munge"
        for d, mode in (("", 0o755), ("run", 0o755), ("etc", 0o700), ("log", 0o700), ("lib", 0o700)):
            (m / d).mkdir(parents=True, exist_ok=True)
            os.chmod(m / d, mode)  # munged refuses a world-readable key dir and needs a readable socket dir
        key = m / "etc" / "munge.key"
        if not key.exists():
            self._daemon(["mungekey", "--create", f"--keyfile={key}", "--bits=1024"])
        os.chmod(key, 0o600)
        self._daemon(
            [
                "munged",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={m}/run/munged.pid",
                f"--log-file={m}/log/munged.log",
                f"--seed-file={m}/lib/munged.seed",
            ]
        )
        self._wait(lambda: self.munge_socket.exists(), 10, "munged socket", m / "log" / "munged.log")

    def _daemon(self, cmd: list[str]) -> None:
        # Daemons fork and keep our stdout; send it to a file so nothing waits on a pipe they hold.
        with open(self.lab / "log" / "start.log", "ab") as log:
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60)
        if r.returncode != 0:
            raise ClusterUnavailable(
                f"`{' '.join(cmd)}` exited {r.returncode}:\n{_tail(self.lab / 'log' / 'start.log')}"
            )

    def _wait(self, ok, timeout: float, what: str, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.2)
        detail = f"\n--- {log}:\n{_tail(log)}" if log else ""
        raise ClusterUnavailable(f"{what} not ready after {timeout:.0f} s{detail}")

    def idle_nodes(self) -> int:
        r = self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False)
        return len(set(r.stdout.split())) if r.returncode == 0 else 0

    def start(self) -> "SlurmCluster":
        self.lab.mkdir(parents=True, exist_ok=True)
        os.chmod(self.lab, 0o755)  # munged wants every directory above its socket searchable by all
        (self.lab / "log").mkdir(exist_ok=True)
        self._write_conf()
        self._start_munge()
        self.started = True  # from here on, stop() has something to clean up
        self._daemon(["slurmctld", "-f", str(self.conf), "-c", "-i"])
        hosts = self.lab / "etc" / "hosts"
        self.node_local.mkdir(exist_ok=True)
        for name in self.node_names:
            self.node_disk(name).mkdir(parents=True, exist_ok=True)
            self._daemon(
                [
                    "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "bash",
                    "-c",
                    f"mount --bind {hosts} /etc/hosts && mount --bind {self.node_disk(name)} {self.node_local} "
                    f"&& hostname {name} && exec slurmd -f {self.conf} -N {name}",
                ]
            )
        self._wait(
            lambda: self.idle_nodes() == self.nodes, 30, f"{self.nodes} idle nodes", self.lab / "log" / "slurmctld.log"
        )
        return self

    def _pid_files(self) -> list[Path]:
        run = self.lab / "run"
        return [*sorted(run.glob("slurmd-*.pid")), run / "slurmctld.pid", self.lab / "munge" / "run" / "munged.pid"]

    def stop(self) -> None:
        """Stop slurmds, then slurmctld, then munged, each by its own pid file (TERM, then KILL)."""
        if not self.started:
            return
        # Jobs first: their processes belong to the slurmstepds, which outlive a stopped slurmd.
        try:
            self.run("scancel", "--full", "--quiet", "--user=root", check=False, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False, timeout=10).stdout.strip():
                time.sleep(0.5)
        except subprocess.TimeoutExpired:
            pass  # no controller to ask: stop the daemons anyway
        for pid_file in self._pid_files():
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        self.started = False

    # ----------------------------------------------------------------------------------------- jobs
    def sbatch(self, *args: str, env: dict | None = None, cwd: Path = REPO) -> int:
        r = self.run("sbatch", "--parsable", *args, env=env or self.client_env(), cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def jobs(self, job_id: int) -> list[JobRecord]:
        """Every record of a job, or of every element of an array job."""
        r = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return _parse_show_job(r.stdout) if r.returncode == 0 else []

    def wait(self, job_id: int, timeout: float = 300, poll: float = 0.5) -> list[JobRecord]:
        """Poll until the job (every array element) has ended; ``sbatch --wait`` backs off to 32 s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.jobs(job_id)
            if recs and all(r.state in TERMINAL_STATES for r in recs):
                return recs
            time.sleep(poll)
        recs = self.jobs(job_id)
        raise TimeoutError(
            f"job {job_id} not finished after {timeout:.0f} s: "
            + ", ".join(f"{r.job_id}:{r.state}({r.fields.get('Reason')})" for r in recs)
            + "\n"
            + self.diagnostics()
        )

    def wait_for(self, predicate, timeout: float, what: str, poll: float = 0.2):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(poll)
        raise TimeoutError(f"{what}: not seen within {timeout:.0f} s")

    def diagnostics(self) -> str:
        parts = [f"--- sinfo:\n{self.run('sinfo', '-N', check=False).stdout}"]
        for log in sorted((self.lab / "log").glob("slurm*.log")):
            parts.append(f"--- {log}:\n{_tail(log, 15)}")
        return "\n".join(parts)


# ------------------------------------------------------------------------------- pytest fixture
_shared: dict = {"cluster": None, "users": 0, "error": None}


def acquire(nodes: int = 2) -> SlurmCluster:
    """Start the session's cluster on first use; later callers get the same one."""
    if _shared["error"] is not None:
        raise ClusterUnavailable(_shared["error"])
    if _shared["cluster"] is None:
        try:
            if os.geteuid() != 0:
                raise ClusterUnavailable(
                    "needs root (slurmd runs as root; the simulated nodes need mount and UTS namespaces)"
                )
            ensure_installed()
            lab = Path(tempfile.mkdtemp(prefix="mlmslurm-", dir="/tmp"))  # short: unix socket paths are capped
            cluster = SlurmCluster(lab, nodes)
            atexit.register(cluster.stop)  # also when pytest dies between fixture set-up and teardown
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
        except ClusterUnavailable as e:
            _shared["error"] = str(e)
            raise
        _shared["cluster"] = cluster
    _shared["users"] += 1
    return _shared["cluster"]


def release() -> None:
    _shared["users"] -= 1
    cluster = _shared["cluster"]
    if _shared["users"] <= 0 and cluster is not None:
        cluster.stop()
        if not os.environ.get("MLM_SLURM_KEEP_LAB"):
            shutil.rmtree(cluster.lab, ignore_errors=True)
        _shared["cluster"] = None


try:
    import pytest

    @pytest.fixture(scope="session")
    def slurm_cluster():
        """A running 2-node Slurm; skips (with the reason) where it cannot run. Import this name into
        each test module; modules share one cluster, stopped after the last of them finishes."""
        try:
            cluster = acquire()
        except ClusterUnavailable as e:
            pytest.skip(f"no test Slurm cluster: {e}")
        try:
            yield cluster
        finally:
            release()
except ImportError:  # the CLI below works without pytest
    pass


def _main(argv: list[str]) -> int:
    if argv[:1] == ["up"]:
        ensure_installed()
        cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="mlmslurm-", dir="/tmp"))).start()
        print(f"export SLURM_CONF={cluster.conf}   # lab: {cluster.lab}")
        return 0
    if argv[:1] == ["down"] and len(argv) == 2:
        cluster = SlurmCluster(Path(argv[1]))
        cluster.conf = Path(argv[1]) / "etc" / "slurm.conf"
        cluster.started = True
        cluster.stop()
        return 0
    print("usage: cluster.py up | cluster.py down LAB", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
