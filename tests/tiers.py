"""The two tiers of the suite, kept honest.

Fast tier, for every edit (``pytest -m "not slow"``): tests that run in this process only. Whole
suite, before a change is submitted (the README's command, what ``.ci/run`` calls): those and the
``slow`` ones, which launch processes (trainer ranks, DeepSpeed's launchers, the data-prep CLI) or
servers (MLflow, SeaweedFS, Slurm, Chromium).

A test that is not marked ``slow`` and starts a subprocess, or a new interpreter through
multiprocessing's spawn or forkserver, in its setup (a fixture it asks for) or its body, fails at
that point with a message that says so. A fork (a DataLoader's workers) copies this process and is
allowed. A fixture that an earlier slow test built is not seen, but the fast tier runs without those
and sees it. Imported by conftest.py."""

from __future__ import annotations

import multiprocessing.popen_forkserver
import multiprocessing.popen_spawn_posix
import platform
import subprocess

import pytest

_running: list = [None]  # the item being set up, run or torn down, and whether it may launch
_original_init = subprocess.Popen.__init__


class UnmarkedProcess(RuntimeError):
    pass


def _refuse_unmarked(shown: str):
    item = _running[0]
    if item is not None and item.get_closest_marker("slow") is None:
        raise UnmarkedProcess(
            f"{item.nodeid} starts a process ({shown[:160]}) but is not marked slow: mark it "
            "@pytest.mark.slow, or keep it in this process (the fast tier, pytest -m 'not slow', "
            "launches nothing)"
        )


def _guarded_init(self, args, *rest, **kwargs):
    _refuse_unmarked(args if isinstance(args, str) else " ".join(map(str, args)))
    _original_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_init
# The standard library's own once-per-process `uname -p` (platform.processor(), which mlflow's import
# asks for): taken now, so that no test is blamed for it in whatever order the tests run.
platform.processor()


def _guard_interpreter_start(popen_class):
    """multiprocessing's spawn and forkserver start a new interpreter that imports torch again, as
    torch.multiprocessing.spawn does; fork (a DataLoader's workers) copies this one and is allowed."""
    original = popen_class.__init__

    def guarded(self, process_obj):
        _refuse_unmarked(f"multiprocessing {popen_class.method}: {process_obj.name}")
        original(self, process_obj)

    popen_class.__init__ = guarded


_guard_interpreter_start(multiprocessing.popen_spawn_posix.Popen)
_guard_interpreter_start(multiprocessing.popen_forkserver.Popen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _running[0] = item
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _running[0] = item
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # Not checked: the last test of a worker also tears down the session's fixtures (a Slurm
    # cluster's scancel, a server's stop), which slow tests built.
    _running[0] = None
    yield
