"""launchers/slurm/pretrain.sbatch on a real 2-node Slurm (one CPU rank per node): the tiny model
trains across both nodes and its checkpoint exports to Hugging Face; a job told to stop with USR1
mid-run (what `--signal=B:USR1@grace` does before the time limit) checkpoints, requeues itself,
resumes, and ends with exactly the losses of an uninterrupted job.

A node that crashes ends the job at once with its code (no requeue loop), and requeues after hangs
are capped.

Time: about 6-7 minutes of wall time and under 30 s of CPU: a real Slurm cluster (slurmctld and
two slurmd) schedules, signals, requeues and resumes the jobs, and the test waits for it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import free_port
from tests.slurm.cluster import REPO, run_python, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SBATCH = REPO / "launchers" / "slurm" / "pretrain.sbatch"
CPU_NODES = ("--gpus-per-node=0", "--cpus-per-task=1")  # the script's defaults are for 8-GPU nodes
STEPS = 40
SEQ_LEN = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory, bert_uncased_dir, slurm_cluster) -> Path:
    from data_prep.sample_corpus import write_sample_corpus

    root = tmp_path_factory.mktemp("slurm_train_data")
    write_sample_corpus(root / "corpus", "txt", num_files=2, max_docs=400)
    env = slurm_cluster.client_env()
    for cmd in (
        [
            "shard",
            "--input",
            f"{root}/corpus/*.txt",
            "--tokenizer",
            str(bert_uncased_dir),
            "--out",
            str(root / "shards"),
            "--seq-len",
            str(SEQ_LEN),
            "--validation-fraction",
            "0.05",
        ],
        ["finalize", str(root / "shards")],
    ):
        run_python(env, "-m", "data_prep", *cmd)
    return root / "shards"


def overrides(shards: Path, out_dir: Path) -> list[str]:
    # checkpoint_every=0: the only mid-run checkpoint is the one the signal asks for.
    return [
        f"data.dir={shards}",
        f"train.out_dir={out_dir}",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_sequences=32",
        "train.checkpoint_every=0",
        "train.keep_checkpoints=0",
        "impl.micro_batch_size=4",
        "train.global_batch_size=8",
        "optim.warmup_steps=4",
        f"model.max_position_embeddings={SEQ_LEN}",
        "tracking.backend=none",
    ]


def submit(cluster, name: str, shards: Path, out_dir: Path, extra=(), env=None, log_dir=None) -> int:
    return cluster.sbatch(
        f"--job-name={name}",
        f"--output={log_dir or out_dir.parent}/{name}-%j.out",
        "--time=00:15:00",
        *CPU_NODES,
        str(SBATCH),
        "configs/tiny.yaml",
        *overrides(shards, out_dir),
        *extra,
        env=env,
    )


def metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(out_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(out_dir) if key in r}


class Job:
    """A submitted job, waited for on first use; lets the reference run overlap the other tests."""

    def __init__(self, cluster, name: str, shards: Path, out_dir: Path, extra=(), env=None, log_dir=None):
        self.cluster, self.name, self.shards, self.out_dir = cluster, name, shards, out_dir
        self.log_dir = log_dir or out_dir.parent
        self.id = submit(cluster, name, shards, out_dir, extra, env, self.log_dir)
        self._record = None

    def record(self, timeout: float = 420):
        if self._record is None:
            (self._record,) = self.cluster.wait(self.id, timeout=timeout)
            assert self._record.ok, (
                f"{self.name} job {self.id}: {self._record.state} {self._record.exit_code}\n{self.log[-6000:]}"
            )
        return self._record

    def ended(self, timeout: float, expected: tuple[str, str, int]) -> str:
        """Waits for a job expected to end as (state, exit code, restarts); its log."""
        (record,) = self.cluster.wait(self.id, timeout=timeout)
        log = self.log
        assert (record.state, record.exit_code, record.restarts) == expected, (
            f"{record.state} {record.exit_code} restarts={record.restarts}\n{log[-1200:]}"
        )
        return log

    @property
    def log(self) -> str:
        path = self.log_dir / f"{self.name}-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else f"<no {path}>"


@pytest.fixture(scope="module")
def reference(slurm_cluster, shards, tmp_path_factory) -> Job:
    """The uninterrupted run (submitted at once, waited for by whoever needs it first)."""
    return Job(slurm_cluster, "reference", shards, tmp_path_factory.mktemp("reference") / "run")


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_losses(slurm_cluster, shards, reference, tmp_path):
    cluster = slurm_cluster
    job = Job(cluster, "interrupted", shards, tmp_path / "run")

    # Tell the batch shell, as --signal=B:USR1@grace would, once training is under way.
    first = cluster.wait_for(
        lambda: [s for s in losses(job.out_dir) if s >= 3],
        300,
        f"step 3 in {job.out_dir}/metrics.jsonl\n{job.log[-3000:]}",
    )
    cluster.run("scancel", "--batch", "--signal=USR1", str(job.id))

    # The job requeues itself and starts again once Slurm lets it (AuthInfo cred_expire: 15 s here,
    # 120 s by default).
    record = job.record()
    log = job.log
    assert record.restarts == 1, record

    # Both ranks (one per node) received the signal, checkpointed at the same step, exited 3.
    for rank in (0, 1):
        assert f"[rank {rank}] received SIGUSR1" in log, log[-6000:]
    assert "training step exited with 3" in log and f"requeueing job {job.id}" in log, log[-6000:]
    assert f"job={job.id} restart=1 " in log, log[-6000:]
    tags = sorted(p.parent.name for p in (job.out_dir / "checkpoints").glob("step*/COMPLETE"))
    assert len(tags) == 2 and tags[-1] == f"step{STEPS:08d}", tags
    stopped_at = int(tags[0][4:])
    assert min(first) <= stopped_at < STEPS, (first, stopped_at)
    assert f"(resumed from {tags[0]})" in log, log[-6000:]
    assert not re.search(r"slurm_script: line \d+:", log), log[-6000:]

    # The resumed run continues exactly where the uninterrupted one went.
    reference.record()
    ours, theirs = losses(job.out_dir), losses(reference.out_dir)
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    for step in theirs:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-6, abs=1e-6), (step, ours[step], theirs[step])
    assert losses(job.out_dir, "eval/loss")[STEPS] == pytest.approx(
        losses(reference.out_dir, "eval/loss")[STEPS], rel=1e-6
    )


def test_two_node_training_exports_to_hugging_face(slurm_cluster, reference, tmp_path):
    record = reference.record()
    log = reference.log
    assert record.fields["NumNodes"] == "2" and record.fields["NodeList"] == "n[1-2]", record.fields
    assert "dist_world_size=2" in log and "node_rank=0" in log and "node_rank=1" in log, log[-6000:]
    # bash reports its own errors as "slurm_script: line N: ..."; a job that went right has none (a
    # killed guard subshell once ran the script's EXIT trap and wrote one into every job log)
    assert not re.search(r"slurm_script: line \d+:", log), log[-6000:]
    curve = losses(reference.out_dir)
    assert len(curve) == STEPS and curve[STEPS] < curve[1] - 0.3, curve  # it learned something

    out = tmp_path / "hf"
    run_python(slurm_cluster.client_env(), "-m", "pretrain.export", str(reference.out_dir / "checkpoints"), str(out))
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model, info = AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.mask_token_id == 103

    # The exported weights are the trained ones: 15% masking on held-out sequences gives about the
    # loss the trainer's own evaluation reported, well below an untrained model's ln(vocab).
    from data_prep.common.shards import iter_blocks

    manifest = json.loads((reference.shards / "manifest.json").read_text())
    val = [s["name"] for s in manifest["shards"] if s["split"] == "validation"]
    ids = np.concatenate([b for name in val for b, _ in iter_blocks(reference.shards / name, SEQ_LEN)])
    ids = torch.from_numpy(ids.astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    special = torch.isin(ids, torch.tensor([0, 100, 101, 102, 103]))
    chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & ~special
    inputs = ids.masked_fill(chosen, tokenizer.mask_token_id)
    labels = ids.masked_fill(~chosen, -100)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=inputs, attention_mask=(ids != 0).long(), labels=labels).loss.item()
    eval_loss = losses(reference.out_dir, "eval/loss")[STEPS]
    assert loss < math.log(model.config.vocab_size) - 0.3, (loss, eval_loss)
    assert loss == pytest.approx(eval_loss, abs=0.35), (loss, eval_loss)


def test_a_missing_config_fails_the_job_at_once_without_requeue(slurm_cluster, tmp_path):
    log = tmp_path / "bad-%j.out"
    job_id = slurm_cluster.sbatch(
        f"--output={log}", *CPU_NODES, str(SBATCH), "configs/no_such.yaml", "train.max_steps=1"
    )
    (record,) = slurm_cluster.wait(job_id, timeout=60)
    text = Path(str(log).replace("%j", str(job_id))).read_text()
    assert (record.state, record.exit_code, record.restarts) == ("FAILED", "2:0", 0), record
    assert "config 'configs/no_such.yaml' not found" in text, text
    assert "srun" not in text and "deepspeed" not in text, text


def test_a_master_port_in_use_fails_the_job_at_once_without_requeue(slurm_cluster, tmp_path):
    """A MASTER_PORT given in sbatch's environment that something on the first node listens on: exit
    2 naming it, before srun. (A free one given is held and used: the crashed-node job's.)"""
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = slurm_cluster.client_env(MASTER_PORT=str(port))
        job_id = slurm_cluster.sbatch(
            f"--output={tmp_path}/port-%j.out", *CPU_NODES, str(SBATCH), "configs/tiny.yaml", env=env
        )
        (record,) = slurm_cluster.wait(job_id, timeout=60)
    text = (tmp_path / f"port-{job_id}.out").read_text()
    assert (record.state, record.exit_code, record.restarts) == ("FAILED", "2:0", 0), record
    assert f"MASTER_PORT {port} is already in use on this machine" in text, text
    assert "srun" not in text and "deepspeed" not in text and "job=" not in text, text


def test_a_gpu_config_in_a_job_without_gpus_is_refused_in_one_line(slurm_cluster, tmp_path):
    """base.yaml asks for CUDA: submitted to CPU nodes (``--gpus-per-node=0``) it would have trained
    on the CPU for weeks; refused before any rank starts. ``impl.device=cpu`` on the line lets it through
    to the trainer's own checks (here: no data)."""
    refused = slurm_cluster.sbatch(f"--output={tmp_path}/gpu-%j.out", *CPU_NODES, str(SBATCH), "configs/base.yaml")
    (record,) = slurm_cluster.wait(refused, timeout=60)
    text = (tmp_path / f"gpu-{refused}.out").read_text()
    assert (record.state, record.exit_code, record.restarts) == ("FAILED", "2:0", 0), record
    assert f"configs/base.yaml asks for CUDA (impl.device=cuda) but job {refused} has no GPUs" in text, text
    assert "srun" not in text and "deepspeed" not in text and "job=" not in text, text
    allowed = slurm_cluster.sbatch(
        f"--output={tmp_path}/cpu-%j.out",
        *CPU_NODES,
        str(SBATCH),
        "configs/base.yaml",
        "impl.device=cpu",
        f"data.dir={tmp_path}/no_data",
        "tracking.backend=none",
    )
    (record,) = slurm_cluster.wait(allowed, timeout=120)
    text = (tmp_path / f"cpu-{allowed}.out").read_text()
    assert "asks for CUDA" not in text and "job=" in text and record.exit_code == "2:0", text


def test_a_job_on_node_local_disks_requeued_onto_empty_ones_resumes_from_the_mirror(
    slurm_cluster, shards, reference, s3_server, tmp_path
):
    """Each node writes train.out_dir to its own disk (the same path, another disk on each node). Told
    to stop (USR1), the job checkpoints, its nodes upload their own ranks' files, and it requeues; its
    nodes' disks are then wiped, as on other nodes. It resumes from the mirror, each node fetching its
    ranks' files only, and ends with the uninterrupted (shared-disk) job's losses and final weights."""
    cluster = slurm_cluster
    bucket = s3_server.bucket("nodelocal")
    mirror = f"s3://{bucket}/run"
    disks = [cluster.node_disk(name) / "run" for name in ("n1", "n2")]
    job_env = cluster.client_env(**s3_server.aws())
    job = Job(
        cluster,
        "nodelocal",
        shards,
        cluster.node_local / "run",
        extra=[f"train.checkpoint_mirror={mirror}"],
        env=job_env,
        log_dir=tmp_path,
    )
    first = cluster.wait_for(
        lambda: [s for s in losses(disks[0]) if s >= 3], 300, f"step 3 in {disks[0]}/metrics.jsonl\n{job.log[-3000:]}"
    )
    cluster.run("scancel", "--batch", "--signal=USR1", str(job.id))
    cluster.wait_for(lambda: "training step exited with 3" in job.log, 300, f"the stop\n{job.log[-3000:]}")
    stopped = sorted(p.parent.name for p in (disks[0] / "checkpoints").glob("step*/COMPLETE"))
    assert len(stopped) == 1 and min(first) <= int(stopped[0][4:]) < STEPS, stopped
    # Each node's folder holds its own ranks' shards, and completes on its own.
    for rank, disk in enumerate(disks):
        folder = disk / "checkpoints" / stopped[0]
        assert [p.name for p in folder.glob("*zero_pp_rank_*")] == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
        assert (folder / "COMPLETE").is_file() and (folder / "mp_rank_00_model_states.pt").is_file()
    before = dict(losses(disks[0]))
    for disk in disks:  # the requeued job lands on empty disks
        shutil.rmtree(disk)

    record = job.record()
    log = job.log
    assert record.restarts == 1, record
    assert f"(resumed from {stopped[0]})" in log, log[-6000:]
    assert log.count(f"resuming from the checkpoint mirror: {mirror}/{stopped[0]} downloaded") == 2, log[-6000:]
    assert "(the files of ranks 1-1)" in log and "(the files of ranks 0-0)" in log, log[-6000:]
    assert not list((disks[1] / "checkpoints" / stopped[0]).glob("zero_pp_rank_0_*"))

    reference.record()
    ours, theirs = {**before, **losses(disks[0])}, losses(reference.out_dir)
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    for step in theirs:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-6, abs=1e-6), (step, ours[step], theirs[step])

    # The mirror holds every rank's files of the final checkpoint, and the final export, taken from
    # the engine (no one disk has both ranks' shards): the uninterrupted job's weights.
    objects = s3_server.objects(bucket, "run")
    final = f"step{STEPS:08d}"
    assert objects["latest"] == final.encode() and f"{final}/COMPLETE" in objects
    listed = json.loads(objects[f"{final}/file_list.json"])["files"]
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(listed)
    assert all(
        objects[f"{final}/{name}"] and len(objects[f"{final}/{name}"]) == want["size"] for name, want in listed.items()
    )
    assert objects["hf_final/EXPORTED_FROM"] == f"{final}\n".encode()
    assert b"<html" in objects["report/report.html"]  # the run's report too
    from safetensors.torch import load as load_safetensors

    exported = load_safetensors(objects["hf_final/model.safetensors"])
    wanted = load_safetensors((reference.out_dir / "hf_final" / "model.safetensors").read_bytes())
    assert sorted(exported) == sorted(wanted)
    for name in wanted:
        assert torch.allclose(exported[name], wanted[name], rtol=1e-5, atol=1e-6), name

    # Another job continues the run at ZeRO 1 on empty disks: each node downloads every rank's files
    # (another layout: the conversion needs them all) and converts on its own disk.
    for disk in disks:
        shutil.rmtree(disk)
    longer = Job(
        cluster,
        "nodelocal-zero1",
        shards,
        cluster.node_local / "run",
        env=job_env,
        log_dir=tmp_path,
        extra=[f"train.checkpoint_mirror={mirror}", "impl.zero_stage=1", f"train.max_steps={STEPS + 4}"],
    )
    longer.record()
    log = longer.log
    assert log.count(f"resuming from the checkpoint mirror: {mirror}/{final} downloaded") == 2, log[-6000:]
    assert "(the files of ranks" not in log and f"(resumed from {final})" in log, log[-6000:]
    for disk in disks:
        assert (disk / "checkpoints" / final / "universal").is_dir() and len(
            list((disk / "checkpoints" / final).glob("zero_pp_rank_*"))
        ) == 2
    more = losses(disks[0])
    assert sorted(more) == list(range(STEPS, STEPS + 5))  # the checkpoint's step is logged again
    assert more[STEPS] == pytest.approx(theirs[STEPS], rel=1e-6)
    assert more[STEPS + 1] == pytest.approx(theirs[STEPS], rel=0.1)  # the trained weights, carried on
    assert s3_server.objects(bucket, "run")["hf_final/EXPORTED_FROM"] == f"step{STEPS + 4:08d}\n".encode()

    secret = s3_server.env()["AWS_SECRET_ACCESS_KEY"].encode()
    assert not [p for root in (tmp_path, *disks) for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


def test_a_crashed_node_ends_the_job_at_once_with_its_exit_code(slurm_cluster, shards, tmp_path):
    """Issue 60, item 2: rank 1 (node n2) exits 1 before step 15 while rank 0 waits for it, as a rank
    waits in an NCCL collective for a peer that died (here it blocks: gloo would notice the closed
    socket by itself). Before, rank 0's hang watchdog exited 3 after hang_timeout_s, srun returned the
    highest code, 3, and the job requeued into the same crash for ever. Now n2's launcher ends every
    node's ranks at once and the job fails with n2's code, named in its log, not requeued."""
    # and a MASTER_PORT given (as a free one): held by the script, taken by rank 0's store
    env = slurm_cluster.client_env(PRETRAIN_TEST_CRASH="1:15", PRETRAIN_TEST_HANG="0:15", MASTER_PORT=str(free_port()))
    job = Job(slurm_cluster, "crashed", shards, tmp_path / "run", ["train.hang_timeout_s=60"], env=env)
    log = job.ended(180, ("FAILED", "1:0", 0))
    assert "[rank 1] PRETRAIN_TEST_CRASH: exiting 1 before step 15" in log, log[-4000:]
    assert "launcher on node 1 (n2): ranks exited 1" in log, log[-4000:]
    assert "node 1 (n2) exited 1: the job ends with it, not requeued" in log, log[-4000:]
    assert "requeueing job" not in log and "hang: no step finished" not in log, log[-4000:]
    # rank 0 was ended long before its 60 s watchdog: it wrote no stacks
    assert not list(job.out_dir.glob("hang-rank*.txt"))


def test_requeues_after_hangs_are_capped(slurm_cluster, shards, tmp_path):
    """A rank that hangs at every start (a bad node kept in the allocation) exits 3 through the hang
    watchdog, which requeues; with MAX_UNPLANNED_REQUEUES=1 the second hang ends the job instead of
    a third start. Requeues asked for by USR1 are not counted (the test above)."""
    env = slurm_cluster.client_env(PRETRAIN_TEST_HANG="1:12", MAX_UNPLANNED_REQUEUES="1")
    job = Job(slurm_cluster, "hangs", shards, tmp_path / "run", ["train.hang_timeout_s=20"], env=env)
    log = job.ended(300, ("FAILED", "3:0", 1))
    assert "exit 3 without a USR1 (a hang or an outage): requeue 1 of at most 1" in log, log[-4000:]
    assert "exit 3 without a USR1 for the 2-th time (MAX_UNPLANNED_REQUEUES=1)" in log, log[-4000:]
    assert log.count("requeueing job") == 1, log[-4000:]


# Issue 72, item 6: the unplanned-requeue count as a cluster operator expects it, and the port.
COUNT_FUNCTION = re.compile(r"^count_unplanned_requeue\(\) \{\n.*?^\}\n", re.S | re.M)


def _count(tmp_path, comment: str, latest: str | None, scontrol_fails: bool = False) -> tuple[int, str, str]:
    """count_unplanned_requeue() from the job script (SBATCH), with squeue and scontrol stood in by scripts that
    read and write the job's comment in a file: (exit status, what it printed, the comment after)."""
    bin_dir, out_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir(exist_ok=True)
    (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    if latest:
        (out_dir / "checkpoints" / "latest").write_text(latest)
    state = tmp_path / "comment"
    state.write_text(comment)
    (bin_dir / "squeue").write_text(f'#!/bin/bash\ncat "{state}"\n')
    update = "exit 1" if scontrol_fails else f'printf "%s" "${{3#Comment=}}" > "{state}"'
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\n{update}\n")
    for tool in ("squeue", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    function = COUNT_FUNCTION.search(SBATCH.read_text()).group(0)
    done = subprocess.run(
        ["bash", "-c", f"{function}\ncount_unplanned_requeue"],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "out_dir": str(out_dir)},
        capture_output=True,
        text=True,
    )
    return done.returncode, done.stdout.strip(), state.read_text()


def test_unplanned_requeues_keep_the_comment_count_afresh_after_progress_and_fail_safe(tmp_path):
    assert _count(tmp_path, "(null)", None) == (0, "1", "unplanned_requeues=1@none")
    # The user's own comment stays; the same checkpoint again counts up.
    rc, count, comment = _count(tmp_path, "project=abc unplanned_requeues=1@step00000010", "step00000010")
    assert (rc, count, comment) == (0, "2", "project=abc unplanned_requeues=2@step00000010")
    # A run that checkpointed further since the last unplanned requeue starts the count again.
    assert _count(tmp_path, "project=abc unplanned_requeues=3@step00000010", "step00000020")[1:] == (
        "1",
        "project=abc unplanned_requeues=1@step00000020",
    )
    # Slurm cannot keep the count: the function fails, and the script ends the job instead of requeueing.
    assert _count(tmp_path, "x", "step00000010", scontrol_fails=True)[0] != 0


def test_the_master_port_is_picked_outside_the_ephemeral_range_and_held_for_the_store(tmp_path):
    import datetime
    import socket

    import torch.distributed as dist

    from pretrain.runtime import ports

    low, high = ports.ephemeral_range()
    port = ports.pick(4242)
    assert not low <= port <= high and ports.pick(4242) == port
    hold = [sys.executable, "-m", "pretrain.runtime.ports", "hold"]
    holder = subprocess.Popen([*hold, str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert int(holder.stdout.readline()) == port  # said once held
        with socket.socket() as other, pytest.raises(OSError):  # another job's bind: refused
            other.bind(("", port))
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("k", "v")  # rank 0's store listens on it all the same
        assert store.get("k") == b"v"
        # A MASTER_PORT given that something listens on (this store): refused, no port said.
        done = subprocess.run([*hold, str(port)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (2, "") and f"MASTER_PORT {port} is already in use" in done.stderr
    finally:
        holder.terminate()
        holder.wait(10)
    for bad in ("0", "70000", "http"):
        done = subprocess.run([*hold, bad], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (2, "") and "is not a port number" in done.stderr, done.stderr


def test_jobs_that_pick_their_port_at_the_same_moment_hold_different_ones():
    """Two jobs on one node picked the same port between one's pick and its hold (CI: both jobs'
    rank 0 on 20002, one failed with EADDRINUSE). `hold-free` picks and holds under one lock: four
    pickers from the same place at once each print, and hold, a port of their own."""
    import select
    import socket

    from pretrain.runtime import ports

    cmd = [sys.executable, "-m", "pretrain.runtime.ports", "hold-free", "4242"]
    holders = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        held = [int(h.stdout.readline()) for h in holders]
        assert len(set(held)) == 4, held
        assert all(h.poll() is None for h in holders)  # printed, and still holding
        assert not any(ports._plain_bind_ok(port) for port in held)
    finally:
        for h in holders:
            h.terminate()
            h.wait(10)
    assert all(ports._plain_bind_ok(port) for port in held)  # let go when told

    # What makes it so: a picker waits while another holds the pickers' lock (between its pick and
    # its bind), then picks around the port that one bound.
    lock = ports.pickers_lock()
    assert lock is not None
    first = ports.pick(4242)
    blocked = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert blocked.poll() is None and not select.select([blocked.stdout], [], [], 0)[0]
        with socket.socket() as other:  # the port this "picker" chose, bound before it lets go
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("", first))
            os.close(lock)
            assert int(blocked.stdout.readline()) != first
    finally:
        blocked.terminate()
        blocked.wait(10)
