"""Checkpoints resumed at another world size, ZeRO stage and precision (``pretrain.checkpoint.reshard``).

Each leg is ``tests/reshard_worker.py`` under DeepSpeed's own launcher (2 CPU ranks, gloo) or plain
python (1 rank): the tiny model and engine built by the project's code, fixed random batches that
do not depend on the layout, the project's checkpoint writer. The conversion is checked exactly
(every fp32 parameter and Adam moment after loading equals what the saving run held) and by the
losses of the steps after it against an uninterrupted run.

Loss tolerance: relative 5e-5. After a conversion the weights and moments are bit-identical and the
lr the same (asserted exactly), so the first loss after it is the same; the steps after differ only
in the order of fp32 sums (4 accumulated micro-batches on one rank, or 2 per rank all-reduced, or
reduce-scattered under ZeRO 3), about 1e-7 relative per gradient element, which Adam's
m / sqrt(v) carries into the update and later steps grow: at most 4e-6 was seen 3 steps after a
conversion. Zeroed moments moved the 2nd and 3rd losses after loading by 2e-4 and 5e-4, a
schedule restarted from step 0 by 4e-4 at the 3rd.

Time: about 30 s alone; up to a minute and a half under the README's command, where it starts first
beside the Slurm, study and demo modules: three worlds, stages and precisions each, forked from a rank
pool."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, free_port, rank_pool
from pretrain.checkpoint import files, reshard

slow = pytest.mark.slow  # launches processes
WORKER = "tests.reshard_worker"
STEPS = 3
LOSS_RTOL = 5e-5


def leg(
    out_dir: Path, dump: Path, ranks: int, stage: int, *extra: str, precision: str = "fp32", steps: int = STEPS
) -> tuple[dict, str]:
    args = [
        "--stage",
        str(stage),
        "--precision",
        precision,
        "--steps",
        str(steps),
        "--out-dir",
        str(out_dir),
        "--dump",
        str(dump),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # Forked from a rank pool that imported the worker's own imports (tests/rank_pool.py), under DeepSpeed's
    # per-node launcher's environment for 2 ranks; test_clean_exit goes through that launcher itself.
    proc = rank_pool(preload=(WORKER,)).run(WORKER, args, env, ranks, free_port() if ranks > 1 else None, 300)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    state = torch.load(dump, weights_only=False)
    # DeepSpeed imports its Muon module for type checks and in ZeRO's gradient partitioning, and that
    # module's torch.compile loads the inductor's compiler (~1 s a rank); with our optimiser it stays out.
    assert not state["inductor_loaded"], "the inductor's compiler was imported: DeepSpeed's Muon module again?"
    return state, proc.stdout + proc.stderr


def assert_same_state(saved: dict, loaded: dict) -> None:
    """Every parameter's fp32 value and both Adam moments, bit for bit."""
    assert sorted(saved) == sorted(loaded)
    assert len(saved) > 10
    for name in saved:
        assert sorted(saved[name]) == ["exp_avg", "exp_avg_sq", "fp32"], name
        for key, want in saved[name].items():
            got = loaded[name][key]
            assert got.shape == want.shape and got.dtype == torch.float32, (name, key)
            assert torch.equal(got, want), f"{name} {key}: max diff {(got - want).abs().max().item()}"
        assert saved[name]["exp_avg_sq"].abs().sum() > 0, f"{name}: no optimiser state was saved"


@slow
def test_zero2_world2_to_zero0_world1_to_zero3_world2(tmp_path):
    run = tmp_path / "run"
    a, _ = leg(run, tmp_path / "a.pt", 2, 2, "--save")
    b, b_log = leg(run, tmp_path / "b.pt", 1, 0, "--save", "--load", "step00000003")
    c, c_log = leg(run, tmp_path / "c.pt", 2, 3, "--load", "step00000006")
    ref, _ = leg(tmp_path / "ref", tmp_path / "ref.pt", 2, 2, steps=3 * STEPS)

    assert (
        "checkpoint step00000003 was saved at world 2 / ZeRO 2 / fp32; converting to world 1 / ZeRO 0 / fp32" in b_log
    )
    assert (
        "checkpoint step00000006 was saved at world 1 / ZeRO 0 / fp32; converting to world 2 / ZeRO 3 / fp32" in c_log
    )
    for folder in ("step00000003", "step00000006"):  # converted once, kept beside the original
        assert (run / "checkpoints" / folder / files.UNIVERSAL_DIR / "conversion.json").is_file()
    assert_same_state(a["after"], b["before"])
    assert_same_state(b["after"], c["before"])
    # Schedule, DeepSpeed's counters and the client state continue.
    assert b["lr_before"] == a["lr_after"] and c["lr_before"] == b["lr_after"]
    assert a["lr_after"] != b["lr_after"] != c["lr_after"]  # still warming up: the lr moves
    assert (a["global_steps"], b["global_steps"], c["global_steps"]) == (3, 6, 9)
    assert b["client_state"]["step"] == 3 and "world 2 / ZeRO 2" in b["client_state"]["client_note"]
    assert c["client_state"]["step"] == 6 and "world 1 / ZeRO 0" in c["client_state"]["client_note"]

    resumed = a["losses"] + b["losses"] + c["losses"]
    assert len(ref["losses"]) == len(resumed) == 3 * STEPS
    assert a["losses"] == ref["losses"][:STEPS]  # same layout, same arithmetic
    assert b["losses"][0] == pytest.approx(ref["losses"][STEPS], rel=1e-12)  # the very weights ref had
    assert resumed == pytest.approx(ref["losses"], rel=LOSS_RTOL, abs=0)
    assert ref["losses"][0] != pytest.approx(ref["losses"][-1], rel=100 * LOSS_RTOL)  # training moves the loss


@slow
def test_bf16_lamb_zero1_world2_to_stage0_world1(tmp_path):
    """bf16 stores its fp32 masters differently at each stage (ZeRO's flat partitions, and
    FP16_UnfusedOptimizer's per-parameter copies at stage 0); both are converted. Our LAMB counts
    steps as ints where torch's AdamW keeps tensors."""
    run = tmp_path / "run"
    a, _ = leg(run, tmp_path / "a.pt", 2, 1, "--save", "--optimizer", "lamb", precision="bf16")
    # micro-step gradients summed in fp32: at ZeRO 1 DeepSpeed's BF16_Optimizer does it (issue 33)
    assert (a["optimizer_wrapper"], a["grad_accum_dtype"]) == ("BF16_Optimizer", "torch.float32")
    b, log = leg(run, tmp_path / "b.pt", 1, 0, "--load", "step00000003", "--optimizer", "lamb", precision="bf16")
    assert "saved at world 2 / ZeRO 1 / bf16; converting to world 1 / ZeRO 0 / bf16" in log
    assert_same_state(a["after"], b["before"])
    assert b["lr_before"] == a["lr_after"] and b["global_steps"] == 6


@slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_conversion_says_how_far_along_its_reading_and_writing_are(tmp_path, monkeypatch, caplog, stage):
    """Converting a large model's checkpoint takes minutes: its reading (the rank files, by bytes) and
    its writing (every tensor of the universal layout) each say the MiB done of the total, the rate and
    the time left, every ``PROGRESS_S`` (here every file and every tensor)."""
    run = tmp_path / "run"
    a, _ = leg(run, tmp_path / "a.pt", 2, stage, "--save")
    tag = run / "checkpoints" / "step00000003"
    monkeypatch.setattr(reshard, "PROGRESS_S", 0.0)
    caplog.set_level("INFO", logger="pretrain")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        universal = reshard.ensure_universal(tag, reshard.read_layout(tag), out=tmp_path / "universal")
    finally:
        dist.destroy_process_group()
    assert (universal / "conversion.json").is_file()
    label = f"(reading checkpoint {tag}|writing checkpoint {tag} in the universal layout)"
    line = label + r": ([\d.]+) of ([\d.]+) MiB \((\d+)%, [\d.]+ MiB/s\), (about \d+m\d\ds left|no rate yet)"
    said = [m for r in caplog.records if r.name == "pretrain" and (m := re.fullmatch(line, r.getMessage()))]
    reading = [m for m in said if m.group(1).startswith("reading")]
    writing = [m for m in said if m.group(1).startswith("writing")]
    files_mib = sum(f.stat().st_size for f in tag.glob("*_states.pt")) / (1 << 20)
    params = sum(t.numel() for by_key in a["after"].values() for t in by_key.values())  # fp32 and both moments
    # said before each file after the first (the ranks' optimiser files and the model's), and each tensor
    files_read = len(list(tag.glob("*_states.pt")))
    assert (len(reading), len(writing)) == (files_read - 1, sum(len(k) for k in a["after"].values()) - 1), said
    for found, total_mib in ((reading, files_mib), (writing, params * 4 / (1 << 20))):
        done = [float(m.group(2)) for m in found]
        assert all(float(m.group(3)) == pytest.approx(total_mib, abs=0.06) for m in found), (found, total_mib)
        assert done == sorted(done) and 0 < done[0] and done[-1] < total_mib, done


def test_unconvertible_layouts_are_refused_before_start():
    saved = {
        "world": 2,
        "zero_stage": 2,
        "precision": "fp32",
        "offload_optimizer": False,
        "optimizer": "AdamW",
        "param_names_by_group": None,
    }
    same = reshard.wanted_layout(2, 2, "fp32", False, "adamw")
    assert not reshard.needs_conversion(saved, same) and reshard.check_convertible(saved, same) == []
    assert reshard.check_convertible(saved, reshard.wanted_layout(1, 3, "bf16", False, "adamw")) == []
    assert reshard.check_convertible(saved, reshard.wanted_layout(4, 1, "fp32", True, "adamw")) == []

    problems = reshard.check_convertible(saved, reshard.wanted_layout(1, 2, "fp32", False, "lamb"))
    assert len(problems) == 1 and "AdamW was saved, lamb is configured" in problems[0]
    problems = reshard.check_convertible(saved, reshard.wanted_layout(2, 2, "fp16", False, "adamw"))
    assert len(problems) == 1 and "fp16" in problems[0]
    stage0 = {**saved, "zero_stage": 0}
    problems = reshard.check_convertible(stage0, reshard.wanted_layout(2, 3, "fp32", False, "adamw"))
    assert len(problems) == 1 and "param_names_by_group" in problems[0]


@slow
@pytest.mark.parametrize("ranks,stage", [(1, 0), (2, 1), (2, 2)], ids=["zero0", "zero1-world2", "zero2-world2"])
def test_a_bf16_export_takes_the_fp32_masters_not_the_bf16_copies(tmp_path, ranks, stage):
    """In bf16 the module holds bf16 weights and the optimiser's wrapper the fp32 masters
    (FP16_UnfusedOptimizer at ZeRO 0, BF16_Optimizer's files at ZeRO 1, ZeRO's partitions at 2):
    the export writes the masters (issue 33)."""
    from pretrain.checkpoint.hf_export import PREFIXES, fp32_state_dict

    run = tmp_path / "run"
    a, _ = leg(run, tmp_path / "a.pt", ranks, stage, "--save", precision="bf16")
    exported = fp32_state_dict(run / "checkpoints", "step00000003")
    masters = a["after"]
    assert any(not torch.equal(m["fp32"], m["fp32"].bfloat16().float()) for m in masters.values())
    for name, m in masters.items():
        key = name
        while key.startswith(PREFIXES):
            key = next(key[len(p) :] for p in PREFIXES if key.startswith(p))
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], m["fp32"]), name


@pytest.mark.parametrize("kind", ["fused", "capturable", "foreach"])
def test_a_converted_step_count_lies_where_torch_would_put_it(kind):
    """A converted resume sets AdamW's step count itself; torch's fused and capturable kernels want it on
    the parameter's device (a CPU step beside CUDA parameters stops the first fused update), the others
    on the CPU. The ``meta`` device stands for a GPU: the placement must equal torch's own load_state_dict."""

    def adamw():
        param = torch.nn.Parameter(torch.empty(4, device="meta"))
        opt = torch.optim.AdamW([param], **({kind: True} if kind != "foreach" else {}))
        return opt, param

    theirs, param = adamw()
    state = theirs.state_dict()
    state["state"] = {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}
    theirs.load_state_dict(state)
    ours, ours_param = adamw()
    ours.state[ours_param] = {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros(4, device="meta"),
        "exp_avg_sq": torch.zeros(4, device="meta"),
    }
    reshard.set_step_count(ours, 7)
    want = theirs.state[param]["step"]
    got = ours.state[ours_param]["step"]
    assert got.device == want.device == (torch.device("cpu") if kind == "foreach" else torch.device("meta"))
    assert got.dtype == want.dtype == torch.float32
    if kind == "foreach":
        assert got.item() == 7.0


def test_step_counts_of_the_other_kernels():
    from pretrain.model.optim import Lamb

    lamb_param = torch.nn.Parameter(torch.ones(3))
    lamb = Lamb([lamb_param])
    lamb.state[lamb_param] = {"step": 1}
    reshard.set_step_count(lamb, 9)
    assert lamb.state[lamb_param]["step"] == 9


def test_every_state_gets_its_own_step_count_even_outside_the_groups():
    """ZeRO 3 takes each sub-group's fp32 partition out of its optimiser group between steps, and its
    universal loader gives all partitions one shared step tensor, which AdamW then advanced once per
    sub-group: a conversion into ZeRO 3 counted two steps a step (issue 61, item 1)."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}])
    shared = torch.tensor(3.0)
    for p in params:
        opt.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    for group in opt.param_groups:  # as ZeRO 3 leaves them between steps
        group["params"] = []
    reshard.set_step_count(opt, 7)
    steps = [opt.state[p]["step"] for p in params]
    assert [s.item() for s in steps] == [7.0, 7.0]
    assert steps[0] is not steps[1] and shared.item() == 3.0
    for p, group in zip(params, opt.param_groups):  # one step, as ZeRO 3 takes it, sub-group by sub-group
        group["params"] = [p]
        p.grad = torch.ones_like(p)
        opt.step()
        group["params"] = []
    assert [opt.state[p]["step"].item() for p in params] == [8.0, 8.0]
