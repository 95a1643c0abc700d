"""A corpus as people bring it: a folder of small text files, one article each (issue 82).

Small files are read together in bundles (``data_prep.reader.bundle_sources``), so a folder of
articles packs, shards and cleans as the same text in one JSONL file does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_prep.cli import main
from data_prep.common.manifest import load_manifest
from data_prep.finalize import finalize
from data_prep.reader import Source, bundle_sources, resolve_inputs
from data_prep.settings import ShardSettings
from data_prep.shard import run_shard

REPO = Path(__file__).resolve().parents[2]


def shard(inputs, tokenizer, out: Path, num_tasks: int = 1, **kw) -> Path:
    for i in range(num_tasks):
        run_shard(
            ShardSettings(
                inputs=[str(p) for p in inputs],
                tokenizer=str(tokenizer),
                out=str(out),
                num_tasks=num_tasks,
                task_index=i,
                **kw,
            )
        )
    finalize(out)
    return out


def as_jsonl(files_dir: Path, path: Path) -> Path:
    """The same documents, one file's text per line, in the files' sorted order."""
    with open(path, "w", encoding="utf-8") as f:
        for p in sorted(files_dir.glob("*.txt")):
            f.write(json.dumps({"text": p.read_text(encoding="utf-8")}) + "\n")
    return path


def tars(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}


def test_small_files_shard_into_the_bytes_one_jsonl_file_gives(tmp_path, wiki_article_files, bert_uncased_dir):
    """600 one-article files: the same shards, byte for byte, as the 600 texts in one JSONL file (one
    packing group, one shard per split), not a group, a padded row and a shard per file."""
    kw = dict(txt_mode="file", validation_fraction=0.1, seed=3, shard_size=4096)
    files = shard([wiki_article_files], bert_uncased_dir, tmp_path / "files", **kw)
    one = shard([as_jsonl(wiki_article_files, tmp_path / "all.jsonl")], bert_uncased_dir, tmp_path / "one", **kw)
    assert tars(files) == tars(one) and len(tars(files)) == 2
    m = load_manifest(files)
    assert m.totals == load_manifest(one).totals
    assert sum(t["documents"] for t in m.totals.values()) == 600
    # at most the last row of each split padded: a few percent, where a row per file padded ~35%
    padding = sum(t["padding"] for t in m.totals.values()) / sum(t["sequences"] for t in m.totals.values()) / 128
    assert padding < 0.01


def test_bundles_do_not_depend_on_the_task_count(tmp_path, wiki_article_files, bert_uncased_dir):
    """Bundles of small files (20 kB each here) dealt to 3 array tasks write the files 1 task writes."""
    kw = dict(txt_mode="file", validation_fraction=0.1, seed=3, shard_size=64, group_chars=20_000)
    single = shard([wiki_article_files], bert_uncased_dir, tmp_path / "k1", **kw)
    three = shard([wiki_article_files], bert_uncased_dir, tmp_path / "k3", num_tasks=3, partition="files", **kw)
    assert tars(single) == tars(three) and len(tars(single)) >= 20
    groups = [tuple(g) for i in range(3) for g in json.loads((three / f"task-{i:05d}.json").read_text())["groups"]]
    assert len(groups) == len(set(groups)) and len({g[0] for g in groups}) >= 10


def test_bundle_rule():
    """Consecutive small text files up to the size; a large file, a parquet file or a hub dataset alone."""

    def src(name: str, size: int, kind: str = "txt") -> Source:
        return Source(kind, f"/d/{name}", size)

    sources = [src("a", 40), src("b", 40), src("c", 40), src("big", 500), src("d", 10), src("p", 5, "parquet")]
    sources += [src("e", 30, "jsonl"), src("f", 90, "json")]
    names = [[s.path[3:] for s in b] for b in bundle_sources(sources, 100)]
    assert names == [["a", "b", "c"], ["big"], ["d"], ["p"], ["e", "f"]]
    assert bundle_sources([], 100) == []


def test_small_files_clean_as_one_jsonl_file(tmp_path, wiki_article_files):
    """Cleaning 600 files writes one part file of the same kept texts a JSONL file of them gives."""
    jsonl = as_jsonl(wiki_article_files, tmp_path / "all.jsonl")
    reports = {}
    for name, source in (("files", wiki_article_files), ("jsonl", jsonl)):
        argv = ["clean", "--input", str(source), "--out", str(tmp_path / name), "--txt-mode", "file"]
        assert main([*argv, "--workers", "1"]) == 0
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    assert [f["name"] for f in reports["files"]["files"]] == ["part-s00000-g00000.jsonl"]
    kept = {
        name: [json.loads(line)["text"] for line in (tmp_path / name / "part-s00000-g00000.jsonl").open()]
        for name in reports
    }
    assert kept["files"] == kept["jsonl"] and 500 < len(kept["files"]) <= 600
    assert reports["files"]["totals"] == reports["jsonl"]["totals"]


def test_input_list_is_sorted(tmp_path):
    for name in ("b.txt", "a.txt"):
        (tmp_path / name).write_text("x\n")
    assert [Path(s.path).name for s in resolve_inputs([str(tmp_path)])] == ["a.txt", "b.txt"]


def test_a_folder_of_articles_is_a_document_per_file_by_default(tmp_path, wiki_article_files, bert_uncased_dir, caplog):
    """--txt-mode auto: a file under 32 KiB is one document; the run says so in its first lines."""
    caplog.set_level("INFO", logger="data_prep")
    out = shard([wiki_article_files], bert_uncased_dir, tmp_path / "out", shard_size=4096)
    assert load_manifest(out).totals["train"]["documents"] == 600
    said = [r.getMessage() for r in caplog.records]
    assert "reading 600 .txt file(s) (--txt-mode auto: a file under 32 KiB is one document, a larger one is " in said[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said[0].endswith(": 600 as one document each") and not [w for w in warnings if "txt-mode" in w]
    # no validation split: said before any work, as the trainer will have no held-out evaluation
    assert warnings == [
        "WARNING: --validation-fraction 0: no validation split, so no held-out evaluation in training "
        "(--validation-fraction 0.01 holds 1% of the documents out)"
    ]


def test_a_rule_that_looks_wrong_is_warned_about(tmp_path, wiki_article_files, wiki_txt_dir, bert_uncased_dir, caplog):
    """Articles split at blank lines: headlines and paragraphs, counted and warned about before any work;
    the sample corpus's large files of blank-line-separated articles: split, no warning."""
    caplog.set_level("INFO", logger="data_prep")
    out = shard([wiki_article_files], bert_uncased_dir, tmp_path / "blocks", txt_mode="blocks", shard_size=4096)
    documents = load_manifest(out).totals["train"]["documents"]
    assert documents > 1000
    said = [r.getMessage() for r in caplog.records]
    head = "reading 600 .txt file(s) (--txt-mode blocks): 600 split at blank lines into ~"
    assert said[0].startswith(head) and "documents (counted in 200 of them, median " in said[0]
    estimate = int(said[0][len(head) :].split()[0].replace(",", ""))
    assert 0.8 * documents < estimate < 1.2 * documents
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "txt-mode" in r.getMessage()]
    assert len(warnings) == 1 and "if each file is one document, use --txt-mode file" in warnings[0]
    caplog.clear()
    out = shard([wiki_txt_dir], bert_uncased_dir, tmp_path / "wiki", shard_size=4096)
    assert load_manifest(out).totals["train"]["documents"] == 1000
    said = [r.getMessage() for r in caplog.records]
    assert (
        said[0].startswith("reading 4 .txt file(s) (--txt-mode auto: ")
        and ": 4 split at blank lines into ~1,000 documents" in said[0]
    )
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "txt-mode" in r.getMessage()]


def test_lines_rule(tmp_path):
    from data_prep.reader import ReadOptions, iter_source

    (tmp_path / "a.txt").write_text("one line\n\ntwo line\r\nthree\n")
    (source,) = resolve_inputs([str(tmp_path / "a.txt")])
    assert list(iter_source(source, ReadOptions(txt_mode="lines"))) == ["one line", "two line", "three"]
    assert list(iter_source(source, ReadOptions(txt_mode="blocks"))) == ["one line", "two line\nthree"]
    assert list(iter_source(source, ReadOptions())) == ["one line\n\ntwo line\r\nthree\n"]


def test_jsonl_shards_from_before_auto_stay_finished(tmp_path, bert_uncased_dir):
    """A task manifest written when --txt-mode blocks was the default, of inputs the rule does not touch,
    is still the same settings: nothing is redone or refused."""
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(50))
    )
    out = tmp_path / "out"
    shard([tmp_path / "a.jsonl"], bert_uncased_dir, out, txt_mode="blocks")
    again = run_shard(ShardSettings(inputs=[str(tmp_path / "a.jsonl")], tokenizer=str(bert_uncased_dir), out=str(out)))
    assert again.skipped


@pytest.mark.slow
def test_inspect_into_a_reader_that_went_away_ends_without_a_traceback(shards):
    """`data_prep inspect DIR | head` ended in a BrokenPipeError traceback. `| true` closes the pipe
    before the first write (Python starts in over a second), as head does after its lines."""
    import subprocess
    import sys

    script = f"{sys.executable} -m data_prep inspect {shards} --samples 20 | true; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_a_clean_with_other_settings_leaves_no_folder_of_the_old_ones(tmp_path, wiki_article_files):
    out = tmp_path / "out"
    for languages in (["en"], ["any"]):
        argv = ["clean", "--input", str(wiki_article_files), "--out", str(out), "--workers", "1"]
        assert main([*argv, "--languages", *languages]) == 0
    assert len(list((out / ".clean").iterdir())) == 1
