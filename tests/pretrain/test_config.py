"""The configuration system: every shipped YAML loads; every problem is reported, all at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.config import loader as configlib
from pretrain.config.schema import Config, ConfigError, load_config, upgrade_saved
from pretrain.runtime.engine import deepspeed_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# configs/data/ holds data-prep settings (data_prep.settings); study*.yaml are training configs plus a
# study section (tests/pretrain/test_study.py loads them); every other YAML is a training config.
CONFIGS = sorted(
    p
    for p in CONFIG_DIR.rglob("*.yaml")
    if "data" not in p.relative_to(CONFIG_DIR).parts[:-1] and not p.name.startswith("study")
)


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1}))
    return str(tmp_path)


def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "mini.yaml", "base.yaml", "large.yaml", "stage3.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_yaml_loads(path, data_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    overrides = [f"data.dir={data_dir}"]
    if "sources:" in path.read_text():  # a mixture: every source in the test's folder
        overrides.append(f"data.sources=[{{name: a, dir: {data_dir}, weight: 3}}, {{name: b, dir: {data_dir}}}]")
    cfg = load_config(str(path), overrides)
    assert isinstance(cfg, Config)
    ds = deepspeed_config(cfg, world=1, precision="bf16")
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    assert ds["zero_optimization"]["stage"] == cfg.impl.zero_stage
    assert ds["bf16"] == {"enabled": True} and ds["communication_data_type"] == "fp32"  # reduced in fp32
    # summed over micro-steps in fp32 where DeepSpeed can (ZeRO 1-3); it refuses the mix at stage 0
    assert ds.get("data_types") == ({"grad_accum_dtype": "fp32"} if cfg.impl.zero_stage else None)
    # DeepSpeed's throughput timer synchronises the device twice a micro-batch: off (issue 73, item 1a)
    assert ds["timers"] == {"throughput": {"enabled": False}}
    fp32 = deepspeed_config(cfg, world=1, precision="fp32")
    assert "communication_data_type" not in fp32 and "data_types" not in fp32
    if cfg.impl.zero_stage:  # the buckets: no larger than the model (ZeRO allocates them whole)
        # an odd parameter count (an odd vocabulary's decoder bias): DeepSpeed asserts an even bucket
        small, large = (deepspeed_config(cfg, 1, "fp32", num_params=n)["zero_optimization"] for n in (1001, 10**9))
        assert (small["reduce_bucket_size"], large["reduce_bucket_size"]) == (1024, 5 * 10**7)
        assert small["allgather_bucket_size"] == 1024 and large["allgather_bucket_size"] == 5 * 10**7


def test_composition_and_overrides(data_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(
        "configs/large.yaml", [f"data.dir={data_dir}", "optim.lr=3e-4", "impl.zero_stage=3", "optim.betas=[0.9, 0.95]"]
    )
    assert cfg.model.num_layers == 24 and cfg.model.hidden_size == 1024  # large.yaml
    assert cfg.model.max_position_embeddings == 512  # inherited from base.yaml
    assert cfg.optim.lr == 3e-4 and cfg.impl.zero_stage == 3 and cfg.optim.betas == [0.9, 0.95]
    assert cfg.grad_accum_steps() == 4096 // (64 * 2)


def test_all_problems_reported_together(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model:\n  hidden_size: 100\n  num_heads: 3\n  hiden_dropout: 0.1\n"
        "optim:\n  lr: fast\n  name: sgd\n"
        "train:\n  global_batch_size: 64\n"
        "impl:\n  micro_batch_size: 8\n  zero_stage: 4\n"
        "colour: blue\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(str(bad), ["masking.rate=1.5", "data.dir=/nonexistent"])
    text = str(err.value)
    for expected in [
        "model.hiden_dropout: unknown key",
        "optim.lr: expected a number, got 'fast'",
        "optim.name: must be one of 'adamw', 'lamb'",
        "impl.zero_stage: must be one of 0, 1, 2, 3",
        "colour: unknown key",
        "masking.rate",
    ]:
        assert expected in text, (expected, text)
    # value checks run only once types are right, but all type problems come together
    assert len(err.value.problems) >= 6


def test_value_and_batch_problems(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError) as err:
        load_config(
            "configs/tiny.yaml",
            [
                f"data.dir={data_dir}",
                "model.num_heads=3",
                "masking.rate=0",
                "train.global_batch_size=16",
                "impl.micro_batch_size=8",
            ],
        )
    text = str(err.value)
    assert "hidden_size (64) must be divisible by num_heads (3)" in text
    assert "rate: must be in (0, 1)" in text
    assert "global_batch_size (16) must be a multiple of impl.micro_batch_size (8) x world size (3) = 24" in text


def test_missing_data_dir_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="no manifest.json"):
        load_config("configs/tiny.yaml", ["data.dir=/does/not/exist"])
    # a URL is checked where it points (tests/pretrain/test_remote_data.py), never taken for a local folder
    with pytest.raises(ConfigError, match=r"data.dir: gs://b/shards: the scheme gs:// is not supported"):
        load_config("configs/tiny.yaml", ["data.dir=gs://b/shards"])
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("configs/nope.yaml")
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config("configs/tiny.yaml", ["train.max_steps"])


def test_flatten_and_dump_roundtrip(data_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config("configs/mini.yaml", [f"data.dir={data_dir}"])
    flat = configlib.flatten(configlib.to_dict(cfg))
    assert flat["model.hidden_size"] == 256 and flat["impl.micro_batch_size"] == 32
    again = configlib.build(Config, __import__("yaml").safe_load(configlib.dump_yaml(cfg)))
    assert again == cfg


def test_problems_set_by_an_override_name_it_not_the_yaml():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["optim.lr=-1", "impl.zero_stage=5"])
    text = str(err.value)
    assert "configs/tiny.yaml with overrides" in text
    assert "optim.lr: must be positive, got -1.0 (from the override 'optim.lr=-1')" in text
    assert "(from the override 'impl.zero_stage=5')" in text


def test_the_old_masking_keys_are_refused_naming_the_new_ones(tmp_path, data_dir):
    """``masking.mask_prob`` is the masking rate in ModernBERT's packer, the [MASK] share here before it
    took Hugging Face's name: a config that uses it is refused, one line per key, naming the new key."""
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text("base: %s\nmasking:\n  random_prob: 0.0\n" % (Path("configs/tiny.yaml").resolve()))
    with pytest.raises(ConfigError) as err:
        load_config(str(yaml_file), [f"data.dir={data_dir}", "masking.mask_prob=0.3"])
    lines = err.value.problems
    assert len(lines) == 2, lines
    assert lines[0].startswith("masking.mask_prob: renamed masking.mask_replace_prob (") and lines[0].endswith(
        "(from the override 'masking.mask_prob=0.3')"
    )
    assert lines[1].startswith("masking.random_prob: renamed masking.random_replace_prob (")
    assert "unknown key" not in str(err.value)


def test_a_config_saved_with_the_old_masking_keys_reads_as_today_s(data_dir):
    """What a checkpoint saved (its ``config.yaml``) before the rename resumes: the old keys move to the new
    names, so the resume check sees no change; a value the saved config gives is kept."""
    saved = configlib.to_dict(Config())
    saved["masking"]["mask_prob"] = saved["masking"].pop("mask_replace_prob")
    saved["masking"]["random_prob"] = 0.05
    del saved["masking"]["random_replace_prob"]
    upgraded = upgrade_saved(saved)
    assert upgraded["masking"]["mask_replace_prob"] == 0.8 and upgraded["masking"]["random_replace_prob"] == 0.05
    assert "mask_prob" not in upgraded["masking"] and "random_prob" in saved["masking"]  # the input is untouched
    upgraded["data"]["dir"] = str(data_dir)
    assert configlib.build(Config, upgraded).masking.random_replace_prob == 0.05


def test_an_optimiser_deepspeed_hides_is_an_error_not_a_silent_non_skip():
    import types

    from pretrain.runtime.engine import inner_optimizer

    ours = types.SimpleNamespace(skip_next_step=False)
    assert inner_optimizer(types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=ours))) is ours
    with pytest.raises(RuntimeError, match="non-finite steps could not be skipped"):
        inner_optimizer(types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=None)))


def test_compile_auto_pays_only_where_measured_to():
    """auto compiles launches long enough to pay the start-up back, except fp32 on a CPU (measured
    no faster than eager); true and false are obeyed everywhere."""
    cfg = Config()
    assert cfg.impl.compile == "auto"
    assert cfg.compile_now(10_000, "cuda", "fp32") and cfg.compile_now(10_000, "cpu", "bf16")
    assert not cfg.compile_now(10_000, "cpu", "fp32")
    assert not cfg.compile_now(499, "cpu", "bf16") and not cfg.compile_now(499, "cuda", "bf16")
    assert cfg.compile_now(500, "cuda", "bf16")
    cfg.impl.compile = True
    assert cfg.compile_now(1, "cpu", "fp32")
    cfg.impl.compile = False
    assert not cfg.compile_now(10_000, "cuda", "bf16")


def test_cuda_graphs_are_asked_for_where_they_can_replay_and_said_on_the_start_line(data_dir):
    """impl.cuda_graphs=true needs a compiled step of fixed shapes at fixed addresses: what the rest of
    the config makes impossible is refused before anything starts, every problem at once; auto stays
    off until a GPU lease has measured graphs; a run without CUDA or without a compile says why not."""
    from pretrain.runtime.engine import cuda_graphs_plan

    with pytest.raises(ConfigError) as err:
        load_config(
            "configs/tiny.yaml",
            [
                f"data.dir={data_dir}",
                "impl.cuda_graphs=true",
                "impl.compile=false",
                "impl.zero_stage=3",
                "impl.autotune_kernels=true",
            ],
        )
    text = str(err.value)
    for expected in (
        "set impl.compile to true or auto",
        "needs masking.fixed_count=true",
        "use ZeRO 0-2",
        "impl.autotune_kernels=true tunes the compiled step's kernels",
    ):
        assert expected in text, text
    # where PyTorch's graphed backward is wrong (issue 84, item 0d): accumulation at ZeRO 0, fp32 at ZeRO 1,
    # DeepSpeed's own bf16 gradient sums at ZeRO 1
    graphs = ["impl.cuda_graphs=true", "masking.fixed_count=true", "impl.compile=true"]
    for unsafe, said in (
        (["impl.zero_stage=0"], "impl.zero_stage=0 and 2 micro-batches a step"),  # tiny: 16 = 2 x 8
        (["impl.zero_stage=1", "impl.precision=fp32"], "impl.zero_stage=1 in fp32"),
        # DeepSpeed's own BF16_Optimizer keeps the bf16 gradients a graph owns for the next backward
        (
            ["impl.zero_stage=1", "impl.precision=bf16", "impl.deepspeed_patches.bf16_multi_tensor=false"],
            "bf16_multi_tensor=false",
        ),
    ):
        with pytest.raises(ConfigError, match=said):
            load_config("configs/tiny.yaml", [f"data.dir={data_dir}", *graphs, *unsafe])
    load_config(
        "configs/tiny.yaml", [f"data.dir={data_dir}", *graphs, "impl.zero_stage=0", "train.global_batch_size=8"]
    )
    graphs = [*graphs, "impl.zero_stage=1", "impl.precision=bf16"]
    cfg = load_config("configs/tiny.yaml", [f"data.dir={data_dir}", *graphs])
    assert cuda_graphs_plan(cfg, "cuda", compiled=True)[0]
    assert cuda_graphs_plan(cfg, "cpu", compiled=True) == (
        False,
        "off: impl.cuda_graphs=true, but this run has no CUDA device",
    )
    assert not cuda_graphs_plan(cfg, "cuda", compiled=False)[0]
    assert not cuda_graphs_plan(load_config("configs/base.yaml", [f"data.dir={data_dir}"]), "cuda", True)[0]  # auto


def test_a_deepspeed_older_than_the_floor_is_refused_by_version():
    from pretrain.runtime.engine import deepspeed_problems

    assert deepspeed_problems() == []  # the installed one
    assert deepspeed_problems("0.19.8") == deepspeed_problems("0.20.1+cu128") == []
    (problem,) = deepspeed_problems("0.19.7")
    assert "DeepSpeed 0.19.7 is installed" in problem and "deepspeed==0.19.8" in problem


def test_the_loader_buffers_a_whole_step(data_dir, monkeypatch):
    """Issue 73, item 2: the workers buffer at least a step's micro-batches, so that the next step's are
    read while the current one trains (base.yaml on one GPU: 32 micro-batches, 4 workers x 4 was 16)."""
    from pretrain.config.schema import load_config
    from pretrain.run import loader_prefetch

    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["impl.micro_batch_size=128", "train.global_batch_size=4096", "impl.num_workers=4"]
    cfg = load_config("configs/base.yaml", [f"data.dir={data_dir}", *base])
    assert cfg.grad_accum_steps(1) == 32 and loader_prefetch(cfg, 1) * 4 >= 32 and loader_prefetch(cfg, 1) == 8
    assert loader_prefetch(cfg, 8) == 4  # 4 micro-batches a step on 8 GPUs: the configured 4 is enough
    no_workers = load_config("configs/base.yaml", [f"data.dir={data_dir}", *base[:2], "impl.num_workers=0"])
    assert loader_prefetch(no_workers, 1) == no_workers.impl.prefetch_factor


def test_the_problem_header_counts_problems_not_the_advice_after_them():
    from pretrain.config.loader import ConfigError

    text = str(ConfigError(["model.hidden_size: changed", "optim.lr: changed", "(start a new run instead)"], "x"))
    assert text.splitlines() == [
        "2 problem(s) in x:",
        "  - model.hidden_size: changed",
        "  - optim.lr: changed",
        "  (start a new run instead)",
    ]
