"""The run's console (pretrain.tracking.console): third-party chatter to the run folder's file, also for a
library imported while its output is being redirected."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest

from pretrain.tracking import console


@pytest.fixture
def logging_restored(monkeypatch):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {
        n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate, logging.getLogger(n).level)
        for n in ("DeepSpeed", "transformers", "mlflow", "pretrain")
    }
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(console, "_LOG_FILE", None)
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, console._ConsoleFilter)]
    root.setLevel(level)
    for name, (h, propagate, lvl) in named.items():
        lib = logging.getLogger(name)
        lib.handlers, lib.propagate, lib.level = h, propagate, lvl


def test_a_library_imported_under_redirection_logs_to_the_file_afterwards(tmp_path, capfd, logging_restored):
    """DeepSpeed, imported by the first init_distributed inside ``chatter_to_file``, gives its logger a
    handler on the redirected stream; once that file is closed, its warnings (at a converted resume:
    "MPU is not provided") printed a "--- Logging error ---" traceback on every rank instead."""
    path = console.quiet_third_party(str(tmp_path), 0)
    with console.chatter_to_file():
        library = logging.getLogger("DeepSpeed")  # what DeepSpeed's import does
        library.propagate = False
        library.addHandler(logging.StreamHandler(stream=sys.stdout))
        library.warning("imported")
    library.warning("MPU is not provided, setting tp size to 1 in checkpoint loading.")
    out, err = capfd.readouterr()
    assert "Logging error" not in out + err and "MPU is not provided" not in out + err
    text = path.read_text()
    assert "imported" in text and "DeepSpeed WARNING MPU is not provided" in text
