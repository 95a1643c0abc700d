"""pretrain.data over real shard tars written with data_prep.shard_format.ShardWriter."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain.data as data
from data_prep.shard_format import (
    FORMAT_VERSION, ShardError, ShardWriter, ids_dtype, index_shard, load_manifest, shard_name, write_json_atomic,
)
from pretrain.data import DataError, TrainStream, check_manifest, eval_batch_count, eval_batches

SEQ_LEN, BLOCK, VOCAB = 16, 64, 30522
UNEVEN = {"train": [1000, 17, 300], "validation": [50, 41]}
TOKENIZER_SHA = "ab" * 32


def write_dataset(root: Path, splits: dict[str, list[int]], vocab: int = VOCAB, seed: int = 0) -> dict:
    """Shards of random sequences plus a hand-written manifest; returns {row bytes: (shard, index, starts)}."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    reference, entries = {}, []
    for split, sizes in splits.items():
        for index, n in enumerate(sizes):
            name = shard_name(split, 0, index)
            ids = rng.integers(5, vocab, size=(n, SEQ_LEN))
            ids[:, 0] = 101
            starts = rng.random((n, SEQ_LEN)) < 0.6
            writer = ShardWriter(root / name, vocab)
            for lo in range(0, n, BLOCK):
                writer.write_block(ids[lo:lo + BLOCK], starts[lo:lo + BLOCK])
            sha = writer.close()
            for i in range(n):
                reference[ids[i].astype(np.int64).tobytes()] = (name, i, starts[i])
            entries.append({"name": name, "split": split, "task": 0, "index": index, "sequences": n,
                            "blocks": writer.blocks, "tokens": n * SEQ_LEN, "padding": 0,
                            "bytes": (root / name).stat().st_size, "sha256": sha})
    manifest = {
        "format_version": FORMAT_VERSION, "seq_len": SEQ_LEN, "block_size": BLOCK, "dtype": ids_dtype(vocab).name,
        "tokenizer": {"path": "tokenizer", "sha256": TOKENIZER_SHA, "vocab_size": vocab, "lowercase": True,
                      "special_ids": {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}},
        "num_tasks": 1, "shards": entries,
        "totals": {s: {"shards": len(v), "sequences": sum(v)} for s, v in splits.items()}, "settings": {},
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
    args = dict(split="train", rank=0, world=1, micro_batch=8, seed=7, num_workers=0)
    args.update(kw)
    return TrainStream(root, manifest, **args)


def test_batches_decode_to_exactly_the_written_sequences(uneven):
    root, manifest, reference = uneven
    s = stream(root, manifest)
    assert s.sequences_in_split == 1317 and s.batches_per_epoch == 1317 // 8 == 164
    assert s.tokens_per_batch == 8 * SEQ_LEN and s.dropped_per_epoch == 1317 - 164 * 8
    seen = []
    for g, batch in enumerate(take(s, s.batches_per_epoch)):
        assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (8, SEQ_LEN)
        assert batch["word_starts"].dtype == torch.bool and batch["word_starts"].shape == (8, SEQ_LEN)
        assert batch["position"] == g and batch["epoch"] == 0
        rows = rows_of(batch, reference)
        assert rows == s.batch_sequences(g)   # the plan and the bytes read agree
        seen += rows
    assert len(set(seen)) == len(seen) == 1312          # one epoch: each sequence at most once
    assert {name for name, _ in seen} == {shard_name("train", 0, i) for i in range(3)}
    assert s.position == 164 and s.state_dict()["epoch"] == 1


def test_uint32_ids_for_a_large_vocabulary(tmp_path):
    reference = write_dataset(tmp_path, {"train": [70]}, vocab=70000, seed=3)
    manifest = load_manifest(tmp_path)
    assert manifest["dtype"] == "uint32"
    batch = take(stream(tmp_path, manifest, micro_batch=4), 1)[0]
    assert len(rows_of(batch, reference)) == 4
    assert int(max(np.frombuffer(k, dtype=np.int64).max() for k in reference)) > 65535


def test_every_rank_gets_the_same_batches_with_uneven_shards(uneven):
    root, manifest, reference = uneven
    world, micro = 2, 8
    per_rank = {}
    for rank in range(world):
        s = stream(root, manifest, rank=rank, world=world, micro_batch=micro, num_workers=2, prefetch_factor=2)
        assert s.batches_per_epoch == (1317 // world) // micro == 82
        batches = take(s, s.batches_per_epoch + 1)   # one epoch, then the stream goes on
        assert [b["position"] for b in batches] == list(range(83))
        assert batches[-1]["epoch"] == 1
        per_rank[rank] = [r for b in batches[:-1] for r in rows_of(b, reference)]
    assert len(per_rank[0]) == len(per_rank[1]) == 82 * micro
    union = per_rank[0] + per_rank[1]
    assert len(set(union)) == len(union) == 1312        # disjoint, and only 5 of 1317 dropped
    # Contiguous shares of the shuffled order: each rank reads only part of the big shard.
    big = shard_name("train", 0, 0)
    assert 300 < sum(n == big for n, _ in per_rank[0]) < 700


def test_epochs_reshuffle_deterministically_and_batches_mix_blocks(uneven):
    root, manifest, _ = uneven
    a, b = stream(root, manifest), stream(root, manifest)
    other_seed = stream(root, manifest, seed=8)
    bpe = a.batches_per_epoch
    epoch0 = [a.batch_sequences(g) for g in range(bpe)]
    epoch1 = [a.batch_sequences(bpe + g) for g in range(bpe)]
    assert epoch0 == [b.batch_sequences(g) for g in range(bpe)]          # same seed, same order
    assert epoch0 != epoch1 and epoch0[0] != other_seed.batch_sequences(0)
    flat0, flat1 = [r for x in epoch0 for r in x], [r for x in epoch1 for r in x]
    assert len(set(flat0) & set(flat1)) >= 1317 - 2 * 5               # each epoch nearly the whole split
    same_slot = sum(x == y for x, y in zip(flat0, flat1))
    assert same_slot < 20
    # The block order is redrawn too: with 2 ranks, rank 0's share of epoch 1 is a new half of the data.
    r0 = stream(root, manifest, world=2)
    share = [{r for g in range(e * 82, (e + 1) * 82) for r in r0.batch_sequences(g)} for e in (0, 1)]
    assert 0.3 < len(share[0] & share[1]) / len(share[0]) < 0.7
    # Shuffle windows: a batch of 8 draws on several blocks, not on neighbours in one block.
    distinct_blocks = [len({(n, i // BLOCK) for n, i in seqs}) for seqs in epoch0]
    assert np.mean(distinct_blocks) > 4
    no_window = stream(root, manifest, shuffle_window_blocks=0)
    assert np.mean([len({(n, i // BLOCK) for n, i in no_window.batch_sequences(g)}) for g in range(bpe)]) < 2
    # The real bytes follow the plan for a second stream too.
    assert [rows[0] for rows in epoch1[:3]] == [b.batch_sequences(bpe + g)[0] for g in range(3)]


def test_resume_at_any_position_matches_the_uninterrupted_stream(uneven):
    root, manifest, _ = uneven
    full = TrainStream(root, manifest, "train", 1, 2, 8, 7, 0, 2)   # positional, as pretrain/train.py calls it
    bpe = full.batches_per_epoch
    reference = take(full, bpe + 6)
    g = bpe - 4                                       # the resumed part crosses an epoch boundary
    for workers in (2, 0):
        resumed = take(stream(root, manifest, rank=1, world=2, num_workers=workers, start_position=g), 10)
        for x, y in zip(reference[g:], resumed):
            assert x["position"] == y["position"]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["word_starts"], y["word_starts"])
    # A checkpoint's state_dict restores the same next batch; another layout is refused, not guessed.
    s = stream(root, manifest, rank=1, world=2)
    take(s, 5)
    state = s.state_dict()
    assert state["position"] == 5 and state["batch_in_epoch"] == 5
    again = stream(root, manifest, rank=1, world=2)
    again.load_state_dict(state)
    assert torch.equal(take(again, 1)[0]["input_ids"], reference[5]["input_ids"])
    with pytest.raises(DataError, match="world: 2 -> 1"):
        stream(root, manifest).load_state_dict(state)


def test_resume_seek_reads_only_the_blocks_of_the_first_batch(uneven, monkeypatch):
    root, manifest, reference = uneven
    reads, indexed = [], []

    def spy_read_block(f, ref, seq_len):
        reads.append((Path(f.name).name, ref.ids_offset))
        return real_read_block(f, ref, seq_len)

    def spy_index_shard(path):
        indexed.append(Path(path).name)
        return real_index_shard(path)

    real_read_block, real_index_shard = data.read_block, data.index_shard
    monkeypatch.setattr(data, "read_block", spy_read_block)
    monkeypatch.setattr(data, "index_shard", spy_index_shard)
    s = stream(root, manifest)
    g = s.batches_per_epoch + 100                     # deep into epoch 1
    batch = take(stream(root, manifest, start_position=g), 1)[0]
    wanted = s.batch_sequences(g)
    assert rows_of(batch, reference) == wanted
    wanted_blocks = {(name, i // BLOCK) for name, i in wanted}
    assert len(reads) == len(set(reads)) == len(wanted_blocks)      # each needed block once, nothing else
    offsets = {name: [r.ids_offset for r in index_shard(root / name)] for name in {n for n, _ in wanted}}
    assert {(name, offsets[name].index(off)) for name, off in reads} == wanted_blocks
    assert sorted(indexed) == sorted({name for name, _ in wanted})


def test_manifest_problems_are_all_named(uneven, tmp_path):
    root, manifest, _ = uneven
    assert check_manifest(manifest, root, splits=("train", "validation"), vocab_size=VOCAB,
                          tokenizer_sha256=TOKENIZER_SHA, seq_len_max=SEQ_LEN) == []
    copy = tmp_path / "data"
    shutil.copytree(root, copy)
    (copy / shard_name("train", 0, 1)).unlink()
    with open(copy / shard_name("train", 0, 2), "r+b") as f:
        f.truncate(4096)
    problems = check_manifest(manifest, copy, splits=("train", "test"), vocab_size=28996,
                              tokenizer_sha256="cd" * 32, seq_len_max=8)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "tokenizer sha256 ababababab" in text and "model's tokenizer is cdcdcdcdcdcd" in text
    assert "vocab_size is 30522, the model's vocabulary is 28996" in text
    assert "seq_len 16 exceeds the model's max_position_embeddings 8" in text
    assert "split 'test' has no shards" in text
    assert f"1 shard files missing: {shard_name('train', 0, 1)}" in text
    assert f"{shard_name('train', 0, 2)} (4096 bytes, manifest says" in text
    assert "max_position_embeddings 8" in check_manifest(manifest, root, max_positions=8)[0]   # train.py's name
    # The stream checks files itself (cheaply) and names them before any worker starts.
    with pytest.raises(ShardError, match=shard_name("train", 0, 1)):
        stream(copy, manifest)


def test_corrupt_shard_raises_shard_error_naming_it(uneven, tmp_path):
    root, manifest, _ = uneven
    copy = tmp_path / "data"
    shutil.copytree(root, copy)
    victim = copy / shard_name("train", 0, 2)
    refs = index_shard(victim)
    with open(victim, "r+b") as f:                    # same size, so only reading can notice
        f.seek(refs[2].ids_offset)
        f.write(b"\0" * 16)
    s = stream(copy, manifest, num_workers=2)
    with pytest.raises(ShardError, match=rf"{victim.name}: block 2 cannot be decoded"):
        for _ in zip(range(s.batches_per_epoch), s):
            pass
    with open(victim, "r+b") as f:                    # a broken tar header: the index scan fails
        f.seek(0)
        f.write(b"\xff" * 512)
    with pytest.raises(ShardError, match=victim.name):
        for _ in zip(range(s.batches_per_epoch), stream(copy, manifest)):
            pass


def test_too_small_split_is_a_clear_error_not_a_hang(tmp_path):
    write_dataset(tmp_path, {"train": [20, 3], "validation": [2]})
    manifest = load_manifest(tmp_path)
    with pytest.raises(DataError, match=r"23 sequences: too few for 2 rank\(s\) x micro-batch 16 = 32"):
        stream(tmp_path, manifest, world=2, micro_batch=16)
    with pytest.raises(DataError, match="2 sequences, fewer than the 4 ranks"):
        list(eval_batches(tmp_path, manifest, "validation", rank=0, world=4, micro_batch=1))
    with pytest.raises(DataError, match="rank must be in"):
        stream(tmp_path, manifest, rank=2, world=2)


def test_eval_batches_are_fixed_disjoint_and_equal_per_rank(uneven):
    root, manifest, reference = uneven
    world, micro = 2, 8
    per_rank = {}
    for rank in range(world):
        batches = list(eval_batches(root, manifest, "validation", rank, world, micro))
        assert len(batches) == eval_batch_count(manifest, "validation", world, micro) == 6   # 45 = 5 x 8 + 5
        assert [len(b["input_ids"]) for b in batches] == [8] * 5 + [5]
        per_rank[rank] = [r for b in batches for r in rows_of(b, reference)]
        again = list(eval_batches(root, manifest, "validation", rank=rank, world=world, micro_batch=micro,
                                  max_batches=2))
        assert [r for b in again for r in rows_of(b, reference)] == per_rank[rank][:16]
    assert per_rank[0][0] == (shard_name("validation", 0, 0), 0)             # file order, no shuffle
    union = per_rank[0] + per_rank[1]
    assert len(set(union)) == len(union) == 90                               # 91 sequences, 1 left over
