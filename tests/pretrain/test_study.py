"""`python -m pretrain.study`: a 2x2 grid of real training runs (DeepSpeed's launcher, the tiny
model), one MLflow parent run with four child runs, the summary table and plots, a re-run that
starts nothing, and an interrupted variant that resumes from its checkpoint.

Time: about 3-4 minutes: the study runner's own launches are what is tested (DeepSpeed's runner
and per-node launcher per variant, five of them, and a Slurm array), so they are not forked from
the rank pool."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from mlflow_server import mlflow_server  # noqa: F401  (a fixture)
from pretrain.config import loader as configlib
from pretrain.config.loader import ConfigError
from tests.slurm.cluster import slurm_cluster  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow
PY = sys.executable
STEPS = 6
COMMON = [
    f"train.max_steps={STEPS}",
    "train.log_every=2",
    "train.eval_every=3",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "model.max_position_embeddings=64",
    "optim.warmup_steps=2",
    "tracking.backend=mlflow",
    "tracking.system_metrics=false",
    "tracking.experiment=study-test",
]
GRID = ["masking.rate=0.15,0.4", "masking.strategy=token,span"]
NAMES = ["rate=0.15-strategy=token", "rate=0.15-strategy=span", "rate=0.4-strategy=token", "rate=0.4-strategy=span"]


def study(shards, out: Path, *extra, rc=0):
    cmd = [
        PY,
        "-m",
        "pretrain.study",
        "--config",
        "configs/tiny.yaml",
        f"data.dir={shards}",
        f"study.out_dir={out}",
        "study.name=grid",
        *COMMON,
        *GRID,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == rc, f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return proc


def metric_steps(out: Path, key: str) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if key in r]


def test_grid_runs_resumes_summarizes_and_skips_when_done(shards, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "study"
    first = out / NAMES[0]
    # An array task cut short: variant 0 alone, stopped with a checkpoint at step 3.
    study(shards, out, "--variant-index", "0", "train.halt_at_step=3", rc=3)
    assert (first / "checkpoints" / "step00000003" / "COMPLETE").is_file() and not (first / "hf_final").exists()
    assert [d.name for d in out.iterdir() if d.is_dir() and d.name != "mlruns"] == [NAMES[0]]

    # The whole study: variant 0 resumes from its checkpoint, the other three start.
    proc = study(shards, out)
    assert f"study: {NAMES[0]}: resuming" in proc.stdout, proc.stdout
    assert sum(f"study: {n}: starting" in proc.stdout for n in NAMES[1:]) == 3, proc.stdout
    assert "(resumed from step00000003)" in (first / "train.log").read_text()
    for name in NAMES:
        assert metric_steps(out / name, "train/loss") == [2, 4, 6], name
        assert metric_steps(out / name, "eval/loss") == [3, 6], name
        assert json.loads((out / name / "study_status.json").read_text())["launches"] == (2 if name == NAMES[0] else 1)

    # MLflow: one parent run, four children with their own params, all in the study's store.
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("study-test")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 4, [
        (r.info.run_name, r.data.tags.get("mlflow.parentRunId")) for r in runs
    ]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.params["study.variants"] == "4"
    assert json.loads(parent.data.params["study.grid.masking.rate"]) == [0.15, 0.4]
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id, "summary")) == [
        "summary/eval_loss.png",
        "summary/probe_accuracy.png",
        "summary/summary.csv",
        "summary/summary.md",
    ]
    by_name = {r.info.run_name: r for r in children}
    assert sorted(by_name) == sorted(NAMES)
    for name, run in by_name.items():
        rate, strategy = name.split("-")
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.params["masking.rate"] == rate.split("=")[1]
        assert run.data.params["masking.strategy"] == strategy.split("=")[1]
        assert (
            run.data.params["train.max_steps"] == str(STEPS) and run.data.params["masking.mask_replace_prob"] == "0.8"
        )
        assert run.info.status == "FINISHED" and "eval/loss" in run.data.metrics
    assert [m.step for m in client.get_metric_history(by_name[NAMES[0]].info.run_id, "eval/loss")] == [3, 6]
    # The parent's chart page compares the variants: a chart per variant in a section per measure.
    finals = {n: [json.loads(line) for line in (out / n / "metrics.jsonl").read_text().splitlines()] for n in NAMES}
    final = {
        (n, m): [r for r in finals[n] if f"eval/{m}" in r][-1][f"eval/{m}"] for n in NAMES for m in ("loss", "accuracy")
    }
    assert {
        k: v for k, v in client.get_run(parent.info.run_id).data.metrics.items() if not k.startswith("compare/")
    } == {f"eval_{m}/{n.replace('=', ':')}": v for (n, m), v in final.items()}
    for m in ("loss", "accuracy"):  # and one chart per measure with every variant: x = the variant's row
        assert sorted(
            (p.step, p.value) for p in client.get_metric_history(parent.info.run_id, f"compare/eval_{m}")
        ) == [(i, final[(n, m)]) for i, n in enumerate(NAMES)]
    assert "- step 3: `rate=0.4-strategy=span`" in client.get_run(parent.info.run_id).data.tags["mlflow.note.content"]

    # The summary: four rows with the grid values and real numbers; the plots are PNG images.
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["variant"] for r in table] == NAMES
    for row in table:
        assert row["status"] == "finished" and row["steps"] == str(STEPS)
        assert f"rate={row['masking.rate']}-strategy={row['masking.strategy']}" == row["variant"]
        assert 0 < float(row["eval/loss"]) < 12 and 0 <= float(row["eval/accuracy"]) <= 1
        assert float(row["tokens_per_s"]) > 0 and float(row["wall_s"]) > 0
        final = [json.loads(line) for line in (out / row["variant"] / "metrics.jsonl").read_text().splitlines()]
        assert float(row["eval/loss"]) == pytest.approx([r for r in final if "eval/loss" in r][-1]["eval/loss"])
    assert len({row["eval/loss"] for row in table}) == 4, "the variants trained differently"
    md = (out / "summary.md").read_text()
    assert md.count("| rate=") == 4 and "eval/loss" in md
    for png in ("eval_loss.png", "probe_accuracy.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png

    # A re-run starts nothing: every variant is skipped, no training output changes.
    before = {
        n: ((out / n / "metrics.jsonl").stat().st_mtime_ns, (out / n / "train.log").stat().st_size) for n in NAMES
    }
    proc = study(shards, out)
    assert proc.stdout.count("finished before, skipped") == 4 and "starting" not in proc.stdout, proc.stdout
    assert before == {
        n: ((out / n / "metrics.jsonl").stat().st_mtime_ns, (out / n / "train.log").stat().st_size) for n in NAMES
    }
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 5 and client.get_run(parent.info.run_id).info.status == "FINISHED"
    assert len(client.get_metric_history(parent.info.run_id, f"eval_loss/{NAMES[0].replace('=', ':')}")) == 1
    assert "workflowType=machine_learning" in proc.stdout and "View run" not in proc.stdout, proc.stdout


def test_every_problem_of_every_variant_before_anything_starts(shards, tmp_path):
    out = tmp_path / "study"
    proc = study(
        shards,
        out,
        "masking.rate=0.15,1.5",
        "masking.strategy=token,bogus",
        "train.out_dir=elsewhere",
        "impl.micro_batch_size=5",
        rc=2,
    )
    err = proc.stderr
    assert "variant rate=1.5-strategy=token: masking.rate: must be in (0, 1), got 1.5" in err, err
    assert "variant rate=0.15-strategy=bogus: masking.strategy: must be one of" in err, err
    assert "train.out_dir: set by the study for each variant" in err, err
    assert "train.global_batch_size (16) must be a multiple of impl.micro_batch_size (5)" in err, err
    assert not out.exists(), "nothing may start"

    # a tracking server that is down: said at once, nothing trains
    from conftest import free_port

    down = f"http://127.0.0.1:{free_port()}"
    proc = study(shards, out, f"tracking.tracking_uri={down}", rc=2)
    assert f"error: MLflow at {down}: cannot open the study's run" in proc.stderr, proc.stderr
    assert not [d for d in out.iterdir() if d.is_dir()], "no variant may start"


def test_shipped_study_config_and_command_line_grid(shards, bert_uncased_dir):
    from pretrain.study.plan import load_study, split_args

    # docs/recipes.md runs it with the bundled encoder as init_from; checked against the data before
    # anything starts (these shards have a 4,096-token vocabulary, the encoder 30,522).
    with pytest.raises(ConfigError, match=r"model.init_from: .* has vocab_size 30522, the data's tokenizer 4096"):
        load_study(str(REPO / "configs" / "study.yaml"), [f"data.dir={shards}", f"model.init_from={bert_uncased_dir}"])
    study = load_study(str(REPO / "configs" / "study.yaml"), [f"data.dir={shards}"])
    assert study.grid_keys == ["masking.rate", "masking.strategy"] and len(study.variants) == 6
    assert {(v.cfg.masking.rate, v.cfg.masking.strategy) for v in study.variants} == {
        (r, s) for r in (0.15, 0.3, 0.4) for s in ("token", "span")
    }
    assert all(v.cfg.train.max_steps == 200 and v.cfg.train.resume == "auto" for v in study.variants)
    assert {v.cfg.train.out_dir for v in study.variants} == {str(study.dir / v.name) for v in study.variants}
    # the command line replaces an axis, fixes a key (taking it out of the grid), adds another axis
    study = load_study(
        str(REPO / "configs" / "study.yaml"),
        [
            f"data.dir={shards}",
            "model.max_position_embeddings=64",
            "masking.rate=0.4",
            "masking.strategy=token,span",
            "masking.mask_replace_prob=0.8,1.0",
            "masking.random_replace_prob=0.0",
            "optim.betas=[0.9,0.99]",
        ],
    )
    assert study.grid_keys == ["masking.strategy", "masking.mask_replace_prob"]
    assert [v.name for v in study.variants] == [
        "strategy=token-mask_replace_prob=0.8",
        "strategy=token-mask_replace_prob=1.0",
        "strategy=span-mask_replace_prob=0.8",
        "strategy=span-mask_replace_prob=1.0",
    ]
    assert all(v.cfg.masking.rate == 0.4 and v.cfg.optim.betas == [0.9, 0.99] for v in study.variants)
    dropout = load_study(str(REPO / "configs" / "study-attention-dropout.yaml"), [f"data.dir={shards}"])
    assert [(v.cfg.model.attention_dropout, v.cfg.model.hidden_dropout) for v in dropout.variants] == [
        (0.0, 0.1),
        (0.1, 0.1),
    ]
    section, axes, shared, problems = split_args(["a.b=1,2", "c.d=[1,2]", "study.ranks=4", "e=x"])
    assert (section, axes, shared, problems) == ({"ranks": 4}, {"a.b": [1, 2]}, {"c.d": [1, 2], "e": "x"}, [])


def test_summary_picks_up_downstream_metrics_and_marks_the_missing(shards, tmp_path):
    """Metrics written in the trainer's metrics.jsonl format: a variant with probe results and one
    without; the table shows '-' where a metric is absent, the probe plot draws the bars, and a probe's
    accuracy in summary.md says its 95% interval from the task's test examples (logged at step 0)."""
    import matplotlib.image

    from pretrain.study.plan import load_study
    from pretrain.study.runner import is_finished, read_status
    from pretrain.study.summary import write_summary

    study = load_study(
        "configs/tiny.yaml",
        [
            f"data.dir={shards}",
            f"study.out_dir={tmp_path}",
            "masking.rate=0.15,0.4",
            "model.max_position_embeddings=64",
        ],
    )
    with_probe, without = study.variants
    rows = {
        with_probe.name: [
            {"step": 0, "downstream/word_order/test_examples": 100},
            {"step": 5, "train/loss": 7.0, "train/tokens_seen": 5120, "perf/tokens_per_s": 900.0},
            {"step": 5, "eval/loss": 6.9, "eval/accuracy": 0.11},
            {"step": 10, "train/loss": 6.0, "train/tokens_seen": 10240, "perf/tokens_per_s": 1100.0},
            {
                "step": 10,
                "eval/loss": 6.1,
                "eval/accuracy": 0.15,
                "downstream/word_order/accuracy": 0.71,
                "downstream/word_order/macro_f1": 0.70,
                "downstream/word_order/baseline_accuracy": 0.5,
            },
        ],
        without.name: [
            {"step": 5, "train/loss": 7.5, "train/tokens_seen": 5120, "perf/tokens_per_s": 1000.0},
            {"step": 5, "eval/loss": 7.2, "eval/accuracy": 0.09},
        ],
    }
    for variant in study.variants:
        lines = rows[variant.name]
        variant.out_dir.mkdir(parents=True)
        (variant.out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (variant.out_dir / "study_status.json").write_text(json.dumps({"launches": 1, "wall_s": 12.5, "last_exit": 3}))
    write_summary(study, read_status, is_finished)
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == [
        "variant",
        "masking.rate",
        "status",
        "steps",
        "tokens_seen",
        "eval/loss",
        "eval/accuracy",
        "downstream/word_order/accuracy",
        "downstream/word_order/baseline_accuracy",
        "downstream/word_order/macro_f1",
        "downstream/word_order/test_examples",
        "tokens_per_s",
        "wall_s",
    ]
    assert table[0] == {
        "variant": "rate=0.15",
        "masking.rate": "0.15",
        "status": "interrupted",
        "steps": "10",
        "tokens_seen": "10240",
        "eval/loss": "6.1",
        "eval/accuracy": "0.15",
        "downstream/word_order/accuracy": "0.71",
        "downstream/word_order/baseline_accuracy": "0.5",
        "downstream/word_order/macro_f1": "0.7",
        "downstream/word_order/test_examples": "100",
        "tokens_per_s": "1000.0",
        "wall_s": "12.5",
    }
    assert [table[1][k] for k in ("eval/loss", "downstream/word_order/accuracy", "downstream/word_order/macro_f1")] == [
        "7.2",
        "-",
        "-",
    ]
    summary = (tmp_path / "summary.md").read_text()
    assert "| rate=0.4 | 0.4 | interrupted | 5 | 5120 | 7.2 | 0.09 | - | - | - | - | 1000 | 12.5 |" in summary
    # 71 of 100 right: Wilson's 0.615-0.790 (scipy's binomtest agrees); 50 of 100: 0.404-0.596
    assert "| 6.1 | 0.15 | 0.71 (0.615-0.790) | 0.5 (0.404-0.596) | 0.7 | 100 | 1000 |" in summary
    image = matplotlib.image.imread(tmp_path / "probe_accuracy.png")[..., :3]
    first_colour = (0x1F / 255, 0x77 / 255, 0xB4 / 255)  # matplotlib's C0: the first variant's bar
    assert (abs(image - first_colour).max(axis=-1) < 0.02).sum() > 2000


@pytest.mark.slurm
def test_slurm_array_job_one_variant_per_task_then_the_summary(shards, slurm_cluster, mlflow_server, tmp_path):
    """submit_study.sh on a real Slurm: the array's tasks train their variants at the same time on
    the two nodes, logging to one MLflow server; the dependent job writes the summary."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "study"
    env = slurm_cluster.client_env(MLFLOW_TRACKING_URI=mlflow_server.uri)
    log_dir = tmp_path / "logs"  # not made here: the helper makes it (Slurm would fail the jobs)
    proc = slurm_cluster.run(
        "bash",
        "launchers/slurm/submit_study.sh",
        f"--output={log_dir}/%x-%A_%a.out",
        "--time=00:10:00",
        "--",
        "configs/tiny.yaml",
        f"data.dir={shards}",
        f"study.out_dir={out}",
        "study.name=slurm",
        *COMMON,
        "masking.rate=0.15,0.4",
        env=env,
        timeout=180,
    )
    array_job, summary_job = map(int, proc.stdout.split())
    (summary,) = slurm_cluster.wait(summary_job, timeout=480)
    log_files = sorted(log_dir.glob("*.out"))
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in log_files)
    # The summary job is no array: its log is named by its job id alone (not ..._4294967294.out).
    assert f"mlm-study-summary-{summary_job}.out" in [p.name for p in log_files], log_files
    tasks = slurm_cluster.jobs(array_job)
    assert sorted(t.array_task_id for t in tasks) == [0, 1] and all(t.ok for t in tasks), (tasks, logs)
    assert summary.ok, (summary, logs)
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["variant"], r["status"], r["steps"]) for r in table] == [
        ("rate=0.15", "finished", str(STEPS)),
        ("rate=0.4", "finished", str(STEPS)),
    ]
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name("study-test").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [r.info for r in runs]
    assert sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id) == [
        "rate=0.15",
        "rate=0.4",
    ]


def test_a_variant_folder_holding_other_settings_is_refused(shards, tmp_path):
    """Fixing another seed on the command line must not skip (or resume) the variants an earlier run
    of the same study finished with the old seed: each difference named, nothing started."""
    from pretrain.study.plan import load_study

    args = [f"data.dir={shards}", f"study.out_dir={tmp_path / 'study'}", "train.max_steps=4"]
    study = load_study(str(REPO / "configs" / "study.yaml"), args)
    for variant in study.variants[:2]:  # as run_variant leaves them
        variant.out_dir.mkdir(parents=True)
        (variant.out_dir / "variant.yaml").write_text(configlib.dump_yaml(variant.cfg))
    assert len(load_study(str(REPO / "configs" / "study.yaml"), args).variants) == 6  # the same study: fine
    with pytest.raises(ConfigError) as refused:
        load_study(str(REPO / "configs" / "study.yaml"), [*args, "train.seed=7"])
    assert len(refused.value.problems) == 2, refused.value.problems
    first = study.variants[0]
    assert refused.value.problems[0] == (
        f"variant {first.name}: {first.out_dir} holds a run with train.seed=42, this study has 7: "
        "give this study its own study.out_dir"
    )
