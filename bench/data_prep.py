"""Tokens/s of ``data_prep shard`` against the obvious alternatives, on one corpus, one machine, one run.

    python bench/data_prep.py [--copies 6] [--workers 1 2] [--repeats 2]

Corpus: the ~10,000 embedded Wikipedia articles repeated ``--copies`` times as ``.jsonl`` files (about
1M tokens per copy); tokenizer: bert-base-uncased (``data_prep.sample_corpus.bert_uncased_dir``).
Compared, at each ``--workers`` value (our tokenizer processes = ``datasets``' ``num_proc``):

* ``data_prep shard``: end to end: read jsonl, tokenize, word starts, pack, shuffle, write shards;
* ``datasets.map``: ``load_dataset("json")``, ``map`` with the same tokenizer through
  ``transformers.AutoTokenizer`` (batched, no special tokens, no packing), then ``save_to_disk``;
* the bare tokenizer: ``tokenizers.Tokenizer.encode_batch`` (and ``encode_batch_fast``) over the
  documents already in memory, in batches of the same size: no reading, packing or writing.

Every method runs once per round, ``--repeats`` rounds; the best time counts (the machine may be shared).
CPU seconds (all threads and worker processes) are printed too: on a loaded machine they say more
about the work each method does than wall time does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.sample_corpus import bert_uncased_dir, wiki_articles  # noqa: E402


def make_corpus(folder: Path, copies: int) -> tuple[list[Path], list[str]]:
    docs = [text for _, text in wiki_articles()]
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for c in range(copies):
        path = folder / f"part-{c:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for text in docs:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        files.append(path)
    return files, docs * copies


def bench_ours(files, tok_dir, out: Path, workers: int) -> tuple[int, float]:
    from data_prep.settings import ShardSettings
    from data_prep.shard import run_shard

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    result = run_shard(
        ShardSettings(
            inputs=[str(f) for f in files],
            tokenizer=str(tok_dir),
            out=str(out),
            num_tasks=1,
            task_index=0,
            workers=workers,
            log_every=1e9,
        )
    )
    return result.tokens, time.perf_counter() - t0


def bench_datasets(files, tok_dir, out: Path, workers: int, cache: Path) -> tuple[int, float]:
    import datasets
    from transformers import AutoTokenizer

    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))

    def tokenize(batch):
        return tok(
            batch["text"],
            add_special_tokens=False,
            padding=False,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )

    ds = ds.map(tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names)
    ds.save_to_disk(str(out))
    seconds = time.perf_counter() - t0
    tokens = sum(len(ids) for ids in ds.with_format("arrow")["input_ids"].to_pylist())
    return tokens, seconds


def bench_bare(docs: list[str], tok_dir, method: str, batch_chars: int = 1 << 20) -> tuple[int, float]:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    encode = getattr(tok, method)
    batches, batch, chars = [], [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= batch_chars:
            batches.append(batch)
            batch, chars = [], 0
    batches.append(batch)
    t0 = time.perf_counter()
    tokens = 0
    for b in batches:
        tokens += sum(len(e.ids) for e in encode(b, add_special_tokens=False))
    return tokens, time.perf_counter() - t0


def _cpu_seconds() -> float:
    """User + system time of this process and its reaped children (worker processes, num_proc pools)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=6, help="times the ~1M-token article set is repeated")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="our --workers = datasets num_proc")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    os.environ.pop("TOKENIZERS_PARALLELISM", None)  # let Rust use every core, as users' runs do
    import datasets

    datasets.disable_progress_bars()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_prep_"))
    tok_dir = bert_uncased_dir()
    files, docs = make_corpus(work / "corpus", args.copies)
    size = sum(f.stat().st_size for f in files)
    print(
        f"corpus: {len(docs):,} documents in {len(files)} jsonl files, {size / 1e6:.1f} MB; "
        f"tokenizer bert-base-uncased; {os.cpu_count()} CPUs; {args.repeats} rounds, methods interleaved, "
        "best time counts",
        flush=True,
    )

    methods = [
        ("bare tokenizer: encode_batch (in memory)", "-", lambda: bench_bare(docs, tok_dir, "encode_batch")),
        ("bare tokenizer: encode_batch_fast (in memory)", "-", lambda: bench_bare(docs, tok_dir, "encode_batch_fast")),
    ]
    for w in args.workers:
        methods.append(
            ("data_prep shard (read+tokenize+pack+write)", w, lambda w=w: bench_ours(files, tok_dir, work / "ours", w))
        )
        methods.append(
            (
                "datasets.map + save_to_disk",
                w,
                lambda w=w: bench_datasets(files, tok_dir, work / "hf", w, work / "hf_cache"),
            )
        )
    # rounds of every method in turn, so that load from other users hits all methods alike
    times: dict[int, list[float]] = {i: [] for i in range(len(methods))}
    cpu: dict[int, list[float]] = {i: [] for i in range(len(methods))}
    tokens: dict[int, int] = {}
    for _ in range(args.repeats):
        for i, (_, _, fn) in enumerate(methods):
            cpu0 = _cpu_seconds()
            t, seconds = fn()
            cpu[i].append(_cpu_seconds() - cpu0)
            assert tokens.setdefault(i, t) == t
            times[i].append(seconds)
    assert len(set(tokens.values())) == 1, f"methods disagree on the token count: {tokens}"

    best = {i: min(ts) for i, ts in times.items()}
    print(
        "\n| method | workers / num_proc | tokens | seconds: best (all) | tokens/s | vs bare encode_batch "
        "| CPU seconds (min) | tokens per CPU-second |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, (name, w, _) in enumerate(methods):
        runs = ", ".join(f"{r:.2f}" for r in times[i])
        print(
            f"| {name} | {w} | {tokens[i]:,} | {best[i]:.2f} ({runs}) | {tokens[i] / best[i]:,.0f} | "
            f"{best[0] / best[i]:.2f} | {min(cpu[i]):.1f} | {tokens[i] / min(cpu[i]):,.0f} |"
        )
    print()
    for i, (name, w, _) in enumerate(methods):
        if name.startswith("data_prep"):
            hf = best[i + 1]
            print(
                f"workers={w}: data_prep shard runs at {best[0] / best[i]:.0%} of bare encode_batch's speed "
                f"({best[1] / best[i]:.0%} of encode_batch_fast), {hf / best[i]:.2f}x datasets.map + save_to_disk"
            )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
