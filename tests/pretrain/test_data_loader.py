"""pretrain.data over real shard tars: hand-made ones (ShardWriter, known bytes) and data_prep's (``shards``)."""

from __future__ import annotations

import dataclasses
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain.data.shard_reader as shard_reader
from conftest import ids_payload
from data_prep.common.atomic import write_json_atomic
from data_prep.common.errors import ShardError
from data_prep.common.manifest import FORMAT_VERSION, Manifest, load_manifest
from data_prep.common.shards import ShardWriter, ids_dtype, index_shard, shard_name
from pretrain.data.stream import (
    DataError,
    TokenIdError,
    TrainStream,
    check_manifest,
    index_all_shards,
)
from pretrain.eval.heldout import eval_set_batches

SEQ_LEN, BLOCK, VOCAB = 16, 64, 30522
UNEVEN = {"train": [1000, 17, 300], "validation": [50, 41]}
TOKENIZER_SHA = "ab" * 32


def write_dataset(
    root: Path,
    splits: dict[str, list[int]],
    vocab: int = VOCAB,
    seed: int = 0,
    poison: tuple[str, int, int] | None = None,
) -> dict:
    """Shards of random sequences plus a hand-written manifest; returns {row bytes: (shard, index, starts)}.
    ``poison`` = (shard name, sequence, token id) writes one out-of-range id there."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    reference, entries = {}, []
    for split, sizes in splits.items():
        for index, n in enumerate(sizes):
            name = shard_name(split, 0, index)
            ids = rng.integers(5, vocab, size=(n, SEQ_LEN))
            ids[:, 0] = 101
            if poison and poison[0] == name:
                ids[poison[1], 5] = poison[2]
            starts = rng.random((n, SEQ_LEN)) < 0.6
            writer = ShardWriter(root / name, max(vocab, poison[2] + 1 if poison else 0))
            for lo in range(0, n, BLOCK):
                writer.write_block(ids[lo : lo + BLOCK], starts[lo : lo + BLOCK])
            sha = writer.close()
            for i in range(n):
                reference[ids[i].astype(np.int64).tobytes()] = (name, i, starts[i])
            entries.append(
                {
                    "name": name,
                    "split": split,
                    "task": 0,
                    "index": index,
                    "sequences": n,
                    "blocks": writer.blocks,
                    "tokens": n * SEQ_LEN,
                    "padding": 0,
                    "bytes": (root / name).stat().st_size,
                    "sha256": sha,
                    "block_offsets": writer.block_offsets,
                    "block_crc32": writer.block_crc32,
                }
            )
    manifest = {
        "format_version": FORMAT_VERSION,
        "seq_len": SEQ_LEN,
        "block_size": BLOCK,
        "dtype": ids_dtype(vocab).name,
        "tokenizer": {
            "path": "tokenizer",
            "sha256": TOKENIZER_SHA,
            "vocab_size": vocab,
            "lowercase": True,
            "special_ids": {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103},
            "special_tokens": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
        },
        "num_tasks": 1,
        "shards": entries,
        "totals": {s: {"shards": len(v), "sequences": sum(v)} for s, v in splits.items()},
        "settings": {},
    }
    write_json_atomic(root / "manifest.json", manifest)
    return reference


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    reference = write_dataset(root, UNEVEN)
    return root, load_manifest(root), reference


def rows_of(batch, reference) -> list[tuple[str, int]]:
    """Identify every row of a batch by content; fails on any row that was never written."""
    out = []
    for ids, starts in zip(batch["input_ids"].numpy(), batch["word_starts"].numpy()):
        name, i, ref_starts = reference[ids.tobytes()]
        assert np.array_equal(starts, ref_starts), f"word_starts of {name}[{i}] differ"
        out.append((name, i))
    return out


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def stream(root, manifest, **kw):
    args = dict(split="train", rank=0, world=1, micro_batch=8, global_batch=32, seed=7, num_workers=0)
    args.update(kw)
    return TrainStream(root, manifest, **args)


def test_batches_decode_to_exactly_the_written_sequences(uneven):
    root, manifest, reference = uneven
    s = stream(root, manifest)  # 1 rank x micro-batch 8 x accumulation 4
    assert s.sequences_in_split == 1317 and s.steps_per_epoch == 1317 // 32 == 41 and s.grad_accum == 4
    assert s.tokens_per_batch == 8 * SEQ_LEN and s.dropped_per_epoch == 1317 - 41 * 32 == 5
    seen, batches = [], iter(s)
    for j in range(41 * 4):
        batch = next(batches)
        assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (8, SEQ_LEN)
        assert batch["word_starts"].dtype == torch.bool and batch["word_starts"].shape == (8, SEQ_LEN)
        assert batch["sample_ids"].dtype == torch.int64 and batch["sample_ids"].shape == (8,)
        assert (batch["global_step"], batch["micro_step"], batch["epoch"]) == (j // 4, j % 4, 0)
        assert batch["has_padding"] is False  # these shards hold no [PAD]
        rows = rows_of(batch, reference)
        assert rows == [s.describe_sample(i) for i in batch["sample_ids"].tolist()]  # ids name the bytes read
        seen += rows
        assert s.samples_consumed == (j + 1) // 4 * 32  # complete steps only
    assert len(set(seen)) == len(seen) == 1312  # one epoch: each sequence at most once
    assert {name for name, _ in seen} == {shard_name("train", 0, i) for i in range(3)}
    assert s.state_dict()["epoch"] == 1 and s.global_step == 41


def test_uint32_ids_for_a_large_vocabulary(tmp_path):
    reference = write_dataset(tmp_path, {"train": [70]}, vocab=70000, seed=3)
    manifest = load_manifest(tmp_path)
    assert manifest.dtype == "uint32"
    batch = take(stream(tmp_path, manifest, micro_batch=4, global_batch=4), 1)[0]
    assert len(rows_of(batch, reference)) == 4
    assert int(max(np.frombuffer(k, dtype=np.int64).max() for k in reference)) > 65535


G, SEED = 32, 5


def run_job(data_dir, manifest, world, micro_batch, steps, state=None, num_workers=0):
    """Every rank of one job for ``steps`` global steps, as the trainer would run them (ranks simulated
    one after another). Returns ({step: sorted sample ids of all ranks}, {sample id: row bytes}, state)."""
    per_step, row_bytes, states = defaultdict(list), {}, []
    for rank in range(world):
        s = TrainStream(data_dir, manifest, "train", rank, world, micro_batch, G, SEED, num_workers)
        if state is not None:
            s.load_state_dict(state)
        for batch in take(s, steps * s.grad_accum):
            assert batch["input_ids"].shape == (micro_batch, 64)
            per_step[batch["global_step"]].append(batch["sample_ids"].numpy())
            for sid, row in zip(batch["sample_ids"].tolist(), batch["input_ids"].numpy()):
                row_bytes[sid] = row.tobytes()
        states.append(s.state_dict())
    assert all(st == {**states[0], "world": world, "micro_batch": micro_batch} for st in states)
    return {k: np.sort(np.concatenate(v)) for k, v in per_step.items()}, row_bytes, states[0]


def test_resume_on_other_world_sizes_and_micro_batches_continues_the_same_samples(shards):
    manifest = load_manifest(shards)
    whole = TrainStream(shards, manifest, "train", 0, 1, G, G, SEED)
    per_epoch = whole.steps_per_epoch
    leg = per_epoch // 2 + 1  # three legs: the second crosses into epoch 1
    reference, reference_rows, _ = run_job(shards, manifest, 1, G, 3 * leg)
    legs, rows, state = {}, {}, None
    for world, micro, workers in ((2, 8, 0), (1, 8, 2), (2, 4, 0)):  # accumulation 2, 4, 4
        got, got_rows, state = run_job(shards, manifest, world, micro, leg, state, workers)
        assert sorted(got) == list(range(len(legs), len(legs) + leg))  # continues at the next step
        assert state["samples_consumed"] == (len(legs) + leg) * G
        legs.update(got)
        rows.update(got_rows)
    assert legs.keys() == reference.keys()
    for k in reference:
        assert np.array_equal(legs[k], reference[k]), f"global step {k} holds other samples"
    assert all(rows[i] == reference_rows[i] for i in reference_rows)  # and the same bytes
    assert state["epoch"] == 3 * leg // per_epoch == 1
    epoch0 = np.concatenate([legs[k] for k in range(per_epoch)])
    assert len(np.unique(epoch0)) == len(epoch0) == whole.sequences_in_split - whole.dropped_per_epoch
    epoch1 = np.concatenate([legs[k] for k in range(per_epoch, 3 * leg)])
    assert len(np.unique(epoch1)) == len(epoch1)  # new epoch: a fresh pass
    assert not np.array_equal(epoch1, epoch0[: len(epoch1)])


def test_a_changed_global_batch_seed_or_data_is_refused(uneven, tmp_path):
    root, manifest, _ = uneven
    s = stream(root, manifest, world=2, micro_batch=4)
    take(s, 3 * s.grad_accum)
    state = s.state_dict()
    assert state["samples_consumed"] == 96 and state["world"] == 2
    other = stream(root, manifest, world=4, micro_batch=2)  # other layout, same global batch: fine
    other.load_state_dict(state)
    assert other.global_step == 3
    with pytest.raises(DataError, match=r"global_batch: 32 in the checkpoint, 64 now") as err:
        stream(root, manifest, global_batch=64, seed=8).load_state_dict(state)
    assert "seed: 7 in the checkpoint, 8 now" in str(err.value)
    copy = tmp_path / "data"  # the same shards less one: other data
    shutil.copytree(root, copy)
    kept = tuple(e for e in manifest.shards if e.name != shard_name("train", 0, 1))
    fewer = dataclasses.replace(manifest, shards=kept)
    with pytest.raises(DataError, match=r"sequences_in_split: 1317 in the checkpoint, 1300 now.*split_fingerprint"):
        stream(copy, fewer).load_state_dict(state)
    with pytest.raises(DataError, match="samples_consumed 40 is not a multiple of the global batch 32"):
        stream(root, manifest).load_state_dict({**state, "samples_consumed": 40})
    with pytest.raises(DataError, match="global_batch 32 is not a multiple of micro_batch 8 x world 3"):
        stream(root, manifest, world=3)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_any_number_of_workers_yields_the_identical_stream(uneven):
    root, manifest, _ = uneven
    start = (41 - 2) * 32  # crosses the epoch boundary
    runs = [
        take(
            stream(
                root, manifest, rank=1, world=2, micro_batch=8, num_workers=w, prefetch_factor=2, start_samples=start
            ),
            8,
        )
        for w in (0, 3)
    ]
    assert [b["global_step"] for b in runs[0]] == [39, 39, 40, 40, 41, 41, 42, 42]
    assert [b["epoch"] for b in runs[0]] == [0] * 4 + [1] * 4
    for x, y in zip(*runs):
        assert (x["global_step"], x["micro_step"]) == (y["global_step"], y["micro_step"])
        for key in ("input_ids", "word_starts", "sample_ids"):
            assert torch.equal(x[key], y[key])


def test_epochs_reshuffle_deterministically_and_steps_mix_blocks(uneven):
    root, manifest, _ = uneven
    a, b, other_seed = stream(root, manifest), stream(root, manifest), stream(root, manifest, seed=8)
    spe = a.steps_per_epoch
    epoch0 = [a.step_sample_ids(k) for k in range(spe)]
    epoch1 = [a.step_sample_ids(spe + k) for k in range(spe)]
    assert all(np.array_equal(x, b.step_sample_ids(k)) for k, x in enumerate(epoch0))
    assert not np.array_equal(epoch0[0], other_seed.step_sample_ids(0))
    flat0, flat1 = np.concatenate(epoch0), np.concatenate(epoch1)
    assert len(np.intersect1d(flat0, flat1)) >= 1317 - 2 * 5  # each epoch nearly the whole split
    first_block = {int(i) // BLOCK for i in epoch0[0]}  # sample ids in file order: ~block ids
    assert len(first_block) >= 4  # a step mixes a window's blocks
    unshuffled = stream(root, manifest, shuffle_window_blocks=0)
    assert np.mean([len({int(i) // BLOCK for i in unshuffled.step_sample_ids(k)}) for k in range(spe)]) < 2
    same_step = sum(len(np.intersect1d(x, y)) for x, y in zip(epoch0, epoch1))
    assert same_step < 100  # a new order, not the old one again


def test_each_rank_reads_about_its_share_of_the_blocks(uneven, monkeypatch):
    root, manifest, _ = uneven
    decoded = Counter()

    def counting_read_span(f, start, end):
        decoded[rank] += 1
        return real_read_span(f, start, end)

    real_read_span = shard_reader.read_span
    monkeypatch.setattr(shard_reader, "read_span", counting_read_span)
    world = 4
    for rank in range(world):
        s = stream(root, manifest, rank=rank, world=world, micro_batch=8)
        take(s, s.steps_per_epoch)
    # 22 blocks; cut unsorted, each rank would decode nearly all of them (about 4 x 22 together).
    assert sum(decoded.values()) <= 2.2 * 22, decoded
    assert all(decoded[r] < 16 for r in range(world)), decoded


@pytest.mark.parametrize("recorded", [True, False], ids=["block-offsets", "older-manifest"])
def test_resume_seek_reads_only_the_blocks_of_the_first_batch(uneven, monkeypatch, recorded):
    """Each needed block is one read at the manifest's block_offsets; a manifest written before
    they were recorded costs a header scan of just the shards read."""
    root, manifest, reference = uneven
    if not recorded:
        raw = manifest.to_dict()
        for entry in raw["shards"]:
            del entry["block_offsets"]
        manifest = Manifest.from_dict(raw)
    reads, indexed = [], []

    def spy_read_span(f, start, end):
        reads.append((Path(f.name).name, start))
        return real_read_span(f, start, end)

    def spy_index_shard(path):
        indexed.append(Path(path).name)
        return real_index_shard(path)

    real_read_span, real_index_shard = shard_reader.read_span, shard_reader.index_shard
    monkeypatch.setattr(shard_reader, "read_span", spy_read_span)
    monkeypatch.setattr(shard_reader, "index_shard", spy_index_shard)
    s = stream(root, manifest, world=2, rank=1, micro_batch=4, start_samples=(41 + 20) * 32)  # deep in epoch 1
    batch = take(s, 1)[0]
    assert batch["global_step"] == 61 and batch["micro_step"] == 0
    wanted = [s.describe_sample(i) for i in batch["sample_ids"].tolist()]
    assert rows_of(batch, reference) == wanted
    wanted_blocks = {(name, i // BLOCK) for name, i in wanted}
    assert len(reads) == len(set(reads)) == len(wanted_blocks)  # each needed block once, nothing else
    offsets = {name: index_shard(root / name) for name in {n for n, _ in wanted}}
    assert {(name, offsets[name].index(off)) for name, off in reads} == wanted_blocks
    assert sorted(indexed) == ([] if recorded else sorted({name for name, _ in wanted}))


def test_has_padding_says_whether_a_batch_holds_pad_tokens(shards):
    manifest = load_manifest(shards)
    pad = manifest.tokenizer.pad_id
    s = TrainStream(shards, manifest, "train", 0, 1, 8, 8, SEED, shuffle_window_blocks=0)
    flags = []
    for batch in take(s, s.steps_per_epoch):
        assert batch["has_padding"] is bool((batch["input_ids"] == pad).any())
        flags.append(batch["has_padding"])
    assert 0 < sum(flags) < len(flags) / 4  # only a task's last sequence of a split is padded


def test_an_out_of_range_token_id_names_shard_and_block(tmp_path, shards):
    bad = shard_name("train", 0, 2)
    write_dataset(tmp_path / "poisoned", UNEVEN, poison=(bad, 130, VOCAB + 7))
    manifest = load_manifest(tmp_path / "poisoned")
    for workers in (0, 2):
        with pytest.raises(TokenIdError) as err:
            for _ in take(stream(tmp_path / "poisoned", manifest, num_workers=workers), 41 * 4):
                pass
        assert str(err.value).startswith(
            str(tmp_path / "poisoned" / bad) + ": block 2 holds token id 30529 "
            "(row 2, sequence 130 of the shard, position 5)"
        ), err.value
        assert "vocabulary has 30522 ids" in str(err.value) and "Traceback" not in str(err.value)
    # data_prep's shards under a manifest whose vocab_size was edited down: caught in training and evaluation.
    edited = tmp_path / "edited"
    shutil.copytree(shards, edited)
    raw = load_manifest(edited).to_dict()
    raw["tokenizer"]["vocab_size"] = 1000
    write_json_atomic(edited / "manifest.json", raw)
    manifest = load_manifest(edited)
    with pytest.raises(TokenIdError, match=r"train-[\w-]+\.tar: block \d+ holds token id \d{4}"):
        take(TrainStream(edited, manifest, "train", 0, 1, 8, 8, SEED), 1)
    with pytest.raises(TokenIdError, match=r"validation-[\w-]+\.tar: block \d+ holds token id"):
        list(eval_set_batches(edited, manifest, "validation", 0, 1, 8, 0))


def test_a_damaged_tar_header_is_found_before_any_batch(shards, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(shards, copy)
    manifest = load_manifest(copy)
    index_all_shards(copy, manifest, ["train", "validation"])  # intact: no error
    victim = copy / next(e.name for e in manifest.shards_of("train") if e.blocks > 3)
    offsets = index_shard(victim)
    with open(victim, "r+b") as f:  # the header of block 2's first member; same size
        f.seek(offsets[2])
        f.write(b"\xff" * 512)
    with pytest.raises(
        ShardError,
        match=rf"1 shards with unreadable tar headers: {victim}: its tar headers list 2 blocks, the manifest says",
    ):
        index_all_shards(copy, manifest, ["train"])
    index_all_shards(copy, manifest, ["validation"])  # only the splits asked for
    problems = check_manifest(manifest, copy, splits=("train", "validation"))
    assert len(problems) == 1 and victim.name in problems[0]
    assert check_manifest(manifest, copy, splits=("train",), index_tars=False) == []


def test_manifest_problems_are_all_named(uneven, tmp_path):
    root, manifest, _ = uneven
    assert (
        check_manifest(
            manifest,
            root,
            splits=("train", "validation"),
            vocab_size=VOCAB,
            tokenizer_sha256=TOKENIZER_SHA,
            seq_len_max=SEQ_LEN,
        )
        == []
    )
    copy = tmp_path / "data"
    shutil.copytree(root, copy)
    (copy / shard_name("train", 0, 1)).unlink()
    with open(copy / shard_name("train", 0, 2), "r+b") as f:
        f.truncate(4096)
    problems = check_manifest(
        manifest, copy, splits=("train", "test"), vocab_size=28996, tokenizer_sha256="cd" * 32, seq_len_max=8
    )
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "tokenizer sha256 ababababab" in text and "model's tokenizer is cdcdcdcdcdcd" in text
    assert "vocab_size is 30522, the model's vocabulary is 28996" in text
    assert "seq_len 16 exceeds the model's max_position_embeddings 8" in text
    assert "split 'test' has no shards" in text
    assert f"1 shard files missing: {shard_name('train', 0, 1)}" in text
    assert f"{shard_name('train', 0, 2)} (4096 bytes, manifest says" in text
    assert "max_position_embeddings 8" in check_manifest(manifest, root, max_positions=8)[0]  # train.py's name
    # The stream checks files itself (cheaply) and names them before any worker starts.
    with pytest.raises(ShardError, match=shard_name("train", 0, 1)):
        stream(copy, manifest)


@pytest.mark.parametrize("checksums", [True, False], ids=["block-crc32", "older-manifest"])
def test_corrupt_block_data_raises_shard_error_naming_it(uneven, tmp_path, checksums):
    root, manifest, _ = uneven
    copy = tmp_path / "data"
    shutil.copytree(root, copy)
    victim = copy / shard_name("train", 0, 2)
    with open(victim, "r+b") as f:  # same size and headers, so only reading can notice
        f.seek(ids_payload(victim, 2)[0])
        f.write(b"\0" * 16)
    if not checksums:
        manifest = without_checksums(manifest)
    index_all_shards(copy, manifest, ["train"])
    s = stream(copy, manifest, num_workers=2)
    said = (
        rf"^{victim}: block 2: its bytes are not those data prep wrote \(CRC-32"
        if checksums
        else rf"^{victim}: block 2 cannot be decoded"
    )
    with pytest.raises(ShardError, match=said):
        for _ in take(s, 41 * 4):
            pass


def without_checksums(manifest: Manifest) -> Manifest:
    """The manifest as data prep wrote it before block_crc32 was recorded."""
    raw = manifest.to_dict()
    for entry in raw["shards"]:
        entry.pop("block_crc32", None)
    return Manifest.from_dict(raw)


def test_a_block_edited_after_finalize_that_still_decodes_is_never_trained_on(shards, tmp_path):
    """Token ids shifted by one in one block of data_prep's shards: the same size, headers and shapes,
    every id in range, so it decodes and trains; only its CRC-32 tells. Refused at the first read of
    that block, in training and evaluation alike; with a manifest from before block_crc32 it is not
    seen (what docs/data.md says such a manifest cannot check)."""
    copy = tmp_path / "data"
    shutil.copytree(shards, copy)
    manifest = load_manifest(copy)
    assert all(e.block_crc32 is not None and len(e.block_crc32) == e.blocks for e in manifest.shards)
    for split in ("train", "validation"):
        victim = copy / manifest.shards_of(split)[0].name
        start, size = ids_payload(victim, 0)
        with open(victim, "r+b") as f:
            f.seek(start)
            header = f.read(128)  # the .npy header, then uint16 ids
            ids = np.frombuffer(f.read(size - 128), dtype=np.uint16).copy()
            ids[ids > 5] -= 1
            f.seek(start + 128)
            f.write(ids.tobytes())
        assert header.startswith(b"\x93NUMPY")
    check_manifest(manifest, copy, splits=("train", "validation"))  # sizes and headers: all as recorded
    with pytest.raises(ShardError, match=r"train-[\w-]+\.tar: block 0: its bytes are not those data prep wrote"):
        epoch = TrainStream(copy, manifest, "train", 0, 1, 8, 8, SEED)
        take(epoch, epoch.steps_per_epoch)
    with pytest.raises(ShardError, match=r"validation-[\w-]+\.tar: block 0: its bytes are not those"):
        list(eval_set_batches(copy, manifest, "validation", 0, 1, 8, 0))
    take(TrainStream(copy, without_checksums(manifest), "train", 0, 1, 8, 8, SEED), 3)  # not seen there


def test_too_small_split_is_a_clear_error_not_a_hang(tmp_path):
    write_dataset(tmp_path, {"train": [20, 3], "validation": [2]})
    manifest = load_manifest(tmp_path)
    with pytest.raises(DataError, match=r"23 sequences: too few for one global batch of 32"):
        stream(tmp_path, manifest, world=2, micro_batch=16)
    with pytest.raises(DataError, match="rank must be in"):
        stream(tmp_path, manifest, rank=2, world=2)


def test_eval_set_batches_are_fixed_disjoint_and_in_step_per_rank(uneven):
    """The evaluation set read across uneven shards and their block boundaries: every row as written."""
    root, manifest, reference = uneven
    world, micro = 2, 8
    per_rank = {}
    for rank in range(world):
        batches = list(eval_set_batches(root, manifest, "validation", rank, world, micro, 0))
        sizes = [len(b["input_ids"]) for b in batches]
        assert sizes == ([8] * 5 + [5], [8] * 5 + [6])[rank]  # 91 = 45 + 46, 6 batches each
        per_rank[rank] = [r for b in batches for r in rows_of(b, reference)]
        ids = torch.cat([b["sample_ids"] for b in batches]).tolist()
        assert ids == list(range(rank * 45, 45 + rank * 46))  # file order, rank's contiguous part
    assert per_rank[0][0] == (shard_name("validation", 0, 0), 0)  # file order, no shuffle
    union = per_rank[0] + per_rank[1]
    assert len(set(union)) == len(union) == 91
    first = [
        r
        for rank in range(world)
        for b in eval_set_batches(root, manifest, "validation", rank, world, micro, 32)
        for r in rows_of(b, reference)
    ]
    assert first == union[:32]  # a smaller set: the first sequences
