"""Debian packages a test needs (Slurm, munge, Chromium), installed with apt-get when running as root
(CI). One install at a time on the machine: pytest-xdist workers may ask together, and apt-get
fails at once on a lock another apt-get holds."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess

LOCK = "/tmp/mlm-pretrain-tests-apt.lock"


def can_install() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def apt_install(*packages: str) -> subprocess.CompletedProcess:
    """``apt-get install``, after ``apt-get update`` when the package index is stale; returns the
    last apt-get's result (check ``returncode``)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(install, check=False, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True, env=env, timeout=600)
            done = subprocess.run(install, check=False, capture_output=True, text=True, env=env, timeout=900)
        return done
