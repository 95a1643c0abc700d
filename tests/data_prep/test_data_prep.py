"""data_prep shard: real Wikipedia text in, shards out; decoded against the tokenizer and a reference packer."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_prep.common.manifest import load_manifest
from data_prep.common.shards import iter_blocks
from data_prep.packing import Packer, shard_permutation
from data_prep.reader import ReadOptions, iter_source, iter_task_documents, resolve_inputs
from data_prep.settings import ShardSettings
from data_prep.shard import run_shard
from data_prep.tokenizer import Encoded, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 128
GROUP_CHARS = 100_000  # several packing groups per file of the sample corpus


def cli(*args, check=True, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"data_prep {args} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def shard(inputs, tokenizer, out, **kw) -> Path:
    kw.setdefault("num_tasks", 1)
    kw.setdefault("task_index", 0)
    run_shard(ShardSettings(inputs=[str(i) for i in inputs], tokenizer=str(tokenizer), out=str(out), **kw))
    return Path(out)


def stream_order(data_dir: Path, split: str, task: int = 0):
    """A task's sequences in packing order (shards in dataset order, each un-shuffled), from the task manifest."""
    m = json.loads((data_dir / f"task-{task:05d}.json").read_text())
    ids, starts = [], []
    for e in (e for e in m["shards"] if e["split"] == split):
        blocks = list(iter_blocks(data_dir / e["name"], m["seq_len"]))
        sh_ids = np.concatenate([b[0] for b in blocks])
        sh_starts = np.concatenate([b[1] for b in blocks])
        order = shard_permutation(m["settings"]["seed"], split, e["source"], e["group"], e["index"], len(sh_ids))
        back = np.empty_like(sh_ids)
        back[order] = sh_ids
        back_starts = np.empty_like(sh_starts)
        back_starts[order] = sh_starts
        ids.append(back)
        starts.append(back_starts)
    return np.concatenate(ids), np.concatenate(starts)


def packing_groups(docs_per_source: list[list[str]], group_chars: int) -> list[list[str]]:
    """The group rule written out: per source, a group closes at the document reaching group_chars."""
    groups = []
    for docs in docs_per_source:
        current, chars = [], 0
        for d in docs:
            current.append(d)
            chars += len(d)
            if chars >= group_chars:
                groups.append(current)
                current, chars = [], 0
        if current:
            groups.append(current)
    return groups


def reference_pack(doc_ids, doc_starts, seq_len, cls, sep, pad):
    """The packing rule written the slow, obvious way: token by token."""
    stream = []  # (id, word_start, is_separator)
    for tokens, starts in zip(doc_ids, doc_starts, strict=True):
        if not tokens:
            continue
        if stream:
            stream.append((sep, True, True))
        stream.extend((t, s, False) for t, s in zip(tokens, starts, strict=True))
    body, seqs, p = seq_len - 2, [], 0
    while p < len(stream):
        if stream[p][2]:
            p += 1
            continue
        piece = stream[p : p + body]
        p += body
        pad_n = body - len(piece)
        seqs.append(
            (
                [cls] + [t for t, _, _ in piece] + [sep] + [pad] * pad_n,
                [True] + [s for _, s, _ in piece] + [True] * (1 + pad_n),
            )
        )
    return np.array([s[0] for s in seqs]), np.array([s[1] for s in seqs])


@pytest.fixture(scope="module")
def hf_tokenizer(bert_uncased_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bert_uncased_dir))


@pytest.fixture(scope="module")
def wiki_docs(wiki_txt_dir):
    return list(iter_task_documents(resolve_inputs([str(wiki_txt_dir)]), "files", 1, 0, ReadOptions()))


@pytest.fixture(scope="module")
def wiki_groups(wiki_txt_dir):
    per_source = [list(iter_source(s, ReadOptions())) for s in resolve_inputs([str(wiki_txt_dir)])]
    return packing_groups(per_source, GROUP_CHARS)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, wiki_txt_dir, bert_uncased_dir):
    return shard(
        [wiki_txt_dir / "*.txt"],
        bert_uncased_dir,
        tmp_path_factory.mktemp("sharded") / "out",
        seq_len=SEQ_LEN,
        shard_size=256,
        seed=11,
        group_chars=GROUP_CHARS,
    )


def test_packer_rule_on_a_small_stream():
    # docs of 5, 3, 2, 4 tokens; body = 6 - 2 = 4
    docs = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31], [40, 41, 42, 43]]
    enc = Encoded(
        np.array([t for d in docs for t in d], np.uint32), np.ones(14, bool), np.array([len(d) for d in docs])
    )
    p = Packer(6, cls_id=1, sep_id=2, pad_id=0, dtype=np.uint16)
    out = p.add(enc, np.arange(4))
    last = p.finish()
    got = np.concatenate([out.ids, last.ids]).tolist()
    assert got == [
        [1, 10, 11, 12, 13, 2],
        [1, 14, 2, 20, 21, 2],
        [1, 22, 2, 30, 31, 2],  # doc 2 ends the body: its separator opens nothing, it is dropped
        [1, 40, 41, 42, 43, 2],
    ]
    # the stream ended on a body boundary: nothing left to pad; each sequence knows where the stream stands
    assert len(last) == 0 and out.end_doc.tolist() == [0, 1, 2, 3] and out.end_offset.tolist() == [4, 2, 2, 4]
    # a document ending one token before the body's end leaves a [SEP][SEP], the last body is padded
    p = Packer(6, 1, 2, 0, np.uint16)
    enc = Encoded(np.array([10, 11, 12, 20, 21], np.uint32), np.ones(5, bool), np.array([3, 2]))
    out, last = p.add(enc, np.arange(2)), p.finish()
    assert out.ids.tolist() == [[1, 10, 11, 12, 2, 2]] and last.ids.tolist() == [[1, 20, 21, 2, 0, 0]]
    assert last.padding == 2 and (last.end_doc[0], last.end_offset[0]) == (1, 2)


def test_shards_equal_the_tokenizer_output_packed(sharded, wiki_groups, hf_tokenizer):
    m = load_manifest(sharded) if (sharded / "manifest.json").exists() else None
    assert m is None  # not finalized yet: the task manifest alone describes the shards
    assert len(wiki_groups) >= 8  # 4 files, each cut into packing groups
    ids, starts = stream_order(sharded, "train")
    sp = {r: getattr(hf_tokenizer, f"{r}_token_id") for r in ("cls", "sep", "pad")}
    ref_ids, ref_starts, group_ends, all_doc_ids = [], [], [], []
    for docs in wiki_groups:  # each group packed on its own, groups in order
        enc = hf_tokenizer(docs, add_special_tokens=False, padding=False, truncation=False)
        doc_ids = enc["input_ids"]
        doc_starts = [
            [w != (ws[i - 1] if i else None) for i, w in enumerate(ws)]
            for ws in (enc.word_ids(i) for i in range(len(docs)))
        ]
        g_ids, g_starts = reference_pack(doc_ids, doc_starts, SEQ_LEN, sp["cls"], sp["sep"], sp["pad"])
        ref_ids.append(g_ids)
        ref_starts.append(g_starts)
        group_ends.append(sum(map(len, ref_ids)) - 1)
        all_doc_ids += doc_ids
    ref_ids, ref_starts = np.concatenate(ref_ids), np.concatenate(ref_starts)
    assert ids.dtype == np.uint16 and ids.shape == ref_ids.shape == (len(ref_ids), SEQ_LEN)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(starts, ref_starts)
    # framing: every sequence is [CLS] ... [SEP]; only a group's last one may be padded
    assert (ids[:, 0] == sp["cls"]).all()
    padded = (ids == sp["pad"]).any(axis=1)
    assert set(np.flatnonzero(padded)) <= set(group_ends) and padded.sum() >= len(wiki_groups) // 2
    assert (ids[~padded, -1] == sp["sep"]).all()
    # concatenated bodies without separators are exactly the documents' tokens, in order
    content = ids[(ids != sp["cls"]) & (ids != sp["sep"]) & (ids != sp["pad"])]
    assert content.tolist() == [t for d in all_doc_ids for t in d]
    # and the decoded first sequence starts with the first article's text
    first = hf_tokenizer.decode(ids[0][1:20].tolist())
    assert hf_tokenizer.decode(all_doc_ids[0][:19]) == first


def test_word_start_bits_for_words_split_into_pieces(sharded, bert_uncased_dir):
    tok = load_tokenizer(bert_uncased_dir)
    ids, starts = stream_order(sharded, "train")
    flat_ids, flat_starts = ids.ravel(), starts.ravel()
    vocab = tok.tokenizer.get_vocab()
    inverse = {i: t for t, i in vocab.items()}
    # a three-piece word from the text itself: its first piece starts a word, the others do not
    words = Counter()
    for a, b, c, d in zip(flat_ids[:-3], flat_ids[1:-2], flat_ids[2:-1], flat_ids[3:], strict=True):
        ta, tb, tc, td = inverse[a], inverse[b], inverse[c], inverse[d]
        if not ta.startswith("##") and tb.startswith("##") and tc.startswith("##") and not td.startswith("##"):
            words[(a, b, c)] += 1
    (a, b, c), _ = words.most_common(1)[0]
    pos = next(i for i in range(len(flat_ids) - 2) if (flat_ids[i], flat_ids[i + 1], flat_ids[i + 2]) == (a, b, c))
    assert flat_starts[pos : pos + 3].tolist() == [True, False, False]
    # "mesopotamian" is one of the articles' words and splits into two pieces
    enc = tok.encode(["Mesopotamian"])
    assert [inverse[i] for i in enc.ids] == ["mesopotamia", "##n"] and enc.starts.tolist() == [True, False]
    # everywhere: a word starts unless the piece is a ## continuation; [CLS]/[SEP]/[PAD] count as starts
    continuation = np.array([inverse[i].startswith("##") for i in range(len(inverse))])
    np.testing.assert_array_equal(flat_starts, ~continuation[flat_ids])


def test_word_id_path_agrees_with_the_vocabulary_table(bert_uncased_dir, wiki_docs):
    tok = load_tokenizer(bert_uncased_dir)
    fast = tok.encode(wiki_docs[:200])
    tok.continuation = None  # force the word_ids fallback that non-WordPiece tokenizers use
    slow = tok.encode(wiki_docs[:200])
    np.testing.assert_array_equal(fast.ids, slow.ids)
    np.testing.assert_array_equal(fast.starts, slow.starts)
    assert fast.starts.mean() < 0.95  # the text really has multi-piece words


def test_bytes_per_token_at_uint16_seq128(tmp_path, wiki_articles, bert_uncased_dir):
    from data_prep.sample_corpus import write_sample_corpus

    write_sample_corpus(tmp_path / "txt", "txt", num_files=2, max_docs=3000)
    out = shard([tmp_path / "txt"], bert_uncased_dir, tmp_path / "out", seq_len=128, shard_size=4096)
    m = json.loads((out / "task-00000.json").read_text())
    tokens = sum(e["sequences"] for e in m["shards"]) * 128
    size = sum((out / e["name"]).stat().st_size for e in m["shards"])
    assert m["dtype"] == "uint16" and tokens > 250_000
    assert size / tokens <= 2.3, size / tokens


@pytest.mark.slow
def test_shards_read_with_webdataset_and_tar(sharded):
    import webdataset as wds

    m = json.loads((sharded / "task-00000.json").read_text())
    e = m["shards"][0]
    listing = subprocess.run(["tar", "-tf", str(sharded / e["name"])], capture_output=True, text=True, check=True)
    names = listing.stdout.split()
    assert len(names) == 2 * e["blocks"]
    assert names[0].endswith(".input_ids.npy") and names[1].endswith(".word_starts.npy")
    samples = list(wds.WebDataset(str(sharded / e["name"]), shardshuffle=False))
    assert len(samples) == e["blocks"]
    n = 0
    for s in samples:
        ids = np.load(io.BytesIO(s["input_ids.npy"]))
        starts = np.unpackbits(np.load(io.BytesIO(s["word_starts.npy"])), axis=1, count=SEQ_LEN)
        assert ids.dtype == np.uint16 and ids.shape[1] == SEQ_LEN and starts.shape == ids.shape
        n += len(ids)
    assert n == e["sequences"]


def test_inputs_in_every_format_give_identical_shards(tmp_path, wiki_txt_dir, bert_uncased_dir):
    """txt, txt.gz, jsonl, a JSON array, parquet and a save_to_disk folder of the same 1,000 articles."""
    import datasets

    from data_prep.sample_corpus import write_sample_corpus

    jsonl = write_sample_corpus(tmp_path / "jsonl", "jsonl", num_files=4, max_docs=1000)
    ds = datasets.concatenate_datasets([datasets.Dataset.from_json(str(p)) for p in jsonl])
    (tmp_path / "parquet").mkdir()
    for i, p in enumerate(jsonl):
        datasets.Dataset.from_json(str(p)).to_parquet(str(tmp_path / "parquet" / f"wiki-{i:02d}.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "array.json").write_text(json.dumps([{"text": t} for t in ds["text"]]))
    (tmp_path / "gz").mkdir()
    for p in sorted(wiki_txt_dir.glob("*.txt")):
        with gzip.open(tmp_path / "gz" / (p.name + ".gz"), "wb") as f:
            f.write(p.read_bytes())
    (tmp_path / "one.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ds["text"]))
    digests = {}
    for name, inp in [
        ("txt", wiki_txt_dir / "*.txt"),
        ("jsonl", tmp_path / "jsonl"),
        ("parquet", tmp_path / "parquet" / "*.parquet"),
        ("txt.gz", tmp_path / "gz"),
        ("saved", tmp_path / "saved"),
        ("json-array", tmp_path / "array.json"),
        ("one-jsonl", tmp_path / "one.jsonl"),
    ]:
        out = shard([inp], bert_uncased_dir, tmp_path / f"out-{name}", shard_size=10_000)
        m = json.loads((out / "task-00000.json").read_text())
        assert m["totals"]["train"]["documents"] == 1000
        digests[name] = [e["sha256"] for e in m["shards"]]
    # small text files are read together (one bundle, one packing group): the same shards as the
    # same documents in one file; a parquet file is a bundle of its own (a group each)
    assert len(digests["txt"]) == 1
    assert all(digests[n] == digests["txt"] for n in ("jsonl", "txt.gz", "saved", "json-array", "one-jsonl"))
    assert len(digests["parquet"]) == 4 and digests["parquet"] != digests["txt"]


def test_validation_split_is_by_document_and_deterministic(tmp_path, wiki_txt_dir, bert_uncased_dir):
    out = shard([wiki_txt_dir], bert_uncased_dir, tmp_path / "a", validation_fraction=0.1, seed=5, shard_size=512)
    m = json.loads((out / "task-00000.json").read_text())
    t = m["totals"]
    assert t["train"]["documents"] + t["validation"]["documents"] == 1000
    assert 60 <= t["validation"]["documents"] <= 140  # 10% of 1,000 documents, binomial spread
    assert {e["split"] for e in m["shards"]} == {"train", "validation"}
    val_ids, _ = stream_order(out, "validation")
    assert (val_ids == 0).any(axis=1).sum() <= len(m["groups"])  # only a group's last sequence is padded
    again = shard([wiki_txt_dir], bert_uncased_dir, tmp_path / "b", validation_fraction=0.1, seed=5, shard_size=512)
    assert [e["sha256"] for e in json.loads((again / "task-00000.json").read_text())["shards"]] == [
        e["sha256"] for e in m["shards"]
    ]


@pytest.mark.slow
def test_cli_end_to_end_with_finalize_verify_inspect(tmp_path, wiki_txt_dir, bert_uncased_dir):
    out = tmp_path / "out"
    proc = cli(
        "shard",
        "--input",
        wiki_txt_dir / "*.txt",
        "--tokenizer",
        bert_uncased_dir,
        "--out",
        out,
        "--shard-size",
        300,
        "--validation-fraction",
        0.05,
        "--log-every",
        0,
        "--seed",
        2,
    )
    assert "tokens/s" in proc.stderr and "\r" not in proc.stderr  # plain log lines, not a bar, off a terminal
    assert "manifest.json" in cli("finalize", out).stdout
    m = load_manifest(out)
    assert m.seq_len == 128 and m.dtype == "uint16" and m.num_tasks == 1
    assert m.tokenizer.special_ids == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    assert m.tokenizer.vocab_size == 30522 and m.tokenizer.lowercase is True
    for split, t in m.totals.items():
        shards = m.shards_of(split)
        assert t["shards"] == len(shards) and t["sequences"] == sum(e.sequences for e in shards)
        assert t["tokens"] + t["padding"] == t["sequences"] * 128
    assert cli("verify", out).returncode == 0
    text = cli("inspect", out, "--samples", 2).stdout
    assert "[CLS]" in text and "bytes/token" in text and "padding" in text

    from transformers import AutoTokenizer

    copy = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert copy.mask_token_id == 103 and not (out / "tokenizer" / "model.safetensors").exists()


@pytest.mark.slow
def test_trained_tokenizer_loads_with_autotokenizer_and_shards(tmp_path, wiki_txt_dir):
    from transformers import AutoTokenizer

    cli("tokenizer", "--input", wiki_txt_dir / "*.txt", "--out", tmp_path / "tok", "--vocab-size", 3000, "--lowercase")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert [hf.pad_token, hf.unk_token, hf.cls_token, hf.sep_token, hf.mask_token] == [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
    ]
    ids = hf("The Mesopotamian Empire")["input_ids"]
    assert ids[0] == hf.cls_token_id and ids[-1] == hf.sep_token_id and hf.unk_token_id not in ids
    assert hf.decode(ids[1:-1]).startswith("the mesopotamian")
    assert 2500 <= hf.vocab_size <= 3000
    out = shard([wiki_txt_dir], tmp_path / "tok", tmp_path / "out", shard_size=4096)
    m = json.loads((out / "task-00000.json").read_text())
    assert m["dtype"] == "uint16" and m["tokenizer"]["special_ids"]["pad"] == hf.pad_token_id
    ids, starts = stream_order(out, "train")
    assert ids.max() < 3000 and 0.5 < starts.mean() < 1.0


@pytest.mark.slow
def test_a_tokenizer_trained_twice_on_the_same_text_is_the_same_file(tmp_path, wiki_txt_dir):
    """tokenizers' WordPiece trainer numbers its ``##`` pieces in a hash map's order (a new one each
    process) and breaks ties between merges by those numbers (issue 1794 there): every run gave another
    tokenizer.json, at times other tokens. Ours names those pieces to the trainer up front, sorted."""
    import tokenizers

    files = []
    for run in ("first", "second"):  # each a fresh process (not forked): its own hash seeds
        out = tmp_path / run
        command = [sys.executable, "-m", "data_prep", "tokenizer", "--input", f"{wiki_txt_dir}/*.txt"]
        subprocess.run([*command, "--out", str(out), "--vocab-size", "3000"], check=True, cwd=REPO, timeout=300)
        files.append((out / "tokenizer.json").read_bytes())
    assert files[0] == files[1]

    # the pieces named to the trainer are plain vocabulary, matched inside words, never added tokens
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "first" / "tokenizer.json"))
    added = [a["content"] for a in json.loads(files[0])["added_tokens"]]
    assert added == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = tok.encode("Mesopotamian ##a", add_special_tokens=False).tokens
    word = pieces[:-3]  # the word in the trainer's pieces; "##a" in the text is three characters
    assert len(word) > 1 and all(p.startswith("##") for p in word[1:]) and len(pieces[-3:]) == 3
    assert "##a" not in pieces and pieces[-1] == "a"
    assert "".join(p.removeprefix("##") for p in word) == "Mesopotamian"


DATA_PREP_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "data").glob("*.yaml"))


@pytest.mark.parametrize("path", DATA_PREP_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_data_prep_yaml_loads(path):
    """Each shipped data-prep YAML reads as the shard settings it says: every key one of
    ``ShardSettings``' fields with the value written, and its sequence length the one in its name."""
    import dataclasses

    import yaml

    from data_prep.settings import ShardSettings, load_settings_file

    loaded, written = load_settings_file(str(path)), yaml.safe_load(path.read_text())
    assert loaded == written and set(loaded) <= {f.name for f in dataclasses.fields(ShardSettings)}, loaded
    assert loaded["seq_len"] == int(path.stem.split("-")[-1]), (path.name, loaded)
