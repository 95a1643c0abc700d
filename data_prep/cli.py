"""``python -m data_prep`` / ``data_prep``: clean | quality-model | tokenizer | shard | finalize | verify | inspect.

Exit codes: 0 success, 1 ``verify`` found damaged shards (missing, truncated, corrupted), 2 bad input
or settings, including data that disagrees with its tokenizer (ids outside the vocabulary, a manifest
``vocab_size`` that is not the tokenizer's); the message is on stderr. 141: the reader of the output
went away (``| head``), as a shell says for a command stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from data_prep.common.errors import ShardError
from data_prep.common.storage import StorageError

from .clean.document import QualityScorer
from .clean.quality_model import TRUST_ACCURACY, Settings, train_from_files
from .clean.run import STAGES, print_summary, run_clean
from .clean.settings import QualityModelSettings, apply_overrides, build_settings
from .clean.work import input_problems
from .cleaned_folder import inspect_report, read_report
from .common.stale_shm import remove_stale
from .errors import DataPrepError
from .finalize import finalize
from .reader import ReadOptions, iter_task_documents, resolve_inputs
from .settings import TXT_MODES, ShardSettings, load_settings_file, read_yaml_mapping
from .shard import run_shard
from .tokenizer import train_tokenizer
from .txt_survey import log_txt_survey
from .verify import inspect, verify_report

_SHARD_FLAGS = {  # ShardSettings field -> (flag, type, help)
    "tokenizer": ("--tokenizer", str, "local tokenizer folder (tokenizer.json), e.g. from `data_prep tokenizer`"),
    "out": ("--out", str, "output folder for shards, task manifests and the tokenizer copy"),
    "seq_len": ("--seq-len", int, "tokens per sequence, [CLS] and [SEP] included (default 128)"),
    "num_tasks": ("--num-tasks", int, "array tasks in all (default $SLURM_ARRAY_TASK_COUNT, else 1)"),
    "task_index": ("--task-index", int, "this task, 0-based (default from $SLURM_ARRAY_TASK_ID, else 0)"),
    "text_field": ("--text-field", str, "JSON field / column holding the text (default text)"),
    "txt_mode": (
        "--txt-mode",
        str,
        "how a .txt file becomes documents: auto (default): one document per file under 32 KiB, a larger file split at blank lines; file: one per file; blocks: one per blank-line-separated block; lines: one per line",
    ),
    "hf_split": ("--hf-split", str, "split of a save_to_disk DatasetDict or hub dataset (default train)"),
    "partition": ("--partition", str, "how tasks share the input: auto (default), files, documents"),
    "seed": ("--seed", int, "shuffle and validation-split seed (default 0)"),
    "validation_fraction": ("--validation-fraction", float, "fraction of documents held out (default 0)"),
    "shard_size": ("--shard-size", int, "sequences per shard (default 16384)"),
    "group_chars": (
        "--group-chars",
        int,
        "characters per packing group: the unit of work and of packing, "
        "independent of the task count; small files are read together up to this many bytes (default 67108864)",
    ),
    "block_size": ("--block-size", int, "sequences per webdataset sample (default 256)"),
    "workers": ("--workers", int, "tokenizer processes (default 1: in-process, Rust threads use all cores)"),
    "batch_chars": ("--batch-chars", int, "characters per tokenizer batch (default 1048576)"),
    "log_every": ("--log-every", float, "seconds between progress lines in batch jobs (default 30)"),
}


_TXT_INPUT = (
    "a .txt file under 32 KiB is one document, a larger one is split at blank lines (--txt-mode); "
    "small files are read together"
)


def _percent(value: str) -> float:
    try:
        return float(value.removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a percentage such as 10 or 10%") from None


def _add_quality_model(sub) -> None:
    p = sub.add_parser(
        "quality-model",
        help="train a fastText quality classifier for data_prep clean",
        description="Train a fastText supervised classifier (bigrams, as DCLM's filter) on reference "
        "text (__label__hq) against raw text (__label__cc); writes a fastText .bin and prints "
        "precision and recall on a held-out share.",
    )
    action = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = action.add_parser("train", help="train a model")
    t.add_argument("--positive", nargs="+", required=True, metavar="GLOB", help="reference text: what to keep")
    t.add_argument(
        "--negative",
        nargs="+",
        required=True,
        metavar="GLOB",
        help="raw text to tell apart from it; 'generated': junk made of the positives' own words (their words "
        "shuffled, keyword spam, menus of their openings), as many as the positives",
    )
    t.add_argument("--out", required=True, help="the model file (.bin)")
    t.add_argument("--text-field", default="text", help="JSON field / column holding the text (default text)")
    t.add_argument("--held-out", type=float, default=0.1, help="share of each label held out (default 0.1)")
    t.add_argument("--dim", type=int, default=32, help="embedding size (default 32)")
    t.add_argument(
        "--epochs",
        type=_auto_or(int),
        default="auto",
        help="passes over the data, or auto (default): chosen on a validation share of the training "
        "documents among 5, 10, 25, 50 (fastText's 5 is tuned for hundreds of thousands of documents)",
    )
    t.add_argument(
        "--lr",
        type=_auto_or(float),
        default="auto",
        help="learning rate, falling to 0, or auto (default): chosen among 0.1 (fastText's), 0.2, 0.5",
    )
    t.add_argument(
        "--autotune-budget",
        type=int,
        default=1_000_000,
        help="document passes the auto search may spend, cheapest candidates first (default 1000000: "
        "the same choice on any machine)",
    )
    t.add_argument("--bucket", type=int, default=1_000_000, help="word-bigram hash buckets (default 1000000)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes training at once, as fastText's threads do (default 0: one per core; 1: the same "
        "bytes from the same inputs and seed, which several processes do not promise)",
    )


def _auto_or(kind):
    def parse(value: str):
        return value if value == "auto" else kind(value)

    parse.__name__ = kind.__name__  # what argparse names in its error
    return parse


def _run_quality_model(args) -> int:
    t0 = time.perf_counter()
    tune = (args.epochs == "auto", args.lr == "auto")
    settings = Settings(
        dim=args.dim,
        epochs=5 if tune[0] else args.epochs,
        lr=0.1 if tune[1] else args.lr,
        bucket=args.bucket,
        seed=args.seed,
        workers=args.workers or (os.cpu_count() or 1),
    )
    ev, pos, neg, tuned = train_from_files(
        args.positive,
        args.negative,
        Path(args.out),
        args.text_field,
        args.held_out,
        settings,
        tune,
        args.autotune_budget,
    )
    if tuned is not None and not tuned.tried:
        print(
            f"auto: fastText's {tuned.settings.epochs} epochs at lr {tuned.settings.lr:g}, untried: on "
            f"{pos + neg:,} documents one trial alone would pass --autotune-budget {args.autotune_budget:,} "
            "document passes, and a training set that large fits fastText's defaults"
        )
    elif tuned is not None:
        tried = ", ".join(f"{e} x {r:g}: {v.accuracy:.3f}" for e, r, v, _ in tuned.tried)
        print(
            f"autotuned on {tuned.validation:,} validation documents: epochs {tuned.settings.epochs}, "
            f"lr {tuned.settings.lr:g} (validation accuracy, epochs x lr: {tried})"
        )
    print(
        f"{args.out}: trained on {pos:,} positive and {neg:,} negative documents in "
        f"{time.perf_counter() - t0:.1f} s; held out {ev.documents:,}: precision {ev.precision:.3f}, "
        f"recall {ev.recall:.3f}, accuracy {ev.accuracy:.3f}, negatives kept {ev.negatives_kept:.3f} (score >= 0.5)"
    )
    if ev.removed_by_kind:  # generated negatives, made from the held-out positives
        kinds = ", ".join(f"{kind} {share:.3f}" for kind, share in ev.removed_by_kind.items())
        print(f"held-out generated negatives removed (score < 0.5), by kind: {kinds}")
    if ev.documents and ev.accuracy < TRUST_ACCURACY:
        print(
            f"warning: held-out accuracy {ev.accuracy:.3f} is below {TRUST_ACCURACY}: too low to trust this model "
            f"(at 0.5 it keeps {ev.negatives_kept:.0%} of the held-out negatives). Train longer, or on more "
            f"documents a label: {_longer_command(args)}"
        )
    return 0


def _longer_command(args) -> str:
    """This training's command with the most epochs the search tries and a rate it tries."""
    parts = ["data_prep quality-model train", "--positive", *args.positive, "--negative", *args.negative]
    parts += ["--out", args.out, "--dim", str(args.dim), "--bucket", str(args.bucket), "--epochs", "50", "--lr", "0.2"]
    if args.text_field != "text":
        parts += ["--text-field", args.text_field]
    return " ".join(p if p.startswith("data_prep ") else shlex.quote(p) for p in parts)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data_prep",
        description="Raw text -> pre-tokenized, packed webdataset shards + manifest.json for MLM pretraining.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _add_clean(sub)
    _add_clean_filters(p)
    _add_clean_output_and_tasks(p)
    _add_tokenizer(sub)
    _add_shard(sub)
    _add_finalize_verify_inspect(sub)
    _add_quality_model(sub)
    return parser


def _add_clean(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "clean",
        help="remove duplicates, other languages, low-quality pages, test-set copies",
        description="Exact and near (MinHash) duplicates, quality rules (Gopher, C4, FineWeb), a "
        "language filter (fastText lid.176) and decontamination against held-out files; "
        "writes the kept documents with all their fields as part-*.jsonl (or .parquet) "
        "and report.json. Settings: --config YAML, flags and --set on top.",
    )
    p.add_argument("--config", help="YAML file of clean settings (see configs/data/clean/default.yaml)")
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",
        dest="inputs",
        metavar="GLOB",
        help="files, globs, folders (.txt/.jsonl/.json/.parquet, .gz, s3://...), as shard reads; " + _TXT_INPUT,
    )
    p.add_argument("--out", help="output folder (or s3:// prefix) for the kept documents and report.json")
    p.add_argument("--text-field", dest="text_field", help="JSON field / column holding the text (default text)")
    p.add_argument("--txt-mode", dest="txt_mode", choices=TXT_MODES, help=_SHARD_FLAGS["txt_mode"][2])
    p.add_argument("--hf-split", dest="hf_split")
    return p


def _add_clean_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--languages",
        nargs="+",
        metavar="CODE",
        help="languages to keep (ISO 639-1, default en); 'any' turns the language filter off",
    )
    p.add_argument(
        "--decontaminate-against",
        nargs="+",
        action="extend",
        dest="decontaminate_against",
        metavar="FILE",
        help="held-out files (a downstream test set, an evaluation corpus): no kept "
        "document is an exact or near copy of one of their documents",
    )
    p.add_argument(
        "--quality-model",
        dest="quality_model",
        metavar="MODEL.bin",
        help="a fastText quality classifier (DCLM's, or from `data_prep quality-model train`), applied "
        "after deduplication",
    )
    p.add_argument(
        "--quality-threshold",
        dest="quality_threshold",
        type=float,
        help="keep documents whose score (the probability of quality_model.label, default __label__hq) is at least T",
    )
    p.add_argument(
        "--quality-keep-top",
        dest="quality_keep_top",
        type=_percent,
        metavar="P%",
        help="or keep the P percent best-scored documents (DCLM kept 10%%)",
    )


def _add_clean_output_and_tasks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", dest="output_format", choices=["jsonl", "parquet"], help="output files (default jsonl)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument(
        "--group-chars",
        dest="group_chars",
        type=int,
        help="characters per output file (a packing group, as shard's: small files read together; default 67108864)",
    )
    p.add_argument("--partition", help="how array tasks share the input: auto (default), files, documents")
    p.add_argument(
        "--stage",
        choices=STAGES,
        help="one stage of a Slurm run (launchers/slurm/submit_clean.sh); default: all of them here",
    )
    p.add_argument(
        "--num-tasks",
        dest="num_tasks",
        type=int,
        help="array tasks of every stage but clusters (default $SLURM_ARRAY_TASK_COUNT, else 1)",
    )
    p.add_argument(
        "--task-index",
        dest="task_index",
        type=int,
        help="this task, 0-based (default from $SLURM_ARRAY_TASK_ID, else 0)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting, dotted (near.bands=20, quality.min_words=50, exact.enabled=false)",
    )


def _add_tokenizer(sub) -> None:
    p = sub.add_parser(
        "tokenizer",
        help="train a BERT-style WordPiece tokenizer",
        description="Train a WordPiece tokenizer (BERT normalizer and pre-tokenizer, "
        "[PAD] [UNK] [CLS] [SEP] [MASK]) and save a folder AutoTokenizer loads.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",
        required=True,
        metavar="GLOB",
        help="files, globs, folders (.txt/.jsonl/.json/.parquet, save_to_disk) or hub:NAME; " + _TXT_INPUT,
    )
    p.add_argument("--out", required=True, help="folder to save the tokenizer in")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--lowercase", action="store_true", help="lowercase text (an uncased tokenizer)")
    p.add_argument("--min-frequency", type=int, default=2, help="least count of a merged piece (default 2)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--txt-mode", default="auto", choices=TXT_MODES, help=_SHARD_FLAGS["txt_mode"][2])
    p.add_argument("--hf-split", default="train")


def _add_shard(sub) -> None:
    p = sub.add_parser(
        "shard",
        help="tokenize, pack and write this array task's shards",
        description="Tokenize, pack into sequences of exactly --seq-len tokens, shuffle and write "
        "this task's shards and task-XXXXX.json. Flags override --config.",
    )
    p.add_argument("--config", help="YAML file of shard settings (see configs/data/)")
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",
        dest="inputs",
        metavar="GLOB",
        help="files, globs, folders (.txt/.jsonl/.json/.parquet, save_to_disk) or hub:NAME[:CONFIG]; " + _TXT_INPUT,
    )
    for name, (flag, kind, help_text) in _SHARD_FLAGS.items():
        p.add_argument(flag, dest=name, type=kind, default=None, help=help_text)


def _add_finalize_verify_inspect(sub) -> None:
    p = sub.add_parser(
        "finalize",
        help="merge task manifests into manifest.json",
        description="Merge DIR/task-*.json into DIR/manifest.json; refuses missing or inconsistent tasks.",
    )
    p.add_argument("dir")

    p = sub.add_parser(
        "verify",
        help="check every shard against manifest.json",
        description="Check the tokenizer beside the shards against the manifest (vocab_size, "
        "special ids) and every shard (presence, size, sha256, decoding, counts, every "
        "token id below the vocabulary size). Exit 2 naming each damaged shard and "
        "each disagreement between the data and its tokenizer.",
    )
    p.add_argument("dir")
    p.add_argument("--workers", type=int, default=4, help="shards checked at once (default 4)")

    p = sub.add_parser(
        "inspect",
        help="print totals and decoded samples (or a cleaning report)",
        description="Shards: totals, padding fraction, bytes per token and decoded sequences. "
        "A folder written by clean: its report and removed examples per rule.",
    )
    p.add_argument("dir")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--split", default="train")


def _shard_settings(args):
    values = load_settings_file(args.config) if args.config else {}
    for f in dataclasses.fields(ShardSettings):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return ShardSettings(**values)


def _clean_settings(args):
    values = read_yaml_mapping(args.config) if args.config else {}
    for name in (
        "inputs",
        "out",
        "text_field",
        "txt_mode",
        "hf_split",
        "output_format",
        "workers",
        "decontaminate_against",
        "group_chars",
        "partition",
    ):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.languages is not None:
        values.setdefault("language", {})
        values["language"] = {**values["language"], "keep": [] if args.languages == ["any"] else args.languages}
    model = {"path": args.quality_model, "threshold": args.quality_threshold, "keep_top": args.quality_keep_top}
    model = {k: v for k, v in model.items() if v is not None}
    if model:
        values["quality_model"] = {**(values.get("quality_model") or {}), **model}
    values = apply_overrides(values, args.set)

    def patterns(key: str) -> list[str]:
        given = values.get(key) or []
        return [given] if isinstance(given, str) else [p for p in given if isinstance(p, str)]

    # The inputs' problems with the settings', all in one error, before anything is written.
    found = input_problems(patterns("inputs"), patterns("decontaminate_against"), encoding=args.stage is None)
    model_path = (values.get("quality_model") or {}).get("path")
    if isinstance(model_path, str) and model_path and not os.path.isfile(os.path.expanduser(model_path)):
        found.append(f"--quality-model {model_path!r}: no such file")
    elif isinstance(model_path, str) and model_path and args.stage in (None, "signatures"):
        # Only where documents are scored: the later stages read the scores, not the model (a DCLM
        # model is gigabytes to load in every array task)
        label = (values.get("quality_model") or {}).get("label") or QualityModelSettings.label
        found += QualityScorer.problems(os.path.expanduser(model_path), str(label))
    return build_settings(values, where=args.config or "data_prep clean", also=found)


def _clean_task(args) -> tuple[int, int]:
    """(tasks, this task) of a staged clean: flags, else Slurm's array variables, as shard reads them."""
    if args.stage is None:
        if (args.num_tasks or 1) != 1 or (args.task_index or 0) != 0:
            raise DataPrepError(
                f"--num-tasks/--task-index go with --stage ({', '.join(STAGES)}); "
                f"without it the {len(STAGES)} stages run here as one task"
            )
        return 1, 0
    if args.stage == "clusters":
        if args.num_tasks is None:
            raise DataPrepError("--stage clusters needs --num-tasks K: the number of array tasks to wait for")
        if args.num_tasks < 1:
            raise DataPrepError(f"--num-tasks {args.num_tasks}: must be at least 1")
        return args.num_tasks, 0
    s = ShardSettings(
        inputs=["-"], tokenizer="-", out="-", num_tasks=args.num_tasks, task_index=args.task_index
    ).resolved()
    return s.num_tasks, s.task_index


def _run_clean(args) -> int:
    settings = _clean_settings(args)
    num_tasks, task = _clean_task(args)
    print_summary(run_clean(settings, args.stage, num_tasks, task), settings.out)
    return 0


def _run_tokenizer(args) -> int:
    sources = resolve_inputs(args.input)
    opts = ReadOptions(text_field=args.text_field, txt_mode=args.txt_mode, hf_split=args.hf_split)
    log_txt_survey(sources, opts, logging.getLogger("data_prep"))
    out = train_tokenizer(
        lambda: iter_task_documents(sources, "files", 1, 0, opts),  # read twice (train_tokenizer says why)
        args.out,
        args.vocab_size,
        lowercase=args.lowercase,
        min_frequency=args.min_frequency,
        inputs=[s.path if s.kind != "hub" else f"hub:{s.path}" for s in sources],
    )
    logging.getLogger("data_prep").info("tokenizer saved to %s", out)
    return 0


def _run_shard(args) -> int:
    remove_stale(["sem.mp-*"])  # a killed earlier run's worker semaphores
    result = run_shard(_shard_settings(args))
    if not result.skipped:
        logging.getLogger("data_prep").info(
            "task %d: %d packing group(s), %d shard(s) written, %d kept from an earlier run, %s documents, "
            "%.1f s -> %s",
            result.task,
            result.groups,
            result.shards_written,
            result.shards_reused,
            result.documents,
            result.seconds,
            result.manifest,
        )
    return 0


def _run_finalize(args) -> int:
    m = finalize(args.dir)
    print(
        f"{args.dir}/manifest.json: {len(m.shards)} shards from {m.num_tasks} task(s); "
        + ", ".join(f"{s}: {t['sequences']:,} sequences, {t['tokens']:,} tokens" for s, t in m.totals.items())
    )
    return 0


def _run_verify(args) -> int:
    report = verify_report(args.dir, workers=args.workers)
    for problem in report.problems:
        print(f"data_prep verify: BAD {problem}", file=sys.stderr)
    if report.mismatched:
        print(
            f"data_prep verify: error: {args.dir}: {len(report.mismatched)} disagreement(s) between the data "
            f"and its tokenizer, {len(report.damaged)} damaged shard(s)",
            file=sys.stderr,
        )
        return 2
    if report.damaged:
        print(
            f"data_prep verify: error: {len(report.damaged)} damaged or missing shard(s) in {args.dir}", file=sys.stderr
        )
        return 2
    print(f"{args.dir}: all shards verified")
    return 0


def _run_inspect(args) -> int:
    if read_report(args.dir) is not None:
        inspect_report(args.dir, samples=args.samples)
    else:
        inspect(args.dir, samples=args.samples, split=args.split)
    return 0


COMMANDS = {
    "clean": _run_clean,
    "tokenizer": _run_tokenizer,
    "shard": _run_shard,
    "finalize": _run_finalize,
    "verify": _run_verify,
    "inspect": _run_inspect,
    "quality-model": _run_quality_model,
}


class Terminated(BaseException):
    """SIGTERM (scancel, a time limit) in the main process, raised so that ``finally`` blocks run (the
    task's lock, files staged for an upload); a BaseException, so no ``except Exception`` takes it."""


def _on_sigterm(main_pid: int):
    def handler(signum, frame):
        if os.getpid() != main_pid:  # a forked worker: ends as the signal's default would end it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated()

    return handler


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s data_prep: %(message)s")
    main_thread = threading.current_thread() is threading.main_thread()  # where Python takes signals
    before = signal.signal(signal.SIGTERM, _on_sigterm(os.getpid())) if main_thread else None
    try:
        return COMMANDS[args.command](args)
    except Terminated:
        print(
            "data_prep: stopped by SIGTERM; finished work is kept, and the same command continues it",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    except (DataPrepError, ShardError, StorageError) as exc:
        print(f"data_prep: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`data_prep inspect ... | head`): not an error of ours, and no traceback.
        # Python's own advice: point stdout at /dev/null so that the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a command stopped by SIGPIPE
    finally:
        if before is not None:  # None: not set from Python, or not ours to set
            signal.signal(signal.SIGTERM, before)
