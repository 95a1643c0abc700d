"""A folder of small files against the same text in one JSONL file: ``data_prep clean`` and ``shard``.

    python bench/small_files.py [--files 100000] [--work /tmp/small_files]

People bring their own corpus as a folder of one-article ``.txt`` files (news, a scraped site, a
crawl). The corpus: ``--files`` files, the embedded Wikipedia articles in turn (a copy number in the
headline after the first 10,033), each a headline line, a blank line and paragraphs of two sentences
between blank lines (``data_prep.sample_corpus.write_article_files``'s layout); the alternative: the
same texts, one per line, in one ``.jsonl`` file (what a user would have to write by hand). Both run
through the real command line (``python -m data_prep``), one after the other, each a fresh process;
printed: wall seconds, the ratio files / JSONL, and for the shards their count, padding and bytes
per token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.sample_corpus import bert_uncased_dir, wiki_articles  # noqa: E402


def make_corpus(work: Path, n: int) -> tuple[Path, Path]:
    folder, jsonl = work / "files", work / "all.jsonl"
    if (work / ".built").is_file() and len(list(folder.iterdir())) == n:
        return folder, jsonl
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    articles = wiki_articles()
    with open(jsonl, "w", encoding="utf-8") as out:
        for i in range(n):
            title, text = articles[i % len(articles)]
            copy = i // len(articles)
            sentences = text.replace("\n", " ").replace(". ", ".\0").split("\0")
            paragraphs = [" ".join(sentences[k : k + 2]) for k in range(0, len(sentences), 2)]
            body = "\n\n".join([f"{title} ({copy})" if copy else title, *paragraphs]) + "\n"
            (folder / f"{i:06d}.txt").write_text(body, encoding="utf-8")
            out.write(json.dumps({"text": body}, ensure_ascii=False) + "\n")
    (work / ".built").touch()
    return folder, jsonl


def timed(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "data_prep", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"data_prep {' '.join(args)} -> {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def shard_facts(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    tokens = sum(t["tokens"] for t in m["totals"].values())
    sequences = sum(t["sequences"] for t in m["totals"].values())
    tar_bytes = sum(p.stat().st_size for p in out.glob("*.tar"))
    padding = sum(t["padding"] for t in m["totals"].values()) / (sequences * m["seq_len"])
    return {"shards": len(m["shards"]), "padding": padding, "bytes_per_token": tar_bytes / tokens}


def run(work: Path, n: int) -> None:
    t0 = time.perf_counter()
    folder, jsonl = make_corpus(work, n)
    print(
        f"corpus: {n:,} files, {sum(p.stat().st_size for p in folder.iterdir()) / 1e6:.1f} MB "
        f"({time.perf_counter() - t0:.0f} s to write)",
        flush=True,
    )
    rows = {}
    for name, source in (("files", folder), ("jsonl", jsonl)):
        clean, shards = work / f"clean-{name}", work / f"shards-{name}"
        shutil.rmtree(clean, ignore_errors=True)
        shutil.rmtree(shards, ignore_errors=True)
        mode = ["--txt-mode", "file"] if name == "files" else []
        t_clean = timed("clean", "--input", str(source), "--out", str(clean), *mode)
        t_shard = timed(
            "shard",
            "--input",
            str(source),
            "--tokenizer",
            str(bert_uncased_dir()),
            "--out",
            str(shards),
            "--validation-fraction",
            "0.01",
            *mode,
        )
        timed("finalize", str(shards))
        rows[name] = {"clean_s": t_clean, "shard_s": t_shard, **shard_facts(shards)}
        print(f"{name}: {rows[name]}", flush=True)
    print(f"\n{'':8} {'clean s':>9} {'shard s':>9} {'shards':>7} {'padding':>8} {'bytes/token':>12}")
    for name, r in rows.items():
        print(
            f"{name:8} {r['clean_s']:9.1f} {r['shard_s']:9.1f} {r['shards']:7d} {r['padding']:8.2%} "
            f"{r['bytes_per_token']:12.2f}"
        )
    f, j = rows["files"], rows["jsonl"]
    print(
        f"files / jsonl: clean {f['clean_s'] / j['clean_s']:.2f}x, shard {f['shard_s'] / j['shard_s']:.2f}x, "
        f"bytes/token {f['bytes_per_token'] / j['bytes_per_token']:.3f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--work", default="/tmp/small_files")
    a = p.parse_args()
    run(Path(a.work), a.files)


if __name__ == "__main__":
    main()
