"""Waits on the checkpoint mirror say how far along they are (pretrain.checkpoint.mirror): a run's end
waiting for its uploads, and a resume downloading a checkpoint, each every ``PROGRESS_S`` with the MiB
left or done of the total, the rate and the time left. A real folder mirror, each file's transfer slowed
to make the wait long enough to be reported."""

from __future__ import annotations

import logging
import re
import time

import pytest

from data_prep.common.storage import local_store
from pretrain.checkpoint import mirror, nodes
from pretrain.checkpoint.checkpointing import write_file_list
from pretrain.checkpoint.files import COMPLETE, LAYOUT_FILE

FILES, SIZE = 6, 1 << 20  # a checkpoint of six 1 MiB shards
PAUSE = 0.08  # each file's transfer


def checkpoint(root, tag: str = "step00000002"):
    folder = root / tag
    folder.mkdir(parents=True)
    for i in range(FILES):
        (folder / f"shard{i}.pt").write_bytes(bytes([i]) * SIZE)
    (folder / LAYOUT_FILE).write_text('{"world": 1, "zero_stage": 1}\n')
    write_file_list(folder)
    (folder / COMPLETE).write_text('{"step": 2}\n')
    return folder


@pytest.fixture
def slow(monkeypatch):
    """Every file the folder store puts or fetches takes ``PAUSE`` more; lines every 0.05 s."""
    monkeypatch.setattr(mirror, "PROGRESS_S", 0.05)
    put, download = local_store.LocalStore.put_file, local_store.LocalStore.download

    def slow_put(self, *args, **kwargs):
        time.sleep(PAUSE)
        return put(self, *args, **kwargs)

    def slow_download(self, *args, **kwargs):
        time.sleep(PAUSE)
        return download(self, *args, **kwargs)

    monkeypatch.setattr(local_store.LocalStore, "put_file", slow_put)
    monkeypatch.setattr(local_store.LocalStore, "download", slow_download)


def mirrored(tmp_path) -> None:
    """The checkpoint uploaded to ``tmp_path/bucket``, waited for."""
    uploads = mirror.CheckpointMirror(str(tmp_path / "bucket"), keep=2, nodes=nodes.single())
    uploads.upload(checkpoint(tmp_path / "run"))
    assert uploads.wait() is None  # the checkpoint is in the mirror
    assert (tmp_path / "bucket" / "step00000002" / COMPLETE).is_file()


def parsed(said: list[str], pattern: str, at_least: int) -> list[re.Match]:
    """Every line said, each matching ``pattern`` whole; at least ``at_least`` of them."""
    found = [re.fullmatch(pattern, line) for line in said]
    assert len(said) >= at_least and all(found), said
    return found


def test_a_run_that_waits_for_its_uploads_says_what_is_left_the_rate_and_the_time_left(tmp_path, slow, caplog):
    caplog.set_level(logging.INFO, logger="pretrain")
    mirrored(tmp_path)
    said = [r.getMessage() for r in caplog.records if "waiting for the uploads" in r.getMessage()]
    lines = parsed(
        said,
        r"checkpoint mirror: waiting for the uploads to \S+ \(step00000002\): ([\d.]+) MiB left, ([\d.]+) MiB sent "
        r"in \d+ s \(([\d.]+) MiB/s\), (about \d+m\d\ds left|under 1 MiB sent in the wait: no rate yet)",
        at_least=3,
    )
    left = [float(m.group(1)) for m in lines]
    sent = [float(m.group(2)) for m in lines]
    # six shards of 1 MiB, each put whole: what is left falls as what is sent rises, by whole shards
    assert all(a >= b for a, b in zip(left, left[1:])) and left[0] > left[-1], left
    assert all(abs(a + b - FILES) < 0.15 for a, b in zip(left, sent)), (left, sent)  # the lists are small


def test_a_resume_that_downloads_a_checkpoint_says_how_much_of_it_is_in(tmp_path, slow, capsys):
    mirrored(tmp_path)
    capsys.readouterr()
    fetched = mirror.fetch_newer(str(tmp_path / "bucket"), tmp_path / "requeued")
    assert fetched == "step00000002" and (tmp_path / "requeued" / "step00000002" / COMPLETE).is_file()
    said = [line for line in capsys.readouterr().err.splitlines() if "downloading" in line]
    lines = parsed(
        said,
        r"resume: downloading \S+step00000002: ([\d.]+) of ([\d.]+) MiB \((\d+)%, [\d.]+ MiB/s\), "
        r"(about \d+m\d\ds left|no rate yet)",
        at_least=2,
    )
    done = [float(m.group(1)) for m in lines]
    assert all(float(m.group(2)) == pytest.approx(FILES, abs=0.01) for m in lines)  # the shards and their list
    assert done == sorted(done) and done[0] < done[-1] < FILES, done
    assert all(m.group(4) == "no rate yet" for m, d in zip(lines, done) if d < 1)  # no rate from a few bytes
