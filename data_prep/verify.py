"""``data_prep verify`` (every shard against the manifest) and ``data_prep inspect`` (totals and samples)."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .errors import DataPrepError
from .shard_format import ShardError, block_sizes, iter_blocks, load_manifest, sha256_file, tokenizer_sha256


def _load(data_dir: Path) -> dict:
    try:
        return load_manifest(data_dir)
    except ShardError as exc:
        raise DataPrepError(str(exc)) from None


def check_shard(data_dir: Path, entry: dict, manifest: dict) -> str | None:
    """None when the shard matches its manifest entry, else what is wrong (naming the shard)."""
    name, path = entry["name"], data_dir / entry["name"]
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{name}: {size} bytes, manifest says {entry['bytes']} (truncated or rewritten?)"
    if sha256_file(path) != entry["sha256"]:
        return f"{name}: sha256 differs from the manifest (corrupted)"
    seq_len, dtype = manifest["seq_len"], np.dtype(manifest["dtype"])
    pad_id = manifest["tokenizer"]["special_ids"]["pad"]
    try:
        expected = block_sizes(entry, manifest["block_size"])
        got, padding = [], 0
        for ids, starts in iter_blocks(path, seq_len):
            if ids.dtype != dtype or ids.ndim != 2 or ids.shape[1] != seq_len or starts.shape != ids.shape:
                return f"{name}: block {len(got)} is {ids.dtype} {ids.shape}, expected {dtype} [n, {seq_len}]"
            got.append(len(ids))
            padding += int(np.count_nonzero(ids == pad_id))
    except (ShardError, ValueError, OSError) as exc:
        return f"{name}: does not decode ({exc})"
    if got != expected:
        return (f"{name}: {len(got)} blocks of {sum(got)} sequences, "
                f"manifest says {entry['blocks']} of {entry['sequences']}")
    if padding != entry["padding"] or sum(got) * seq_len - padding != entry["tokens"]:
        return f"{name}: {padding} padding tokens, manifest says {entry['padding']}"
    return None


def verify(data_dir: str | os.PathLike, workers: int = 4) -> list[str]:
    """Every problem found (all shards are checked); an empty list means the data is sound."""
    data_dir = Path(data_dir)
    manifest = _load(data_dir)
    problems = []
    tok = data_dir / manifest["tokenizer"]["path"]
    if not tok.is_dir():
        problems.append(f"{tok}: tokenizer folder missing")
    elif tokenizer_sha256(tok) != manifest["tokenizer"]["sha256"]:
        problems.append(f"{tok}: tokenizer sha256 differs from the manifest")
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashing and file reads release the GIL
        results = pool.map(lambda e: check_shard(data_dir, e, manifest), manifest["shards"])
        problems.extend(r for r in results if r)
    return problems


def inspect(data_dir: str | os.PathLike, samples: int = 3, split: str = "train", file=None) -> None:
    """Print totals, padding and bytes per token, and a few decoded sequences."""
    import tokenizers

    out = file or sys.stdout
    data_dir = Path(data_dir)
    m = _load(data_dir)
    tok_info = m["tokenizer"]
    print(f"{data_dir}: seq_len {m['seq_len']}, {m['dtype']}, block_size {m['block_size']}, "
          f"{m['num_tasks']} task(s), vocab {tok_info['vocab_size']} (lowercase {tok_info['lowercase']})", file=out)
    for name, t in m["totals"].items():
        size = sum(e["bytes"] for e in m["shards"] if e["split"] == name)
        slots = t["sequences"] * m["seq_len"]
        print(f"  {name:<10} {t['shards']:>5} shards {t['sequences']:>10,} sequences {t['tokens']:>13,} tokens "
              f"{t['documents']:>9,} documents  padding {t['padding'] / max(slots, 1):.4%}  "
              f"{size / max(slots, 1):.3f} bytes/token", file=out)
    shard = next((e for e in m["shards"] if e["split"] == split), None)
    if shard is None or samples <= 0:
        return
    tok = tokenizers.Tokenizer.from_file(str(data_dir / tok_info["path"] / "tokenizer.json"))
    ids, starts = next(iter_blocks(data_dir / shard["name"], m["seq_len"]))
    for i in range(min(samples, len(ids))):
        row = ids[i].tolist()
        print(f"\n--- {shard['name']} sequence {i} ---", file=out)
        print(tok.decode(row, skip_special_tokens=False), file=out)
        pieces = [("|" if s else "") + tok.id_to_token(t) for t, s in zip(row[:40], starts[i][:40], strict=True)]
        print("tokens (| = word start): " + " ".join(pieces) + (" ..." if len(row) > 40 else ""), file=out)
