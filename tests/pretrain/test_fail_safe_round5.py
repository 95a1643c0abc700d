"""Fail safe, round 5 (issue 72): a checkpoint never runs code, names read from a mirror, a manifest
or a file list stay inside their folder, a new phase checks its checkpoint as a resume does, and a
training config with a YAML error is named (exit 2) before the launcher starts anything.

Each test reproduces the attack or the fault first, then shows it refused and named."""

from __future__ import annotations

import subprocess

import pytest

from conftest import PY, REPO, trainer_env
from pretrain.config.loader import ConfigError
from pretrain.config.schema import load_config

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
