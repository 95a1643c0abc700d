"""``manifest.json`` as every reader gets it: ``data_prep.common.manifest.Manifest``, checked once at load.

A real finalized manifest comes back byte for byte through ``Manifest.from_dict(...).to_dict()``, so
the typed form is the on-disk format; a manifest that lost or mistyped a key is refused with a message
naming the key, by ``load_manifest`` and by the commands that read it (exit 2, no traceback)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import train
from data_prep.common.atomic import write_json_atomic
from data_prep.common.errors import ShardError
from data_prep.common.manifest import MANIFEST, Manifest, load_manifest
from data_prep.finalize import finalize
from data_prep.settings import ShardSettings
from data_prep.shard import run_shard

REPO = Path(__file__).resolve().parents[2]
TASKS = 2


@pytest.fixture(scope="module")
def finalized(tmp_path_factory, wiki_txt_dir, bert_uncased_dir) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "shards"
    for task in range(TASKS):
        run_shard(
            ShardSettings(
                inputs=[str(wiki_txt_dir)],
                tokenizer=str(bert_uncased_dir),
                out=str(out),
                seq_len=64,
                shard_size=256,
                block_size=64,
                group_chars=100_000,
                validation_fraction=0.05,
                num_tasks=TASKS,
                task_index=task,
            )
        )
    finalize(out)
    return out


def test_a_finalized_manifest_round_trips_byte_for_byte(finalized, tmp_path):
    text = (finalized / MANIFEST).read_text()
    manifest = Manifest.from_dict(json.loads(text))
    write_json_atomic(tmp_path / MANIFEST, manifest.to_dict())  # as finalize writes it
    assert (tmp_path / MANIFEST).read_bytes() == (finalized / MANIFEST).read_bytes()
    assert load_manifest(finalized) == manifest
    # The format finalize has always written: these keys in this order, and the tokenizer and shard
    # entries exactly as the task manifests hold them, key for key.
    raw = json.loads(text)
    assert list(raw) == [
        "format_version",
        "seq_len",
        "block_size",
        "dtype",
        "tokenizer",
        "num_tasks",
        "shards",
        "totals",
        "settings",
    ]
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


NAMED = (
    "seq_len: missing",
    "block_size: not an integer ('64')",
    "tokenizer.vocab_size: missing",
    "shards[1].sha256: not a string (None)",
)


def test_a_missing_or_mistyped_key_is_named(finalized, tmp_path):
    bad = write_broken(tmp_path / "bad", finalized)
    with pytest.raises(ShardError) as err:
        load_manifest(bad)
    assert str(err.value).startswith(f"{bad / MANIFEST}: not a data_prep manifest:\n  ")
    assert all(needle in str(err.value) for needle in NAMED), err.value
    with pytest.raises(ShardError, match="format_version 2, this code reads 1"):
        Manifest.from_dict({**load_manifest(finalized).to_dict(), "format_version": 2})


@pytest.mark.slow
def test_the_trainer_and_data_prep_refuse_it_with_exit_2(finalized, tmp_path):
    bad = write_broken(tmp_path / "bad", finalized)
    trained = train(bad, tmp_path / "run", "train.max_steps=1")
    inspected = subprocess.run(
        [sys.executable, "-m", "data_prep", "inspect", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    for proc in (trained, inspected):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert all(needle in proc.stderr for needle in NAMED), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_block_offsets_are_recorded_checked_and_filled_in_for_older_task_manifests(finalized, tmp_path):
    """Each shard entry holds its blocks' byte offsets, as the tar headers say (issue 34): one read
    fetches a block. An older task manifest without them is finalized by a scan; offsets that
    disagree with the headers are refused at load (malformed) or by verify (shard named)."""
    from data_prep.common.shards import index_shard, iter_blocks, parse_block
    from data_prep.verify import verify

    manifest = load_manifest(finalized)
    for entry in manifest.shards:
        assert (
            list(entry.block_offsets) == index_shard(finalized / entry.name)
            and len(entry.block_offsets) == entry.blocks + 1
        )
    entry = next(e for e in manifest.shards if e.blocks >= 2)
    span = (finalized / entry.name).read_bytes()[entry.block_offsets[1] : entry.block_offsets[2]]
    ids, starts = parse_block(span, manifest.seq_len, "block 1")
    want = list(iter_blocks(finalized / entry.name, manifest.seq_len))[1]
    assert (ids == want[0]).all() and (starts == want[1]).all() and ids.shape == (64, manifest.seq_len)
    with pytest.raises(ShardError, match=r"word_starts.npy' of \d+ bytes runs past the block's \d+ bytes"):
        parse_block(span[:-512], manifest.seq_len, "block 1")
    with pytest.raises(ShardError, match="span"):
        parse_block(span + bytes(512), manifest.seq_len, "block 1")

    older = tmp_path / "older"
    shutil.copytree(finalized, older)
    (older / MANIFEST).unlink()
    for task_file in older.glob("task-*.json"):
        raw = json.loads(task_file.read_text())
        for e in raw["shards"]:
            del e["block_offsets"]
        task_file.write_text(json.dumps(raw))
    assert finalize(older) == manifest

    raw = manifest.to_dict()
    raw["shards"][0]["block_offsets"] = raw["shards"][0]["block_offsets"][::-1]
    with pytest.raises(ShardError, match=r"shards\[0\].block_offsets: not \d+ increasing byte offsets"):
        Manifest.from_dict(raw)
    raw = manifest.to_dict()
    edited = next(e for e in raw["shards"] if e["blocks"] >= 2)
    edited["block_offsets"][1] += 512
    write_json_atomic(older / MANIFEST, raw)
    problems = verify(older)
    assert len(problems) == 1 and problems[0].startswith(f"{edited['name']}: block_offsets differ from its tar headers")


def test_finalize_adds_block_checksums_to_shards_written_before_them(finalized, tmp_path):
    """Task manifests from before ``block_crc32``: finalize computes it from each shard's bytes, once
    the shard is checked against its recorded sha256 (a shard changed since must not be blessed)."""
    copy = tmp_path / "shards"
    shutil.copytree(finalized, copy)
    wanted = {e.name: e.block_crc32 for e in load_manifest(finalized).shards}
    assert all(crcs and len(crcs) == e.blocks for e, crcs in zip(load_manifest(finalized).shards, wanted.values()))

    def strip_checksums():
        for task in copy.glob("task-*.json"):
            raw = json.loads(task.read_text())
            for entry in raw["shards"]:
                entry.pop("block_crc32", None)
            write_json_atomic(task, raw)
        (copy / MANIFEST).unlink(missing_ok=True)

    strip_checksums()
    assert {e.name: e.block_crc32 for e in finalize(copy).shards} == wanted
    victim = copy / next(iter(wanted))
    data = bytearray(victim.read_bytes())
    data[-2048] ^= 1
    victim.write_bytes(bytes(data))
    strip_checksums()
    with pytest.raises(Exception, match=rf"{victim.name}: its sha256 is not its task manifest's"):
        finalize(copy)


def test_verify_checks_the_recorded_block_checksums(finalized, tmp_path):
    from data_prep.verify import verify

    copy = tmp_path / "shards"
    shutil.copytree(finalized, copy)
    assert verify(copy) == []
    raw = json.loads((copy / MANIFEST).read_text())
    raw["shards"][0]["block_crc32"][0] ^= 1
    write_json_atomic(copy / MANIFEST, raw)
    (problem,) = verify(copy)
    assert (
        problem
        == f"{raw['shards'][0]['name']}: block 0's CRC-32 differs from the manifest's block_crc32 (manifest edited)"
    )
