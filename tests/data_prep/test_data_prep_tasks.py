"""data_prep as a Slurm array job: task partitioning, re-runs, killed tasks, finalize, verify, and errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, shard_argv
from data_prep.cli import main
from data_prep.common.manifest import load_manifest
from data_prep.common.shards import iter_blocks
from data_prep.errors import DataPrepError
from data_prep.finalize import finalize
from data_prep.reader import resolve_inputs, resolve_partition
from data_prep.settings import ShardSettings, load_settings_file
from data_prep.shard import run_shard
from data_prep.verify import verify, verify_report


def settings(inputs, tokenizer, out, **kw) -> ShardSettings:
    kw.setdefault("num_tasks", 1)
    kw.setdefault("task_index", 0)
    return ShardSettings(inputs=[str(i) for i in inputs], tokenizer=str(tokenizer), out=str(out), **kw)


def run_tasks(inputs, tokenizer, out, num_tasks, **kw) -> Path:
    for i in range(num_tasks):
        run_shard(settings(inputs, tokenizer, out, num_tasks=num_tasks, task_index=i, **kw))
    finalize(out)
    return Path(out)


def files_digest(out: Path) -> dict[str, str]:
    from data_prep.common.shards import sha256_file

    return {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}


GROUP_CHARS = 60_000  # 2 to 3 packing groups per file of the sample corpus
BUNDLED_PAIRS = 130_000  # the sample corpus's files read in pairs, 2 packing groups each


@pytest.fixture(scope="module")
def single(tmp_path_factory, wiki_txt_dir, bert_uncased_dir):
    return run_tasks(
        [wiki_txt_dir],
        bert_uncased_dir,
        tmp_path_factory.mktemp("single") / "out",
        1,
        shard_size=256,
        validation_fraction=0.1,
        seed=7,
        group_chars=GROUP_CHARS,
    )


def tar_digests(out: Path) -> dict[str, str]:
    from data_prep.common.shards import sha256_file

    return {p.name: sha256_file(p) for p in sorted(out.glob("*.tar"))}


@pytest.mark.parametrize("partition", ["files", "documents"])
def test_any_number_of_tasks_writes_the_same_shards(tmp_path, single, wiki_txt_dir, bert_uncased_dir, partition):
    """The dataset is a function of (input, tokenizer, settings): 3 tasks write the very files 1 task writes."""
    out = run_tasks(
        [wiki_txt_dir],
        bert_uncased_dir,
        tmp_path / "out",
        3,
        shard_size=256,
        validation_fraction=0.1,
        seed=7,
        partition=partition,
        group_chars=GROUP_CHARS,
    )
    m, one = load_manifest(out), load_manifest(single)
    assert m.num_tasks == 3 and one.num_tasks == 1
    # byte for byte: the same shard files, listed in the same order with the same counts
    assert tar_digests(out) == tar_digests(single) and len(tar_digests(out)) >= 12
    assert m.shards == one.shards and m.totals == one.totals
    # each task did a disjoint, non-empty part of the work: its own packing groups
    tasks = [json.loads((out / f"task-{i:05d}.json").read_text()) for i in range(3)]
    owned = [tuple(g) for t in tasks for g in t["groups"]]
    assert all(t["groups"] for t in tasks) and len(owned) == len(set(owned)) == len(
        {(e.source, e.group) for e in one.shards}
    )
    assert sorted(e["name"] for t in tasks for e in t["shards"]) == sorted(e.name for e in one.shards)
    sources = resolve_inputs([str(wiki_txt_dir)])
    assert resolve_partition(partition, len(sources), 3) == partition
    # each group pads at most its own last sequence per split
    for source, group in owned:
        for split in ("train", "validation"):
            padded = [e.padding > 0 for e in m.shards_of(split) if (e.source, e.group) == (source, group)]
            assert sum(padded) <= 1 and (not any(padded) or padded[-1])


def test_task_count_does_not_change_the_dataset_through_the_cli(tmp_path, bert_uncased_dir, wiki_articles):
    """One big file, as the documents partition is made for: 1, 2 and 5 tasks give identical shards."""
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": text}) + "\n" for _, text in wiki_articles[:1500]))
    digests = {}
    for k in (1, 2, 5):
        out = tmp_path / f"k{k}"
        for i in range(k):
            assert (
                main(
                    shard_argv(
                        big,
                        bert_uncased_dir,
                        out,
                        num_tasks=k,
                        task_index=i,
                        group_chars=100000,
                        shard_size=200,
                        validation_fraction=0.05,
                        seq_len=64,
                    )
                )
                == 0
            )
        assert main(["finalize", str(out)]) == 0
        digests[k] = tar_digests(out)
        assert load_manifest(out).shards == load_manifest(tmp_path / "k1").shards
    assert len(digests[1]) >= 10 and digests[1] == digests[2] == digests[5]


@pytest.mark.slow
def test_concurrent_array_tasks_share_one_output_folder(tmp_path, single, wiki_txt_dir, bert_uncased_dir):
    """Three tasks started at once, as Slurm does: they race to install the tokenizer copy."""
    out = tmp_path / "out"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "data_prep",
                *shard_argv(
                    wiki_txt_dir,
                    bert_uncased_dir,
                    out,
                    shard_size=256,
                    validation_fraction=0.1,
                    seed=7,
                    group_chars=GROUP_CHARS,
                ),
            ],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": str(i)},
        )
        for i in range(3)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "finalize", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert verify(out) == [] and tar_digests(out) == tar_digests(single)
    assert sorted(p.name for p in out.iterdir() if not p.suffix == ".tar") == [
        "manifest.json",
        "task-00000.json",
        "task-00001.json",
        "task-00002.json",
        "tokenizer",
    ]


def test_rerun_is_idempotent_and_refuses_other_settings(tmp_path, wiki_txt_dir, bert_uncased_dir):
    s = settings([wiki_txt_dir], bert_uncased_dir, tmp_path / "out", shard_size=300)
    first = run_shard(s)
    finalize(tmp_path / "out")
    before = files_digest(tmp_path / "out")
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.tar")}
    again = run_shard(s)
    assert not first.skipped and again.skipped and again.shards_written == 0
    finalize(tmp_path / "out")
    assert files_digest(tmp_path / "out") == before  # manifest.json too: finalize is deterministic
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.tar")} == mtimes
    with pytest.raises(DataPrepError, match=r"task-00000.json: .*different settings .*seq_len: 128 then, 64 now"):
        run_shard(settings([wiki_txt_dir], bert_uncased_dir, tmp_path / "out", shard_size=300, seq_len=64))


def test_task_manifest_and_last_shard_lost_then_rerun_gives_same_bytes(tmp_path, wiki_txt_dir, bert_uncased_dir):
    """The remains of a kill without sidecars: no task manifest, the last shard gone, a .tmp left behind."""
    kw = dict(shard_size=64, validation_fraction=0.15, seed=3)
    out = tmp_path / "out"
    run_shard(settings([wiki_txt_dir], bert_uncased_dir, out, **kw))
    expected = files_digest(out)
    m = json.loads((out / "task-00000.json").read_text())
    (out / "task-00000.json").unlink()
    (out / m["shards"][-1]["name"]).unlink()
    (out / (m["shards"][-1]["name"] + ".tmp")).write_bytes(b"half a shard")
    result = run_shard(settings([wiki_txt_dir], bert_uncased_dir, out, **kw))
    assert not result.skipped and result.shards_reused == 0
    assert files_digest(out) == expected and not list(out.glob("*.tmp"))


@pytest.mark.slow
def test_kill_after_first_shards_then_rerun_reuses_them(tmp_path, wiki_txt_dir, bert_uncased_dir):
    kw = dict(shard_size=64, validation_fraction=0.15, seed=3, batch_chars=20_000, group_chars=BUNDLED_PAIRS)
    whole = tmp_path / "whole"
    full = run_shard(settings([wiki_txt_dir], bert_uncased_dir, whole, **kw))
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "data_prep",
            *shard_argv(
                wiki_txt_dir,
                bert_uncased_dir,
                out,
                num_tasks=1,
                task_index=0,
                shard_size=64,
                validation_fraction=0.15,
                seed=3,
                batch_chars=20000,
                group_chars=BUNDLED_PAIRS,
            ),
        ],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    sidecar = out / ".progress-t00000" / "train-s00000-g00000-00002.tar.json"
    deadline = time.time() + 120
    while not sidecar.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "task-00000.json").exists(), "finished before the kill"
    # what a kill can leave: a half-written shard
    (out / "train-s00001-g00000-00099.tar.tmp").write_bytes(b"half a shard")
    result = run_shard(settings([wiki_txt_dir], bert_uncased_dir, out, **kw))
    assert result.shards_reused >= 3 and result.tokens < full.tokens
    assert files_digest(out) == files_digest(whole)
    assert not list(out.glob("*.tmp")) and not (out / ".progress-t00000").exists()


def test_resume_from_sidecars_with_a_corrupt_shard_rewrites_from_there(tmp_path, wiki_txt_dir, bert_uncased_dir):
    """Interrupted while writing its 7th shard; then one of the finished shards is corrupted."""
    kw = dict(shard_size=64, validation_fraction=0.15, seed=3, batch_chars=20_000, group_chars=BUNDLED_PAIRS)
    whole = tmp_path / "whole"
    run_shard(settings([wiki_txt_dir], bert_uncased_dir, whole, **kw))
    expected = files_digest(whole)
    import data_prep.group_writer as shard_mod

    calls = {"n": 0}
    original = shard_mod.SplitWriter._write

    def failing_write(self, packed):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt  # as if killed while writing the 7th shard
        original(self, packed)

    shard_mod.SplitWriter._write = failing_write
    try:
        with pytest.raises(KeyboardInterrupt):
            run_shard(settings([wiki_txt_dir], bert_uncased_dir, tmp_path / "interrupted", **kw))
    finally:
        shard_mod.SplitWriter._write = original
    interrupted = tmp_path / "interrupted"
    sidecars = sorted(p.name for p in (interrupted / ".progress-t00000").glob("*.tar.json"))
    assert len(sidecars) == 6 and not (interrupted / "task-00000.json").exists()
    assert list((interrupted / ".progress-t00000").glob("group-*.json"))  # at least one group was complete
    assert not list(interrupted.glob("*.tmp"))  # ShardWriter.abort removed the half-written shard
    # flip a byte in the third kept train shard of the first, complete group: it and everything after
    # it in its group's split is redone; the group's validation shards and the other groups' are kept
    name = "train-s00000-g00000-00002.tar"
    data = bytearray((interrupted / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (interrupted / name).write_bytes(bytes(data))
    result = run_shard(settings([wiki_txt_dir], bert_uncased_dir, interrupted, **kw))
    assert 2 <= result.shards_reused < 6
    assert files_digest(interrupted) == expected


@pytest.mark.slow
def test_verify_names_every_bad_shard(tmp_path, wiki_txt_dir, bert_uncased_dir):
    out = run_tasks([wiki_txt_dir], bert_uncased_dir, tmp_path / "out", 1, shard_size=128)
    assert verify(out) == []
    names = [e.name for e in load_manifest(out).shards]
    assert len(names) >= 4
    truncated, flipped, missing = names[0], names[1], names[2]
    data = (out / truncated).read_bytes()
    (out / truncated).write_bytes(data[: len(data) - 5000])
    data = bytearray((out / flipped).read_bytes())
    data[3000] ^= 0x01
    (out / flipped).write_bytes(bytes(data))
    (out / missing).unlink()
    problems = verify(out)
    assert len(problems) == 3
    assert any(p.startswith(f"{truncated}:") and "bytes" in p for p in problems)
    assert any(p.startswith(f"{flipped}:") and "sha256" in p for p in problems)
    assert any(p.startswith(f"{missing}:") and "missing" in p for p in problems)
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "verify", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2  # bad input: the trainer refuses these shards too
    assert all(n in proc.stderr for n in (truncated, flipped, missing)) and names[3] not in proc.stderr


def _rewrite_shard(out: Path, name: str, edit) -> None:
    """Rewrite a shard through ``edit(block_index, ids)`` and record its new size and sha256 in the
    manifest, as a buggy writer or a shard written with another tokenizer would leave it."""
    from data_prep.common.atomic import write_json_atomic
    from data_prep.common.shards import ShardWriter

    m = load_manifest(out).to_dict()  # edited and written back as JSON
    blocks = list(iter_blocks(out / name, m["seq_len"]))
    writer = ShardWriter(out / name, m["tokenizer"]["vocab_size"])
    for b, (ids, starts) in enumerate(blocks):
        edit(b, ids)
        writer.write_block(ids, starts)
    digest = writer.close()
    entry = next(e for e in m["shards"] if e["name"] == name)
    entry.update(
        sha256=digest,
        bytes=(out / name).stat().st_size,
        block_offsets=writer.block_offsets,
        block_crc32=writer.block_crc32,
    )
    write_json_atomic(out / "manifest.json", m)


@pytest.mark.slow
def test_verify_checks_ids_and_vocab_size_against_the_tokenizer(tmp_path, wiki_txt_dir, bert_uncased_dir):
    out = run_tasks([wiki_txt_dir], bert_uncased_dir, tmp_path / "out", 1, shard_size=128, block_size=32, seq_len=64)
    assert verify(out) == []
    names = [e.name for e in load_manifest(out).shards]

    def put_bad_id(block, ids):
        if block == 1:
            ids[3, 7] = 30522  # the first id past bert-base-uncased's vocabulary; uint16 holds it
            ids[5, 0] = 40000

    _rewrite_shard(out, names[2], put_bad_id)
    report = verify_report(out)
    assert report.damaged == [] and len(report.mismatched) == 1, report
    assert report.mismatched[0] == (
        f"{names[2]}: block 1, sequence 3, position 7: token id 30522 is outside the "
        "tokenizer's vocabulary of 30522 (2 such id(s) in this shard)"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "verify", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{names[2]}: block 1, sequence 3" in proc.stderr and names[3] not in proc.stderr

    # a manifest whose vocab_size was edited: named, with both numbers, exit 2
    m = load_manifest(out).to_dict()
    m["tokenizer"]["vocab_size"] = 30000
    (out / "manifest.json").write_text(json.dumps(m))
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "verify", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"{out / 'manifest.json'}: vocab_size 30000, but the tokenizer in {out / 'tokenizer'} has 30522 tokens"
        in proc.stderr
    )
    # a manifest that lost a key the checks need: a message, not a KeyError
    del m["tokenizer"]["special_ids"]
    (out / "manifest.json").write_text(json.dumps(m))
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "verify", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "tokenizer.special_ids: missing" in proc.stderr and "Traceback" not in proc.stderr


def test_finalize_refuses_missing_and_mismatched_tasks(tmp_path, wiki_txt_dir, bert_uncased_dir):
    out = tmp_path / "out"
    for i in (0, 2):
        run_shard(settings([wiki_txt_dir], bert_uncased_dir, out, num_tasks=4, task_index=i, shard_size=256))
    with pytest.raises(DataPrepError, match=r"missing task indices: 1, 3"):
        finalize(out)
    assert not (out / "manifest.json").exists()
    # task 1 made with another seed cannot join the others
    run_shard(settings([wiki_txt_dir], bert_uncased_dir, out, num_tasks=4, task_index=1, shard_size=256, seed=9))
    with pytest.raises(DataPrepError, match=r"task-00001.json: settings differ .*seed: 9 vs 0"):
        finalize(out)


def test_slurm_array_variables_pick_the_task():
    s = ShardSettings(inputs=["x"], tokenizer="t", out="o")
    r = s.resolved({"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "2"})
    assert (r.num_tasks, r.task_index) == (4, 2)
    r = s.resolved({"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1"})
    assert (r.num_tasks, r.task_index) == (4, 3)
    assert (s.resolved({}).num_tasks, s.resolved({}).task_index) == (1, 0)
    with pytest.raises(DataPrepError, match=r"task index 4 \(from \$SLURM_ARRAY_TASK_ID=4\) is out of range for 4"):
        s.resolved({"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "4"})


def test_shipped_data_configs_load_and_run(tmp_path, wiki_txt_dir, bert_uncased_dir):
    files = sorted((REPO / "configs" / "data").glob("*.yaml"))
    assert files
    for f in files:
        values = load_settings_file(f)
        ShardSettings(**{**values, "inputs": ["x"], "tokenizer": "t", "out": "o"}).resolved({})
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_len: 128\nshard_sise: 3\nseed: one\n")
    with pytest.raises(DataPrepError, match=r"shard_sise: unknown setting(.|\n)*seed: expected int"):
        load_settings_file(bad)
    out = tmp_path / "out"
    code = main(shard_argv(wiki_txt_dir, bert_uncased_dir, out, config=files[0], seq_len=64, num_tasks=1, task_index=0))
    assert code == 0
    m = json.loads((out / "task-00000.json").read_text())
    assert m["seq_len"] == 64 and m["settings"]["shard_size"] == load_settings_file(files[0])["shard_size"]


@pytest.mark.slow
def test_worker_processes_write_the_same_bytes(tmp_path, wiki_txt_dir, bert_uncased_dir):
    common = shard_argv(wiki_txt_dir, bert_uncased_dir, num_tasks=1, task_index=0, shard_size=256, batch_chars=50000)
    for workers in (1, 2):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "data_prep",
                *common,
                "--out",
                str(tmp_path / f"w{workers}"),
                "--workers",
                str(workers),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
    assert files_digest(tmp_path / "w1") == files_digest(tmp_path / "w2")


# ----------------------------------------------------------------------------------------------
# Errors: a clear message naming the file/line/task, exit code 2


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("data_prep: error: ")
    return err


def test_errors_name_the_file_line_or_task(tmp_path, capsys, bert_uncased_dir):
    tok = str(bert_uncased_dir)
    base = ["shard", "--tokenizer", tok, "--out", str(tmp_path / "out"), "--num-tasks", "1", "--task-index", "0"]

    (tmp_path / "empty.txt").write_text("\n\n  \n")
    err = _error(capsys, base + ["--input", str(tmp_path / "empty.txt")])
    assert f"empty input: task 0 of 1 found no documents in {tmp_path / 'empty.txt'}" in err
    assert "'nowhere/*.txt' matches no files" in _error(capsys, base + ["--input", "nowhere/*.txt"])
    assert "no such file" in _error(capsys, base + ["--input", str(tmp_path / "absent.txt")])

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("first line\n\nsecond doc\ncaf\xe9 au lait\n".encode("latin-1"))
    err = _error(capsys, base + ["--input", str(bad)])
    assert f"{bad}: line 4 (byte offset 26): not valid UTF-8" in err

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"body": "no text here"}\n')
    assert f"{jsonl}: line 3: no 'text' field (has: body)" in _error(capsys, base + ["--input", str(jsonl)])

    ok = tmp_path / "ok.txt"
    ok.write_text("A real sentence.\n")
    assert "--seq-len 2 is too small" in _error(capsys, base + ["--input", str(ok), "--seq-len", "2"])
    assert "--task-index 5 is out of range for 2 task(s)" in _error(
        capsys,
        shard_argv(ok, tok, tmp_path / "o", num_tasks=2, task_index=5),
    )

    no_mask = tmp_path / "no_mask_tok"
    _tokenizer_without_mask(no_mask)
    assert f"{no_mask}: tokenizer has no [MASK] token (mask)" in _error(
        capsys, ["shard", "--tokenizer", str(no_mask), "--out", str(tmp_path / "o2"), "--input", str(ok)]
    )
    assert "has no tokenizer.json" in _error(
        capsys, ["shard", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o3"), "--input", str(ok)]
    )


def test_damaged_gzip_input_is_named_with_advice_that_fits(tmp_path, capsys, wiki_txt_dir, bert_uncased_dir):
    import gzip

    good = gzip.compress((wiki_txt_dir / "wiki-00.txt").read_bytes())
    cases = {"truncated.txt.gz": (good[: len(good) // 2], "truncated gzip file")}
    # bytes flipped in the middle decompress to garbage that fails UTF-8 decoding long before the
    # checksum at the end; flipped near the end they fail the checksum; both are damage, not encoding
    for where in (len(good) // 3, len(good) - 20):
        damaged = bytearray(good)
        for k in range(4):
            damaged[where + k] ^= 0x5A
        cases[f"damaged-{where}.txt.gz"] = (bytes(damaged), "corrupt gzip data")
    cases["plain.txt.gz"] = ((wiki_txt_dir / "wiki-00.txt").read_bytes(), "not a gzip file")
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        for argv in (
            shard_argv(path, bert_uncased_dir, tmp_path / f"out-{name}"),
            ["tokenizer", "--input", str(path), "--out", str(tmp_path / f"tok-{name}"), "--vocab-size", "200"],
        ):
            err = _error(capsys, argv)
            assert f"{path}: {message}" in err and "UTF-8" not in err, (argv, err)
    # a sound gzip of text in another encoding still gets the encoding advice
    latin = tmp_path / "latin1.txt.gz"
    latin.write_bytes(gzip.compress("first line\n\nsecond doc\ncaf\xe9 au lait\n".encode("latin-1")))
    err = _error(
        capsys,
        ["shard", "--tokenizer", str(bert_uncased_dir), "--out", str(tmp_path / "o-latin"), "--input", str(latin)],
    )
    assert f"{latin}: line 4 (byte offset 26): not valid UTF-8" in err and "convert the file to UTF-8" in err


def test_tokenizer_empty_input_names_the_files(tmp_path, capsys):
    empty = tmp_path / "blank.txt"
    empty.write_text("\n   \n\n")
    err = _error(capsys, ["tokenizer", "--input", str(empty), "--out", str(tmp_path / "tok"), "--vocab-size", "100"])
    assert f"empty input: no documents to train the tokenizer on in {empty}" in err


def _tokenizer_without_mask(folder: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(["some words to learn from"] * 3, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.slow
def test_finalize_error_through_the_real_entry_point(tmp_path, wiki_txt_dir, bert_uncased_dir):
    out = tmp_path / "out"
    run_shard(settings([wiki_txt_dir], bert_uncased_dir, out, num_tasks=3, task_index=1))
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "finalize", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "incomplete: 2 of 3 tasks have no task manifest (missing task indices: 0, 2)" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", *shard_argv(wiki_txt_dir, bert_uncased_dir, out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": "7"},
    )
    assert proc.returncode == 2 and "task index 7" in proc.stderr and "out of range for 3" in proc.stderr


def test_an_input_edited_without_changing_its_size_is_not_taken_for_the_old_one(
    tmp_path, wiki_txt_dir, bert_uncased_dir
):
    """Inputs were identified by path and size: an edit that kept the size answered "exists with the
    same settings, nothing to do" and kept shards of the old text. Now by content: a touched but
    unchanged input is still skipped, an edited one refused naming it, and a task written before
    fingerprints is still skipped when its inputs' paths and sizes are unchanged."""
    from data_prep.errors import DataPrepError
    from data_prep.settings import settings_sha256

    inputs = tmp_path / "in"
    shutil.copytree(wiki_txt_dir, inputs)
    out = tmp_path / "out"
    first = run_shard(settings([inputs], bert_uncased_dir, out, shard_size=256))
    assert not first.skipped
    victim = sorted(inputs.glob("*.txt"))[0]
    os.utime(victim, (1, 1))  # touched: same content
    assert run_shard(settings([inputs], bert_uncased_dir, out, shard_size=256)).skipped
    text = victim.read_text()
    victim.write_text(text.replace("the", "teh", 1))  # same size, other words
    assert victim.stat().st_size == len(text.encode())
    with pytest.raises(DataPrepError, match=rf"different settings \(inputs changed since: {victim}\)"):
        run_shard(settings([inputs], bert_uncased_dir, out, shard_size=256))
    victim.write_text(text)
    task = out / "task-00000.json"  # as written before fingerprints
    raw = json.loads(task.read_text())
    for src in raw["settings"]["sources"]:
        del src["fingerprint"]
    raw["settings_sha256"] = settings_sha256(raw["settings"])
    task.write_text(json.dumps(raw))
    assert run_shard(settings([inputs], bert_uncased_dir, out, shard_size=256)).skipped


@pytest.mark.slow
def test_a_second_run_of_a_task_while_the_first_writes_is_refused_naming_it(
    tmp_path, wiki_txt_dir, bert_uncased_dir, capsys
):
    """Issue 81, item 6: two ``data_prep shard`` runs with other settings into one --out at once both
    exited 0, one silently replacing the other's shards. The first holds its task's lock; the second
    is exit 2 naming it, and writes nothing; once the first is gone, the task runs."""
    from data_prep.cli import main
    from data_prep.shard import progress_dir_name

    out = tmp_path / "out"
    lock = out / progress_dir_name(0) / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(  # a first run, mid-task: its lock held, its pid written
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'pid {os.getpid()} on testhost'.encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["shard", "--input", str(wiki_txt_dir), "--tokenizer", str(bert_uncased_dir), "--out", str(out)]
        assert main([*argv, "--seq-len", "64"]) == 2
        err = capsys.readouterr().err
        assert f"task 0 is being written by pid {holder.pid} on testhost ({lock})" in err, err
        assert not list(out.glob("*.tar")) and not list(out.glob("task-*.json"))
    finally:
        holder.kill()
        holder.wait()
    assert main([*argv, "--seq-len", "64"]) == 0 and list(out.glob("task-*.json"))
