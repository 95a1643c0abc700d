"""The trainer, end to end through its real entry points: `deepspeed --module pretrain.train` with 2
CPU ranks (gloo), every ZeRO stage, exact kill-free resume, export to Hugging Face, and learning; and
per-layer health metrics (``train.health_every``) at ZeRO 0, 2 and 3 on the same weights: every layer
has them, they are plausible, and the stages agree (the partitioned sums add up to the whole).

Time: about 2.5 minutes: five 2-rank runs at ZeRO 0-3, a halted and resumed run, the non-finite
stop at four stages and precisions (bf16 is emulated on an AVX2-only CPU, 50x slower, but these
runs stop after four steps), two short runs with an odd vocabulary, two exports, and the SIGUSR1 run
through the ``deepspeed`` command for real; the others fork their ranks from the rank pool
(tests/rank_pool.py)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEEPSPEED, REPO, command_of, free_port
from conftest import _run as run  # python -m ... through the rank pool
from conftest import train as launch

pytestmark = pytest.mark.slow
PY = sys.executable
STEPS = 16
HEALTH_EVERY = 4


def train(data_dir, out_dir, *overrides, ranks=2, check=True):
    return launch(data_dir, out_dir, *overrides, ranks=ranks, check=check)


def losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


COMMON = [
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "model.max_position_embeddings=64",
    "optim.warmup_steps=4",
    "optim.lr=3e-3",
]


@pytest.fixture(scope="session")
def reference_runs(shards, tmp_path_factory):
    """Uninterrupted 2-rank runs at ZeRO 0, 2 and 3, with per-layer health every 4 steps (the health tests
    read them; the resumed runs of test_resume_is_exact have none, so health must not move a loss).
    Each run's console is kept in its folder as console.txt."""
    out = {}
    for stage in (0, 2, 3):
        d = tmp_path_factory.mktemp(f"zero{stage}")
        proc = train(shards, d, *COMMON, f"impl.zero_stage={stage}", f"train.health_every={HEALTH_EVERY}")
        (d / "console.txt").write_text(proc.stdout + proc.stderr)
        out[stage] = d
    return out


def test_every_zero_stage_trains_and_agrees(reference_runs, shards, tmp_path):
    stage1 = tmp_path / "zero1"
    train(shards, stage1, *COMMON, "impl.zero_stage=1")
    runs = {**{s: losses(d) for s, d in reference_runs.items()}, 1: losses(stage1)}
    for stage, curve in runs.items():
        assert sorted(curve) == list(range(1, STEPS + 1)), stage
        first, last = sum(curve[s] for s in (1, 2)) / 2, sum(curve[s] for s in (STEPS - 1, STEPS)) / 2
        assert last < first - 0.3, f"ZeRO {stage}: loss did not fall ({first:.3f} -> {last:.3f})"
    for stage in (1, 2, 3):
        for s in range(1, STEPS + 1):
            assert runs[stage][s] == pytest.approx(runs[0][s], rel=2e-3, abs=2e-3), (stage, s)


@pytest.mark.parametrize("stage", [3])  # ZeRO 0/2 resume: test_sigusr1_*, test_resume_across_layouts
def test_resume_is_exact(stage, reference_runs, shards, tmp_path):
    """N steps, stop, resume to 2N: the same losses as 2N uninterrupted steps (fp32, to 1e-6)."""
    half = STEPS // 2
    train(shards, tmp_path, *COMMON, f"impl.zero_stage={stage}", f"train.halt_at_step={half}")
    assert sorted(losses(tmp_path)) == list(range(1, half + 1))
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == [f"step{half:08d}"]
    train(shards, tmp_path, *COMMON, f"impl.zero_stage={stage}")  # train.resume=auto
    resumed, uninterrupted = losses(tmp_path), losses(reference_runs[stage])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert abs(resumed[s] - uninterrupted[s]) <= 1e-6, (s, resumed[s], uninterrupted[s])


def test_export_loads_and_fills_masks(reference_runs, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    for stage in (0, 3):
        out = tmp_path / f"hf{stage}"
        run([PY, "-m", "pretrain.export", str(reference_runs[stage] / "checkpoints"), str(out)])
        model = AutoModelForMaskedLM.from_pretrained(out)
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        assert (
            model.config.vocab_size
            == model.get_input_embeddings().weight.shape[0]
            == len(AutoTokenizer.from_pretrained(out))
        )
        assert model.cls.predictions.bias.shape[0] == model.config.vocab_size
        answers = pipeline("fill-mask", model=str(out))("the city is in the [MASK] of france.")
        assert len(answers) == 5 and all(0.0 <= a["score"] <= 1.0 for a in answers)
    # the end-of-run export the trainer itself writes
    assert (reference_runs[2] / "hf_final" / "model.safetensors").is_file()


def test_bad_input_fails_before_any_process_group(shards, tmp_path, bert_uncased_dir):
    proc = train(
        shards, tmp_path, "impl.zero_stage=5", "optim.lr=-1", "model.hidden_size=65", "colour=red", ranks=1, check=False
    )
    assert proc.returncode == 2
    for expected in ["impl.zero_stage", "optim.lr", "hidden_size (65) must be divisible", "colour: unknown key"]:
        assert expected in proc.stderr, (expected, proc.stderr)
    assert "init_distributed" not in proc.stdout + proc.stderr
    proc = train(shards, tmp_path, "model.max_position_embeddings=32", ranks=1, check=False)
    assert proc.returncode == 2 and "seq" in proc.stderr.lower(), proc.stderr
    proc = train(shards, tmp_path, f"model.init_from={bert_uncased_dir}", ranks=1, check=False)
    assert proc.returncode == 2 and "has vocab_size 30522, the data's tokenizer 4096" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "stage,precision",
    [(2, "fp32"), (0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16")],
    ids=["zero2-fp32", "zero0-bf16", "zero1-bf16", "zero2-bf16", "zero3-bf16"],
)
def test_nonfinite_losses_skip_steps_then_stop_cleanly(shards, tmp_path, stage, precision):
    """An absurd learning rate blows the weights up after one update: every later loss is
    non-finite, each such step is skipped on every rank without moving the learning-rate schedule,
    and after max_nonfinite_in_a_row the run stops with its own exit code, leaving the last complete
    checkpoint loadable. Each stage and precision has DeepSpeed's own optimiser wrapper (ZeRO 1 bf16
    with fp32 accumulation is its BF16_Optimizer, the setting of configs/base.yaml): each must skip."""
    proc = train(
        shards,
        tmp_path,
        "train.max_steps=40",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=1",
        "optim.lr=1e30",
        "optim.warmup_steps=8",
        f"impl.zero_stage={stage}",
        f"impl.precision={precision}",
        "train.max_nonfinite_in_a_row=3",
        "model.max_position_embeddings=64",
        check=False,
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "3 non-finite losses in a row" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/nonfinite_skipped"] == 3
    assert math.isfinite(rows[0]["train/loss"])
    # warming up, the schedule would raise the rate every step: skipped steps hold it where step 1 left it
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]
    assert len(lrs) == 3 and lrs[0] == pytest.approx(1e30 * 2 / 8) and lrs[1:] == [lrs[0]] * 2, lrs
    # no checkpoint is written while steps are being skipped; the last one is the last healthy step
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert latest == "step00000001", latest
    if stage == 2:
        run([PY, "-m", "pretrain.export", str(tmp_path / "checkpoints"), str(tmp_path / "hf")])


def test_an_odd_vocabulary_trains_at_zero_1_and_2(wiki_txt_dir, tmp_path):
    """An odd vocabulary (RoBERTa's is 50,265) makes the parameter count odd: the ZeRO buckets sized
    from it must still be even, which DeepSpeed asserts at ZeRO 1 and 2."""
    from conftest import data_prep

    data_prep(
        "tokenizer",
        "--input",
        f"{wiki_txt_dir}/*.txt",
        "--out",
        tmp_path / "tok",
        "--vocab-size",
        "3001",
        "--lowercase",
    )
    data_prep(
        "shard",
        "--input",
        f"{wiki_txt_dir}/wiki-00.txt",
        "--tokenizer",
        tmp_path / "tok",
        "--out",
        tmp_path / "shards",
        "--seq-len",
        "64",
        "--shard-size",
        "400",
        "--validation-fraction",
        "0",
    )
    data_prep("finalize", tmp_path / "shards")
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["tokenizer"]["vocab_size"] % 2 == 1
    short = ["train.max_steps=2", "train.log_every=1", "train.eval_every=0", "model.max_position_embeddings=64"]
    for stage in (1, 2):  # unpadded (model.vocab_multiple=1): the parameter count stays odd
        out = tmp_path / f"zero{stage}"
        halt = ["train.halt_at_step=1"] if stage == 1 else []
        train(
            tmp_path / "shards",
            out,
            *short,
            "train.checkpoint_every=0",
            f"impl.zero_stage={stage}",
            "model.vocab_multiple=1",
            *halt,
        )
    # A checkpoint written before model.vocab_multiple existed (unpadded, the key absent from its
    # config) resumes with its own rows under today's default.
    from data_prep.common.shards import sha256_file
    from pretrain.checkpoint.files import FILE_LIST

    saved = tmp_path / "zero1" / "checkpoints" / "step00000001" / "config.yaml"
    text = saved.read_text()
    line = re.search(r"^ +vocab_multiple: 1\n", text, re.M).group(0)
    saved.write_text(text.replace(line, ""))
    listing = saved.parent / FILE_LIST  # the sizes and checksums it was written with
    files = json.loads(listing.read_text())
    files["files"]["config.yaml"] = {"size": saved.stat().st_size, "sha256": sha256_file(saved)}
    listing.write_text(json.dumps(files))
    train(tmp_path / "shards", tmp_path / "zero1", *short, "impl.zero_stage=1")
    assert sorted(losses(tmp_path / "zero1")) == sorted(losses(tmp_path / "zero2")) == [1, 2]
    hf_config = json.loads((tmp_path / "zero1" / "checkpoints" / "step00000002" / "hf_config.json").read_text())
    assert hf_config["vocab_size"] == 3001
    # Padded by default (3,001 -> 3,008 rows); the export has the tokenizer's 3,001.
    padded = tmp_path / "padded"
    proc = train(tmp_path / "shards", padded, *short, "impl.zero_stage=1", "train.eval_every=1")
    # these shards have no validation split: said once, before the start, instead of evaluating nothing
    assert proc.stdout.count("train.eval_every=1, but") == 1, proc.stdout[-2000:]
    assert json.loads((padded / "checkpoints" / "step00000002" / "hf_config.json").read_text())["vocab_size"] == 3008
    exported = json.loads((padded / "hf_final" / "config.json").read_text())
    assert exported["vocab_size"] == 3001, exported


def test_sigusr1_checkpoints_and_resume_matches(reference_runs, shards, tmp_path):
    """SIGUSR1 (Slurm's warning before a time limit) reaches the ranks: they finish the step,
    write a complete checkpoint, exit with code 3; the resumed job ends where the uninterrupted one did."""
    import signal
    import time

    import psutil

    args = [
        "--config",
        "configs/tiny.yaml",
        f"data.dir={shards}",
        f"train.out_dir={tmp_path}",
        *COMMON,
        "impl.zero_stage=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(
        [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "pretrain.train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics_file = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        assert launcher.poll() is None, launcher.stdout.read()
        time.sleep(0.2)
    commands = {p: command_of(p) for p in psutil.Process(launcher.pid).children(recursive=True)}
    ranks = [p for p, cmd in commands.items() if "pretrain.train" in cmd and "deepspeed.launcher.launch" not in cmd]
    assert len(ranks) == 2
    for p in ranks:
        p.send_signal(signal.SIGUSR1)
    out, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 3, out[-3000:]
    assert "checkpointed at step" in out
    stopped_at = max(losses(tmp_path))
    assert stopped_at < STEPS
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step{stopped_at:08d}"
    train(shards, tmp_path, *COMMON, "impl.zero_stage=2")
    resumed, uninterrupted = losses(tmp_path), losses(reference_runs[2])
    assert resumed[STEPS] == pytest.approx(uninterrupted[STEPS], abs=1e-6)


# ------------------------------------------------------------------------------ per-layer health
STAGES = (0, 2, 3)
GROUPS = ["embeddings", "layer_00", "layer_01", "head"]  # tiny.yaml: 2 encoder layers
KINDS = ("grad_norm", "param_norm", "update_ratio")


@pytest.fixture(scope="module")
def health_runs(reference_runs):
    out = {}
    for stage in STAGES:
        rows = [json.loads(line) for line in (reference_runs[stage] / "metrics.jsonl").read_text().splitlines()]
        out[stage] = (
            {
                r["step"]: {k: v for k, v in r.items() if k.startswith("health/")}
                for r in rows
                if any(k.startswith("health/") for k in r)
            },
            (reference_runs[stage] / "console.txt").read_text(),
        )
    return out


def test_every_layer_has_health_metrics_every_n_steps(health_runs):
    metrics, _ = health_runs[0]
    assert sorted(metrics) == list(range(HEALTH_EVERY, STEPS + 1, HEALTH_EVERY))
    for step, row in metrics.items():
        assert sorted(row) == sorted(f"health/{g}/{k}" for g in GROUPS for k in KINDS), step
        for g in GROUPS:
            assert row[f"health/{g}/grad_norm"] > 0 and row[f"health/{g}/param_norm"] > 0
            if step <= STEPS // 2:  # the lr decays linearly to 0 at the last step
                # AdamW at lr ~3e-3 moves each weight by about lr: a ratio of 1e-4 to 1e-1, not 0 nor 1.
                assert 1e-4 < row[f"health/{g}/update_ratio"] < 0.1, (step, g, row)
    # The head holds the 4096-token output bias and the embeddings the 4096 x 64 table.
    assert metrics[4]["health/embeddings/param_norm"] > metrics[4]["health/layer_00/param_norm"] / 10


def test_the_console_shows_our_lines_with_the_time_left_and_a_summary(health_runs):
    _, console = health_runs[0]
    for noise in ("FutureWarning", "LOAD REPORT", "corrupted", "Reconstructed fp32 state dict", "gcc "):
        assert noise not in console, noise
    assert re.search(r" INFO step 4 loss=\S+ .*tokens_per_s=\S+ .* left=0m\d\ds\n", console), console[-3000:]
    assert re.search(
        rf" INFO done: {STEPS} steps, {STEPS * 1024:,} tokens in \dm\d\ds; train/loss \d\.\d+, "
        r"eval/loss \d\.\d+\n  checkpoints: .*\n  export: .*hf_final",
        console,
    ), console[-3000:]


@pytest.mark.parametrize("stage", [2, 3])
def test_partitioned_stages_agree_with_zero_0(health_runs, stage):
    whole, parts = health_runs[0][0], health_runs[stage][0]
    assert sorted(parts) == sorted(whole)
    for step in whole:
        for key, value in whole[step].items():
            assert math.isclose(parts[step][key], value, rel_tol=2e-3), (stage, step, key, parts[step][key], value)


def test_train_accuracy_is_the_logged_steps_own_whatever_the_log_cadence(shards, tmp_path):
    """The argmax over the vocabulary runs on logged steps only, so ``train/accuracy`` is the logged
    step's (as ``train/grad_norm`` is), the same at ``log_every`` 1 and 4; ``train/loss`` stays the
    window's mean."""
    accuracy = {}
    for every in (1, 4):
        out = tmp_path / f"every{every}"
        launch(
            shards,
            out,
            "train.max_steps=8",
            f"train.log_every={every}",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "optim.lr=3e-3",
            "optim.warmup_steps=2",
            check=True,
        )
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        accuracy[every] = {r["step"]: r["train/accuracy"] for r in rows if "train/accuracy" in r}
    assert sorted(accuracy[4]) == [4, 8] and sorted(accuracy[1]) == list(range(1, 9))
    assert accuracy[4] == {4: accuracy[1][4], 8: accuracy[1][8]}
    assert accuracy[1][8] > 0
    assert accuracy[1][8] != pytest.approx(sum(accuracy[1][s] for s in range(5, 9)) / 4, rel=1e-3)
