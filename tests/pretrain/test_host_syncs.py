"""The training step reads from the device once (issue 49, item 3): on a GPU every read of a tensor's
value by the host (``item``, ``bool``, ``tolist``, ``nonzero`` ...) waits for the queued kernels, so a
step with several stalls as often. ``tests/sync_probe.py`` runs the real trainer in one process with
those reads counted by call site. On a step that logs nothing, our code waits for nothing: the numbers
that decide the update are read by the next step (``pretrain/step.py``, "Deferred reads"); DeepSpeed's
own waits are asserted by stage, each named in docs/gpu-step.md.

Time: about 3-4 minutes alone, 8 under the README's command: real trainer runs, six of them
compiling (the autotuned one ~1 minute)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from conftest import PY, REPO, explain, train, trainer_env

pytestmark = pytest.mark.slow

STEPS, LOG_EVERY = 6, 3
ONE_READ = ["pretrain/step.py:decide_update.tolist"]
# The step before's decision, copied to host memory behind that step's work and read after this step's
# backward (pretrain/step.py, "Deferred reads"): on a GPU the device is past it by then, and the work
# queued since is not drained. The probe counts every read on the CPU, so it is named here.
READ_BEHIND = "pretrain/step.py:read_deferred.tolist"


def run_script(script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``tests/<script> ARGS`` in a launched job's environment, run to a clean exit."""
    proc = subprocess.run(
        [PY, f"tests/{script}", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=trainer_env(),
    )
    assert proc.returncode == 0, explain(proc)
    return proc


def run_probe(script: str, shards, tmp_path, *overrides) -> dict:
    """``tests/<script>`` running the real trainer on ``configs/tiny.yaml`` for STEPS steps; its JSON."""
    out = tmp_path / "probe.json"
    run_script(
        script,
        out,
        "--config",
        "configs/tiny.yaml",
        f"data.dir={shards}",
        f"train.out_dir={tmp_path / 'run'}",
        "tracking.report=false",
        f"train.max_steps={STEPS}",
        f"train.log_every={LOG_EVERY}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        *overrides,
    )
    return json.loads(out.read_text())


def probe(shards, tmp_path, *overrides) -> list[list[str]]:
    return run_probe(
        "sync_probe.py", shards, tmp_path, "train.eval_sequences=16", "train.spike_guard.enabled=true", *overrides
    )["steps"]


# Every wait for the device on a step that logs nothing, by call site, at each ZeRO stage in bf16 with
# two micro-batches a step (global 16 = 2 x 8): none of ours (the numbers that decide the update are
# read by the next step). At ZeRO 1, base.yaml's path, none of DeepSpeed's either: its norm check is
# answered by that read (pretrain/runtime/deepspeed_patches.py). ZeRO 0, 2 and 3 run DeepSpeed's own
# code, with its waits (docs/gpu-step.md), until a GPU shows they matter. No device synchronisation at
# any stage: DeepSpeed's throughput timer, which synchronised twice a micro-batch, is off.
UTILS, ZERO = "deepspeed/runtime/utils.py", "deepspeed/runtime/zero"
WAITS_BY_STAGE = {
    # FP16_UnfusedOptimizer (ZeRO 0 in bf16): its overflow test reads each gradient tensor's answer (42
    # tensors in tiny), then the answer, and each parameter group's norm (2 groups) twice
    0: {
        f"{UTILS}:has_overflow_serial.__bool__": 42,
        f"{UTILS}:has_overflow.item": 1,
        f"{UTILS}:get_weight_norm.__float__": 2,
        f"{UTILS}:get_weight_norm.item": 2,
    },
    1: {},  # BF16_Optimizer: its norm check answered by the step's own read (engine.will_skip_update)
    # DeepSpeedZeroOptimizer: its overflow test, the norm's two -1 copies and three norm checks
    2: {
        f"{ZERO}/stage_1_and_2.py:has_overflow.item": 1,
        f"{UTILS}:mask_nan_or_inf_with_val_inplace.tensor": 2,
        f"{UTILS}:is_invalid_grad_norm.__bool__": 3,
    },
    # ZeRO 3: the norm's two inline -1 copies (get_grad_norm_direct's torch.tensor(-1.0, device=)) and its check
    3: {f"{ZERO}/stage3.py:get_grad_norm_direct.tensor": 2, f"{UTILS}:is_invalid_grad_norm.__bool__": 1},
}


@pytest.mark.parametrize("stage", sorted(WAITS_BY_STAGE))
def test_a_step_that_logs_nothing_waits_for_the_device_only_where_named(shards, tmp_path, stage):
    steps = probe(shards, tmp_path, "masking.fixed_count=true", f"impl.zero_stage={stage}", "impl.precision=bf16")
    assert len(steps) == STEPS
    for number, waits in enumerate(steps, start=1):
        print(f"ZeRO {stage}, step {number}: {dict(Counter(waits))}", file=sys.stderr)
        if number % LOG_EVERY == 0 or number == STEPS:  # a logged step reads its metrics
            assert len([w for w in waits if not w.startswith("deepspeed/")]) > 1, (number, waits)
            continue
        if number == 1 and stage == 3:  # ZeRO 3's first step also sizes its partitions on the host
            continue
        # ours: nothing; after a step that logged nothing either, that step's decision from host memory
        ours = {READ_BEHIND: 1} if (number - 1) % LOG_EVERY else {}
        assert dict(Counter(waits)) == {**ours, **WAITS_BY_STAGE[stage]}, (number, waits)


def test_a_step_that_logs_nothing_reads_at_once_where_asked(shards, tmp_path):
    """``impl.deferred_reads=false``: every step reads its decision before its update, once."""
    steps = probe(
        shards,
        tmp_path,
        "masking.fixed_count=true",
        "impl.zero_stage=1",
        "impl.precision=bf16",
        "impl.deferred_reads=false",
    )
    assert [dict(Counter(steps[n - 1])) for n in (1, 2, 4, 5)] == [{ONE_READ[0]: 1}] * 4, steps


def test_masking_without_a_fixed_count_reads_the_count_once_a_step(shards, tmp_path):
    """The documented exception: a data-dependent number of masked tokens is known only on the host.
    The step's micro-batches (two here) are masked together: one read for the count, one for where
    each micro-batch's positions end, however many micro-batches there are."""
    steps = probe(shards, tmp_path, "masking.fixed_count=false")
    ours = sorted(r for r in steps[0] if not r.startswith("deepspeed/"))
    reads = ["pretrain/model/masking.py:mask_batch.nonzero", "pretrain/model/masking.py:split_rows.tolist"]
    assert ours == sorted(reads), steps[0]  # the step's decision is read by the next step


def test_a_compiled_step_is_traced_once_logged_or_not(shards, tmp_path):
    """One graph for the compiled step (issue 60, item 4): the accuracy's argmax is taken on every step
    when compiled, so the first logged step does not trace a second graph (on an H100 a BERT-base
    compile took 45 s)."""
    found = run_probe("graph_probe.py", shards, tmp_path, "masking.fixed_count=true", "impl.compile=true")
    assert len(found["graphs"]) == STEPS and found["graphs"][0] >= 1, found
    # logged steps (3 and 6) trace nothing new: the count after step 1 holds to the end
    assert found["graphs"] == [found["graphs"][0]] * STEPS, found


def test_the_cuda_graphs_path_compiles_for_replay_and_logs_the_compiled_losses(shards, tmp_path):
    """Issue 73, item 4, as far as a CPU goes: with ``impl.cuda_graphs`` on, the engine compiles with
    reduce-overhead (inductor's CUDA graphs, which it records only on a GPU) and each micro-batch
    begins a new graph step; the losses are the plain compiled run's, bit for bit (the same kernels)."""
    common = ["masking.fixed_count=true", "impl.compile=true", "impl.precision=fp32", "impl.zero_stage=2"]
    graphed = run_probe("cuda_graphs_probe.py", shards, tmp_path / "graphed", *common)
    assert graphed["compiled_with"] == [{"mode": "reduce-overhead"}] and graphed["exit"] == 0, graphed
    assert graphed["marks"] == STEPS * 2  # two micro-batches a step
    assert_graphs_replay_at_the_addresses_recorded(graphed)
    steps = [f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.eval_every=0"]
    proc = train(shards, tmp_path / "compiled", *steps, "train.checkpoint_every=0", *common)
    assert proc.returncode == 0, explain(proc)

    def losses(out_dir):
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]

    assert losses(tmp_path / "graphed" / "run") == losses(tmp_path / "compiled") != []


def assert_graphs_replay_at_the_addresses_recorded(graphed: dict) -> None:
    """Every static input of the compiled step (parameters, buffers, the tensors reached through a
    module's attribute) at one address over the run: where one moves, a GPU records its graphs again
    at every call (the H200's 0.158x of 2026-11-28: the dropout keys were new tensors each micro-batch)."""
    moved = {name: n for name, n in graphed["addresses"].items() if n != 1}
    reached = [name for name in graphed["addresses"] if name.startswith("L[")]  # by attribute, not by name
    assert moved == {} and graphed["unresolved"] == [] and reached, graphed


@pytest.mark.parametrize("dropout_hash", ["per_pair", "per_element"])
def test_cuda_graphs_find_their_static_inputs_where_they_were_recorded(shards, tmp_path, dropout_hash):
    """base.yaml's path (ZeRO 1 in bf16) with each keyed-dropout hash: what the step hands its graphs
    by a module's attribute (the micro-batch's dropout keys) is written over in place, not replaced."""
    overrides = ["masking.fixed_count=true", "impl.compile=true", "impl.precision=bf16", "impl.zero_stage=1"]
    graphed = run_probe("cuda_graphs_probe.py", shards, tmp_path, *overrides, f"impl.dropout_hash={dropout_hash}")
    assert graphed["exit"] == 0 and graphed["marks"] == STEPS * 2, graphed
    assert_graphs_replay_at_the_addresses_recorded(graphed)


def test_autotuned_kernels_compile_in_torchs_mode_say_so_and_train_to_the_same_losses(shards, tmp_path):
    """Issue 84, item 3: ``impl.autotune_kernels`` compiles with torch.compile's max-autotune (matmuls
    timed as cuBLAS and as inductor's templates, which can fuse the bias and GELU into the epilogue;
    on a CPU inductor's C++ templates), said on the start line; the losses are the default compile's
    to float round-off. With CUDA graphs it is torch's max-autotune with them."""
    from pretrain.runtime import engine as eng

    modes = []

    class Engine:
        def compile(self, compile_kwargs):
            modes.append(compile_kwargs.get("mode"))

    for graphs, tuned in ((False, False), (True, False), (False, True), (True, True)):
        eng.compile_engine(Engine(), graphs, tuned)
    assert modes == [None, "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"]
    common = [f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.eval_every=0"]
    common += ["train.checkpoint_every=0", "impl.compile=true", "impl.precision=fp32", "impl.zero_stage=1"]
    runs = {}
    for tuned in (False, True):
        out = tmp_path / f"tuned-{tuned}"
        proc = train(shards, out, *common, f"impl.autotune_kernels={str(tuned).lower()}")
        assert proc.returncode == 0, explain(proc)
        assert ("inductor's kernels chosen by timing" in proc.stdout + proc.stderr) == tuned
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[tuned] = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(runs[True]) == sorted(runs[False]) == [LOG_EVERY, STEPS], runs
    assert all(abs(runs[True][s] - runs[False][s]) <= 1e-4 * abs(runs[False][s]) for s in runs[False]), runs


def test_bf16_optimizers_norm_and_clip_are_deepspeeds_arithmetic_in_two_multi_tensor_calls(monkeypatch):
    """ZeRO 1 in bf16 (DeepSpeed's BF16_Optimizer, base.yaml's path) takes the gradient norm one
    kernel per tensor, marks a non-finite one -1 with a copy from host memory, and clips after reading
    the factor on the host; the patches put in multi-tensor versions. Same numbers as DeepSpeed's own
    (on the CPU, bit for bit), when the norm clips and when it does not, and a non-finite norm marked
    -1 as DeepSpeed marks it, without a tensor made from a host value."""
    import deepspeed.runtime.bf16_optimizer as bf16_optimizer

    from pretrain.runtime import deepspeed_patches as patches

    patches.apply_patches(optimizer_named=True)
    norm_of = {
        "ours": bf16_optimizer.get_global_norm_of_tensors,
        "theirs": patches.original(f"{patches.BF16}:get_global_norm_of_tensors"),
    }
    clip = {
        "ours": bf16_optimizer.clip_tensors_by_global_norm,
        "theirs": patches.original(f"{patches.BF16}:clip_tensors_by_global_norm"),
    }
    assert norm_of["ours"] is not norm_of["theirs"] and clip["ours"] is not clip["theirs"]
    g = torch.Generator().manual_seed(0)
    shapes = [(30528, 64), (64,), (256, 64), (3, 5, 7), (1,)]
    for scale, clips in ((1.0, True), (1e-4, False)):
        grads = [torch.randn(*s, generator=g) * scale for s in shapes]
        tensors = {"theirs": [t.clone() for t in grads], "ours": [t.clone() for t in grads]}
        norms = {k: norm_of[k](tensors[k]) for k in tensors}
        assert torch.equal(norms["ours"], norms["theirs"]) and (float(norms["ours"]) > 1.0) == clips
        for k in tensors:
            clip[k](tensors[k], max_norm=1.0, global_norm=norms[k])
        assert all(torch.equal(a, b) for a, b in zip(tensors["ours"], tensors["theirs"])), scale
        assert clips or all(torch.equal(a, b) for a, b in zip(tensors["ours"], grads))  # not clipped: untouched
    bad = [torch.ones(4), torch.tensor([float("nan")])]
    assert float(norm_of["theirs"](bad)) == -1.0
    created = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: created.append(a) or real_tensor(*a, **k))
    assert float(norm_of["ours"](bad)) == -1.0 and created == []  # a fill, no copy from the host


def test_bf16_optimizers_gradient_accumulation_is_deepspeeds_sums_in_multi_tensor_calls_of_one_dtype(shards):
    """Each micro-batch's bf16 gradients go into BF16_Optimizer's fp32 ones through multi-tensor calls
    (pretrain/runtime/deepspeed_patches.py) instead of two kernels per parameter: in a real engine, after
    each of two micro-batches, the fp32 gradients equal what DeepSpeed's own update makes of the same ones."""
    from conftest import free_port

    done = run_script("bf16_grads_probe.py", shards, free_port(), timeout=300)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["ours"] and found["params"] > 10, found
    # ... and the bf16 gradients freed after the sum, so that the next backward writes its own
    # instead of adding them into zeros (issue 73, item 3)
    same = {"equal": True, "moved": True, "has_gradients": True, "bf16_freed": True}
    # The step's first micro-batch converts into the zeroed sums, in a call CUDA makes one multi-tensor
    # launch (fp32 += bf16 was a kernel a tensor: the H200 profile of 2026-11-28, 1,616 a step); the next
    # adds, on a CPU in one pass (CUDA's add through scratch: test_deepspeed_patches)
    assert found["micro_batches"] == [
        {**same, "sums": ["_foreach_copy_"], "multi_tensor": True},
        {**same, "sums": ["_foreach_add_"], "multi_tensor": False},
    ]


def test_patch_groups_turned_off_run_deepspeeds_own_code_with_its_waits_to_the_same_losses(shards, tmp_path):
    """Issue 84, item 5: each group of DeepSpeed patches is a switch (impl.deepspeed_patches), so that a
    GPU can measure it. All off at base.yaml's path (ZeRO 1, bf16): DeepSpeed's own checks wait for the
    device again on steps that log nothing, and the losses are those of the run with them on."""
    from pretrain.runtime.deepspeed_patches import PATCH_GROUPS

    off = [f"impl.deepspeed_patches.{group}=false" for group in PATCH_GROUPS]
    common = ("masking.fixed_count=true", "impl.zero_stage=1", "impl.precision=bf16")
    on_dir, off_dir = tmp_path / "on", tmp_path / "off"
    on_dir.mkdir()
    off_dir.mkdir()
    probe(shards, on_dir, *common)
    steps = probe(shards, off_dir, *common, *off)
    quiet = [w for n, waits in enumerate(steps, 1) if n % LOG_EVERY and n != STEPS for w in waits]
    assert any(w.startswith("deepspeed/") for w in quiet), quiet

    def losses(folder):
        rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    assert losses(on_dir) == losses(off_dir) and len(losses(on_dir)) == STEPS // LOG_EVERY, losses(on_dir)
