"""Shared-memory files in /dev/shm (RAM) left behind by processes killed with SIGKILL: DeepSpeed's
CPU all-reduce buffers (64 MiB per rank, one set per port) and the named semaphores of Python's
multiprocessing (``sem.mp-*``, from ``data_prep shard --workers N``). Nothing else removes them:
after a day of test runs /dev/shm held 19 GB.

A file is stale when it is ours and no live process maps it (every process of the job that made it
maps it until it exits). Its age matters only where a job starting this very moment may have created
it and not mapped it yet: a DeepSpeed buffer names its job's master port
(``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``), which a live job listens on from before
it creates its buffers, so one whose master is this machine and whose port nobody listens on here is
stale at once: a relaunch seconds after a ``kill -9``, as a Slurm requeue is, finds its predecessor's
64 MiB per rank gone. Other files must be older than ``MIN_AGE_S``. Another job's live segment is never touched.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import re
import socket
import time

SHM = "/dev/shm"
PATTERNS = ("deepspeed_allreduce_buffer_*", "sem.mp-*")
MIN_AGE_S = 60.0
BUFFER_NAME = re.compile(r"^deepspeed_allreduce_buffer_\d+_(.+)_(\d+)_\d+$")

log = logging.getLogger(__name__)


def mapped_files() -> set[str]:
    """Every /dev/shm path some process we can see maps (its /proc/PID/maps), deleted ones aside."""
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(SHM + "/"):
                        mapped.add(parts[5].rstrip("\n"))
        except OSError:  # gone meanwhile, or not ours to read (nor then to map our 0600 files)
            continue
    return mapped


def listening_ports() -> set[int]:
    """Local TCP ports some process listens on (any user's: /proc/net/tcp lists them all)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def local_buffer_port(path: str) -> int | None:
    """The master port a DeepSpeed all-reduce buffer's name carries, when its master is this machine
    (only there does the job listen on it); None for another file or another node's master."""
    found = BUFFER_NAME.match(os.path.basename(path))
    if not found:
        return None
    address = _address(found.group(1))
    local = address is not None and (address.startswith("127.") or address == _address(socket.gethostname()))
    return int(found.group(2)) if local else None


@functools.lru_cache(maxsize=None)
def _address(host: str) -> str | None:
    """One lookup per name and process: every rank's start-up runs this, and a slow resolver must not
    be asked once per file."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def stale_files(patterns=PATTERNS, min_age_s: float = MIN_AGE_S) -> list[str]:
    candidates = [p for pattern in patterns for p in glob.glob(os.path.join(SHM, pattern))]
    if not candidates:
        return []
    uid, now, mapped, listening = os.getuid(), time.time(), mapped_files(), listening_ports()
    stale = []
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != uid or path in mapped:
            continue
        port = local_buffer_port(path)
        if (port is not None and port not in listening) or now - st.st_mtime > min_age_s:
            stale.append(path)
    return sorted(stale)


def remove_stale(patterns=PATTERNS, min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove the stale files; the ones removed, said in one log line."""
    removed = []
    for path in stale_files(patterns, min_age_s):
        try:
            size = os.path.getsize(path)
            os.unlink(path)
            removed.append((path, size))
        except OSError:
            continue
    if removed:
        log.warning(
            "removed %d stale shared-memory file(s) left by killed processes (%.0f MiB): %s%s",
            len(removed),
            sum(s for _, s in removed) / 2**20,
            ", ".join(p for p, _ in removed[:4]),
            " ..." if len(removed) > 4 else "",
        )
    return [p for p, _ in removed]
