"""Fail safe, round 5 (issue 72): a checkpoint never runs code, names read from a mirror, a manifest
or a file list stay inside their folder, a new phase checks its checkpoint as a resume does, and a
training config with a YAML error is named (exit 2) before the launcher starts anything.

Each test reproduces the attack or the fault first, then shows it refused and named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PY, REPO, explain, run_module, train, trainer_env
from pretrain.checkpoint import safe_load
from pretrain.checkpoint.checkpointing import write_file_list
from pretrain.checkpoint.files import FILE_LIST, MODEL_STATES_FILE, rank_files
from pretrain.config.loader import ConfigError
from pretrain.config.schema import load_config

RUN = [
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_sequences=32",
    "model.max_position_embeddings=64",
    "optim.warmup_steps=2",
    "impl.compile=false",
    "tracking.backend=none",
]


# ------------------------------------------------------------------- item 1: a checkpoint is never code


class RunsCommand:
    """What an attacker puts into a checkpoint file: unpickling it calls ``os.system(command)``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant(folder: Path, name: str, marker: Path) -> None:
    """``name`` in checkpoint ``folder`` rewritten to carry a command that touches ``marker`` when
    unpickled, and ``file_list.json`` rewritten to match, as whoever can write the folder can."""
    state = torch.load(folder / name, map_location="cpu", weights_only=True)
    state["note"] = RunsCommand(f"touch {marker}")
    torch.save(state, folder / name)
    write_file_list(folder)


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """A tiny run's complete checkpoint at step 2 (ZeRO 1: DeepSpeed's optimiser files, with the
    types allowed by name, are read too)."""
    out = tmp_path_factory.mktemp("round5") / "run"
    train(shards, out, *RUN, "train.max_steps=2", "train.checkpoint_every=2", "impl.zero_stage=1", check=True)
    return out


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_a_crafted_file_is_refused_by_name_and_its_command_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / MODEL_STATES_FILE
    torch.save({"module": {"w": torch.ones(2)}, "note": RunsCommand(f"touch {marker}")}, path)
    problems = safe_load.code_problems(tmp_path)
    assert len(problems) == 1 and str(path) in problems[0] and "posix.system" in problems[0]
    with pytest.raises(safe_load.UnsafeCheckpoint, match="posix.system"):
        safe_load.load(path)
    # DeepSpeed's own reads pass weights_only=False: in a process that loads checkpoints, they are forced.
    with pytest.raises(Exception, match="posix.system"), safe_load.weights_only():
        torch.load(path, weights_only=False)
    assert safe_load.FORCE not in os.environ  # only while loading: other code and child processes keep torch's rules
    # The static reader takes protocol 2 (torch.save's); another protocol is refused, not waved through.
    torch.save({"note": RunsCommand(f"touch {marker}")}, path, pickle_protocol=4)
    assert safe_load.code_problems(tmp_path)
    with pytest.raises(safe_load.UnsafeCheckpoint):
        safe_load.load(path)
    with pytest.raises(Exception), safe_load.weights_only():
        torch.load(path, weights_only=False)
    # torch's legacy format cannot be read statically: its weights-only load refuses it, naming the type.
    torch.save({"note": RunsCommand(f"touch {marker}")}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(safe_load.UnsafeCheckpoint, match=f"{path} holds posix.system"):
        safe_load.load(path)
    assert not marker.exists()
    torch.save({"module": {"w": torch.ones(2)}, "step": 3, "betas": (0.9, 0.98)}, path)
    assert safe_load.code_problems(tmp_path) == [] and safe_load.load(path)["step"] == 3


def test_deepspeed_s_enum_is_written_by_value_where_python_pickles_enums_by_name(tmp_path, monkeypatch):
    """Early Python 3.11 (Debian 12's 3.11.2) pickles an enum member as getattr(class, name), which a
    weights-only load refuses: the ZeroStageEnum in DeepSpeed's optimiser files is written by value."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    # Python 3.11.2's Enum.__reduce_ex__
    by_name = lambda member, protocol: (getattr, (member.__class__, member._name_))  # noqa: E731
    monkeypatch.setattr(ZeroStageEnum, "__reduce_ex__", by_name)
    monkeypatch.setattr(safe_load, "_installed", False)
    before, after = tmp_path / "before", tmp_path / "after"
    for folder in (before, after):
        folder.mkdir()
        torch.save({"zero_stage": ZeroStageEnum.gradients}, folder / "optim_states.pt")
        safe_load.allow_deepspeed_types()  # as before every save: the second file is written after it
    assert "builtins.getattr" in " ".join(safe_load.code_problems(before))
    assert safe_load.code_problems(after) == []
    assert safe_load.load(after / "optim_states.pt")["zero_stage"] is ZeroStageEnum.gradients


@pytest.mark.slow
def test_what_the_trainer_writes_is_plain_data(trained):
    """DeepSpeed's optimiser files included: the types it pickles are allowed by name (ALLOWED)."""
    folder = trained / "checkpoints" / "step00000002"
    assert rank_files(folder, "optim_states.pt") and safe_load.code_problems(folder) == []


def _refused(proc, marker: Path, *named: str) -> None:
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert all(n in said for n in named), explain(proc)
    assert "Traceback" not in said, explain(proc)
    assert not marker.exists(), "the checkpoint's command ran"


@pytest.mark.slow
def test_resume_export_evaluate_and_a_new_phase_refuse_a_checkpoint_that_runs_code(shards, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    marker = tmp_path / "ran"
    plant(run / "checkpoints" / "step00000002", MODEL_STATES_FILE, marker)
    named = (MODEL_STATES_FILE, "posix.system")
    _refused(train(shards, run, *RUN, "train.max_steps=4", "impl.zero_stage=1", "train.resume=auto"), marker, *named)
    _refused(run_module("pretrain.export", str(run), str(tmp_path / "hf")), marker, *named)
    assert not (tmp_path / "hf").exists()
    csv = tmp_path / "task.csv"
    csv.write_text("text,label\n" + "".join(f"sentence number {i},{i % 2}\n" for i in range(20)))
    _refused(run_module("pretrain.evaluate", str(run), "--task", str(csv)), marker, *named)
    phase = [*RUN, "train.max_steps=2", f"train.init_from_checkpoint={run / 'checkpoints'}"]
    _refused(train(shards, tmp_path / "phase2", *phase), marker, *named)
    # From a checkpoint mirror (a folder here; a bucket is read through the same code): refused as well.
    mirror = tmp_path / "mirror"
    shutil.copytree(run / "checkpoints", mirror)
    (mirror / "latest").write_text("step00000002")
    resumed = train(shards, tmp_path / "fresh", *RUN, "train.max_steps=4", f"train.checkpoint_mirror={mirror}")
    _refused(resumed, marker, *named)


# ------------------------------------------------------------------- item 5: a YAML error in a config

BROKEN_YAML = "train:\n  max_steps: 10\n  log_every: [1, 2\nimpl:\n  zero_stage: 1\n"


def test_a_yaml_error_in_a_config_or_an_override_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN_YAML)
    with pytest.raises(ConfigError) as caught:
        load_config(str(bad))
    assert f"{bad}: not valid YAML" in str(caught.value)
    assert "line 4" in str(caught.value)  # where PyYAML found the list unclosed
    with pytest.raises(ConfigError) as caught:
        load_config("configs/tiny.yaml", ["train.max_steps=[1,", "train.no_such_key=3"])
    assert "override 'train.max_steps=[1,': its value is not valid YAML" in str(caught.value)
    assert "no_such_key" in str(caught.value)  # every problem at once, as for any other bad config


def test_the_launcher_refuses_a_bad_config_before_deepspeed_s_runner_starts(shards, tmp_path, capsys, monkeypatch):
    from pretrain.runtime import launcher

    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("started"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN_YAML)
    args = ["--num_gpus", "2", "--master_port", "29999", "--module", "pretrain.train", "--config"]
    assert launcher.main([*args, str(bad)]) == 2
    assert f"{bad}: not valid YAML" in capsys.readouterr().err
    # The world size is the command line's: a batch that 2 ranks cannot split is refused here too ...
    assert launcher.main([*args, "configs/tiny.yaml", "train.global_batch_size=7"]) == 2
    assert "must be a multiple of impl.micro_batch_size" in capsys.readouterr().err
    # ... and one that they can is not (the port check comes next; a free port passes it).
    good = [*args, "configs/tiny.yaml", f"data.dir={shards}", "train.global_batch_size=16"]
    assert launcher.config_problems(good) is None
    assert launcher.config_problems(["--num_gpus", "2", "--module", "other.module", "--config", str(bad)]) is None
    assert started == []


@pytest.mark.slow
def test_the_trainer_names_a_yaml_error_with_exit_2_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN_YAML)
    done = subprocess.run(
        [PY, "-m", "pretrain.train", "--config", str(bad)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "not valid YAML" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------- item 3: a new phase checks its checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["a flipped byte in an optimiser file", "a truncated model file"])
def test_a_new_phase_from_a_damaged_checkpoint_names_the_file_with_exit_2(shards, trained, tmp_path, fault):
    source = tmp_path / "phase1"
    shutil.copytree(trained, source)
    folder = source / "checkpoints" / "step00000002"
    target = rank_files(folder, "optim_states.pt")[0] if "optimiser" in fault else folder / MODEL_STATES_FILE
    data = bytearray(target.read_bytes())
    if "flipped" in fault:
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        target.write_bytes(bytes(data[: len(data) // 2]))
    listed = json.loads((folder / FILE_LIST).read_text())["files"]
    assert target.name in listed  # the list is as written: the damage is in the file
    proc = train(shards, tmp_path / "phase2", *RUN, "train.max_steps=2", f"train.init_from_checkpoint={folder}")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "is damaged" in said and target.name in said, explain(proc)
    assert "Traceback" not in said and "non-finite" not in said


# ------------------------------------------------------------------- item 2: names that escape their folder


def test_names_read_from_files_are_plain_relative_paths_inside_their_folder(tmp_path):
    from data_prep.common.paths import UnsafeName, inside, name_problem

    for bad in ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "", "a\\..\\b", "a\0b", None, 3]:
        assert name_problem(bad), bad
    assert name_problem("step00000002/zero/bert.embeddings/fp32.pt") is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "out").symlink_to(tmp_path)
    with pytest.raises(UnsafeName, match="symbolic link"):
        inside(tmp_path / "run", "out/x", "file_list.json")
    assert inside(tmp_path / "run", "a/b", "file_list.json") == tmp_path / "run" / "a" / "b"


def test_a_mirrored_file_list_that_names_a_path_out_of_the_run_is_refused_and_nothing_written(tmp_path):
    from data_prep.common.paths import UnsafeName
    from data_prep.common.shards import sha256_file
    from pretrain.checkpoint import mirror

    bucket = tmp_path / "bucket"
    tag = bucket / "step00000002"
    tag.mkdir(parents=True)
    payload = tmp_path / "bucket" / "payload"
    payload.write_text("written where it should not be\n")
    escape = "../../../../escaped"  # from <run>/checkpoints/step00000002: out of the run folder
    (bucket / "escaped").write_text(payload.read_text())  # what the mirror serves under that key
    listed = {escape: {"size": payload.stat().st_size, "sha256": sha256_file(payload)}}
    (tag / FILE_LIST).write_text(json.dumps({"files": listed}))
    (tag / "layout.json").write_text(json.dumps({"world": 1, "zero_stage": 1}))
    (tag / "COMPLETE").write_text("{}")
    (bucket / "latest").write_text("step00000002")
    root = tmp_path / "a" / "b" / "run" / "checkpoints"
    with pytest.raises(UnsafeName, match=r"'\.\./\.\./\.\./\.\./escaped' is a path with '\.\.'"):
        mirror.fetch_newer(str(bucket), root)
    assert not (tmp_path / "a" / "escaped").exists() and not (root / "step00000002").exists()
    # A local file list naming such a path is damage, named, and nothing outside is read.
    local = tmp_path / "local"
    local.mkdir()
    (local / FILE_LIST).write_text(json.dumps({"files": {"/etc/hostname": {"size": 1, "sha256": "0" * 64}}}))
    from pretrain.checkpoint.checkpointing import damage

    assert "'/etc/hostname' is an absolute path" in damage(local)


def test_a_manifest_whose_names_or_digests_lead_out_of_the_data_folder_is_refused(shards, tmp_path):
    from data_prep.common.errors import ShardError
    from data_prep.common.manifest import MANIFEST, load_manifest

    raw = json.loads((shards / MANIFEST).read_text())
    cases = {
        "name": ("shards", 0, "name", "../../outside.tar"),
        "sha256": ("shards", 0, "sha256", "../../../tmp/x"),
        "path": ("tokenizer", None, "path", "/etc"),
    }
    for what, (section, index, key, value) in cases.items():
        bad = json.loads(json.dumps(raw))
        (bad[section][index] if index is not None else bad[section])[key] = value
        folder = tmp_path / what
        folder.mkdir()
        (folder / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(ShardError) as caught:
            load_manifest(folder)
        assert repr(value)[:40] in str(caught.value) and key in str(caught.value), str(caught.value)


# ------------------------------------------------------------------- item 6: credentials in a tracking URI


def test_url_credentials_are_masked_in_what_is_written(caplog):
    import logging

    from pretrain.config import loader

    uri = "https://alice:t0ken@mlflow.example.com:5000/path"
    assert loader.redact(uri) == "https://***@mlflow.example.com:5000/path"
    assert loader.redact({"a": [uri, 3], "b": "s3://bucket/x"}) == {
        "a": ["https://***@mlflow.example.com:5000/path", 3],
        "b": "s3://bucket/x",
    }
    from pretrain.config.schema import Config

    cfg = Config()
    cfg.tracking.tracking_uri = uri
    assert "t0ken" not in loader.dump_yaml(cfg) and "***@mlflow.example.com" in loader.dump_yaml(cfg)
    handler = logging.StreamHandler()
    handler.addFilter(loader.RedactingFilter())
    record = logging.LogRecord("pretrain", logging.INFO, __file__, 1, "MLflow: %s not reachable", (uri,), None)
    assert (
        handler.filter(record)
        and record.getMessage() == "MLflow: https://***@mlflow.example.com:5000/path not reachable"
    )
