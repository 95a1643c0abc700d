"""``manifest.json`` as every reader gets it: ``data_prep.shard_format.Manifest``, checked once at load.

A real finalized manifest comes back byte for byte through ``Manifest.from_dict(...).to_dict()``, so
the typed form is the on-disk format; a manifest that lost or mistyped a key is refused with a message
naming the key, by ``load_manifest`` and by the commands that read it (exit 2, no traceback)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import train

from data_prep.atomic import write_json_atomic
from data_prep.finalize import finalize
from data_prep.settings import ShardSettings
from data_prep.shard import run_shard
from data_prep.shard_format import MANIFEST, Manifest, ShardError, load_manifest

REPO = Path(__file__).resolve().parents[1]
TASKS = 2


@pytest.fixture(scope="module")
def finalized(tmp_path_factory, wiki_txt_dir, bert_uncased_dir) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "shards"
    for task in range(TASKS):
        run_shard(ShardSettings(inputs=[str(wiki_txt_dir)], tokenizer=str(bert_uncased_dir), out=str(out),
                                seq_len=64, shard_size=256, group_chars=100_000, validation_fraction=0.05,
                                num_tasks=TASKS, task_index=task))
    finalize(out)
    return out


def test_a_finalized_manifest_round_trips_byte_for_byte(finalized, tmp_path):
    text = (finalized / MANIFEST).read_text()
    manifest = Manifest.from_dict(json.loads(text))
    write_json_atomic(tmp_path / MANIFEST, manifest.to_dict())         # as finalize writes it
    assert (tmp_path / MANIFEST).read_bytes() == (finalized / MANIFEST).read_bytes()
    assert load_manifest(finalized) == manifest
    # The format finalize has always written: these keys in this order, and the tokenizer and shard
    # entries exactly as the task manifests hold them, key for key.
    raw = json.loads(text)
    assert list(raw) == ["format_version", "seq_len", "block_size", "dtype", "tokenizer", "num_tasks", "shards",
                         "totals", "settings"]
    tasks = [json.loads((finalized / f"task-{i:05d}.json").read_text()) for i in range(TASKS)]
    assert json.dumps(raw["tokenizer"]) == json.dumps(tasks[0]["tokenizer"])
    assert sorted(map(json.dumps, raw["shards"])) == sorted(json.dumps(e) for t in tasks for e in t["shards"])
    assert manifest.num_tasks == TASKS and len(manifest.shards) >= 4
    assert manifest.has_split("validation") and manifest.shards[0].source == 0


def write_broken(folder: Path, finalized: Path) -> Path:
    """``finalized``'s manifest less ``seq_len`` and ``tokenizer.vocab_size``, ``block_size`` a string and
    a shard's ``sha256`` null, in ``folder`` (no shards: the manifest is refused before any is read)."""
    raw = load_manifest(finalized).to_dict()
    del raw["seq_len"], raw["tokenizer"]["vocab_size"]
    raw["block_size"] = "64"
    raw["shards"][1]["sha256"] = None
    folder.mkdir()
    write_json_atomic(folder / MANIFEST, raw)
    return folder


NAMED = ("seq_len: missing", "block_size: not an integer ('64')", "tokenizer.vocab_size: missing",
         "shards[1].sha256: not a string (None)")


def test_a_missing_or_mistyped_key_is_named(finalized, tmp_path):
    bad = write_broken(tmp_path / "bad", finalized)
    with pytest.raises(ShardError) as err:
        load_manifest(bad)
    assert str(err.value).startswith(f"{bad / MANIFEST}: not a data_prep manifest:\n  ")
    assert all(needle in str(err.value) for needle in NAMED), err.value
    with pytest.raises(ShardError, match="format_version 2, this code reads 1"):
        Manifest.from_dict({**load_manifest(finalized).to_dict(), "format_version": 2})


def test_the_trainer_and_data_prep_refuse_it_with_exit_2(finalized, tmp_path):
    bad = write_broken(tmp_path / "bad", finalized)
    trained = train(bad, tmp_path / "run", "train.max_steps=1")
    inspected = subprocess.run([sys.executable, "-m", "data_prep", "inspect", str(bad)], cwd=REPO,
                               capture_output=True, text=True, timeout=300)
    for proc in (trained, inspected):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert all(needle in proc.stderr for needle in NAMED), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
