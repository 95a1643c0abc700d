"""The tree is formatted and linted by ruff as pyproject.toml configures it (``[tool.ruff]``): what CI
enforces. Fix a failure with ``.venv/bin/ruff format . && .venv/bin/ruff check --fix .``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).with_name("ruff")

pytestmark = pytest.mark.slow  # it runs ruff, a process


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command):
    done = subprocess.run(
        [str(RUFF), *command, "--no-cache", "."], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
