"""Evaluate a pretrained encoder on downstream tasks, and its held-out MLM loss.

    python -m pretrain.evaluate MODEL --task PATH [--test FILE] [--task word_order --data DIR] [--protocol probe|finetune]
        [--text-column text --label-column label] [--max-examples 2000] [--max-length 128]
        [--finetune-epochs 3 --finetune-lr 5e-5] [--json OUT.json] [--mlflow-run-id ID [--tracking-uri URI]]

MODEL is a Hugging Face export (``pretrain.export``, or any BERT folder) or a trainer checkpoint
(a run folder, its ``checkpoints`` folder or one ``stepNNNNNNNN`` tag), which is exported to a
temporary folder first. ``--task word_order`` builds the word-order task from ``--data``: a data_prep
folder (its validation split, decoded) or raw .txt/.jsonl text. Prints one row per task (accuracy
and macro-F1 beside the random-init and majority-class baselines), and logs the numbers to the
given MLflow run. Bad input: a message and exit code 2.

``mlm_eval`` gives the held-out MLM loss and accuracy of an export at the trainer's fixed
evaluation masking (15%, 80/10/10, fixed seed), with the unigram baseline beside them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from data_prep.common.errors import ShardError
from data_prep.common.manifest import MANIFEST, Manifest, load_manifest
from data_prep.common.storage import StorageError, is_url, open_store
from data_prep.common.tokenizer_cache import VOCABULARY_FILES
from pretrain import metric_names as names
from pretrain.checkpoint.hf_export import export_checkpoint, resolve_checkpoint
from pretrain.checkpoint.safe_load import UnsafeCheckpoint
from pretrain.config.schema import DownstreamTaskConfig
from pretrain.data.stream import check_manifest
from pretrain.eval.downstream import FinetuneSettings, baseline_metrics, finetune_metrics, prepare_tasks, probe_metrics
from pretrain.eval.heldout import eval_set_batches, figures, score
from pretrain.eval.intervals import TEST_EXAMPLES, wilson
from pretrain.eval.tasks import WORD_ORDER, TaskError
from pretrain.model.masking import SpecialIds, eval_masking_config, mask_batch
from pretrain.tracking.mlflow_existing import log_metrics_to_run, run_problem

log = logging.getLogger("pretrain")
EXIT_BAD_INPUT = 2


# ------------------------------------------------------------------------------ MLM


def unigram_token(data_dir: str | Path, manifest: Manifest, split: str = "train", max_sequences: int = 20_000) -> int:
    """The most frequent non-special token of (the first ``max_sequences`` sequences of) a split."""
    special = SpecialIds.from_manifest(manifest)
    counts = np.zeros(special.vocab_size, dtype=np.int64)
    for batch in eval_set_batches(data_dir, manifest, split, 0, 1, 512, max(1, max_sequences // 512) * 512):
        counts += np.bincount(batch["input_ids"].numpy().ravel(), minlength=special.vocab_size)
    counts[list(special.all_special)] = 0
    return int(counts.argmax())


def mlm_eval(
    hf_dir: str | Path,
    data_dir: str | Path,
    batch_size: int = 32,
    max_batches: int = 0,
    split: str = "validation",
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """{"loss", "accuracy", "unigram_accuracy"} of the export in ``hf_dir`` on ``split`` of a
    data_prep folder (see ``mlm_eval_model``)."""
    from transformers import AutoModelForMaskedLM

    manifest = load_manifest(data_dir)
    hf_model = AutoModelForMaskedLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device)
    problems = check_manifest(
        manifest,
        data_dir,
        splits=(split,),
        vocab_size=hf_model.config.vocab_size,
        seq_len_max=hf_model.config.max_position_embeddings,
    )
    if problems:
        raise TaskError("\n".join(problems))
    out = mlm_eval_model(hf_model, data_dir, manifest, batch_size, max_batches, split, device)
    out["unigram_accuracy"] = unigram_accuracy(data_dir, manifest, batch_size, max_batches, split, device)
    return out


def _eval_set(data_dir, manifest: Manifest, batch_size: int, max_batches: int, split: str) -> Iterator[dict]:
    """The first ``max_batches x batch_size`` sequences of ``split`` (all when 0): the trainer's
    evaluation set with ``train.eval_sequences`` of that size, on one process."""
    return eval_set_batches(data_dir, manifest, split, 0, 1, batch_size, max_batches * batch_size)


@torch.no_grad()
def mlm_eval_model(
    hf_model,
    data_dir: str | Path,
    manifest: Manifest,
    batch_size: int = 32,
    max_batches: int = 0,
    split: str = "validation",
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """{"loss", "accuracy"} of a Hugging Face masked LM in memory, scored by the trainer's own
    evaluation loop (``pretrain.eval.heldout.score``: its masks keyed by each sequence's id, its
    fixed-point sums), so losses compare across runs, trainers, batch sizes and world sizes; with
    the attention scope the export records (``model.attention_scope``; ``row`` for other models)."""
    # lazy: pulls in transformers' model classes (~3 s), which only the MLM evaluation needs
    from pretrain.model.mlm import SCOPE_KEY, MLMModel

    special = SpecialIds.from_manifest(manifest)
    was_training = hf_model.training
    # packed rows are scored as the model was trained on them: inside each document, or across the row
    scope = getattr(hf_model.config, SCOPE_KEY, "row")
    model = MLMModel(hf_model.eval(), sparse_head=True, attention_scope=scope, sep_id=special.sep)
    sums, _ = score(
        model,
        _eval_set(data_dir, manifest, batch_size, max_batches, split),
        special,
        eval_masking_config(),
        torch.device(device),
    )  # a read error raises (one process)
    sums = sums[:4].tolist()
    hf_model.train(was_training)
    out = figures("mlm", sums)
    if not out:
        raise TaskError(f"{data_dir}: split {split!r} gave no masked tokens")
    return {"loss": out["mlm/loss"], "accuracy": out["mlm/accuracy"]}


def unigram_accuracy(
    data_dir,
    manifest: Manifest,
    batch_size: int = 32,
    max_batches: int = 0,
    split: str = "validation",
    device: str | torch.device = "cpu",
) -> float:
    """Accuracy of always guessing the training split's most frequent token at the evaluation masks."""
    top = unigram_token(data_dir, manifest)
    special, masking = SpecialIds.from_manifest(manifest), eval_masking_config()
    hits = count = 0
    for batch in _eval_set(data_dir, manifest, batch_size, max_batches, split):
        if batch["filler"]:
            continue
        m = mask_batch(
            batch["input_ids"], batch["word_starts"], special, masking, sample_ids=batch["sample_ids"], step=0
        )
        hits, count = hits + int((m.labels == top).sum()), count + m.labels.numel()
    return hits / max(count, 1)


# ------------------------------------------------------------------------------ models


def resolve_model(path: str | Path, stack: ExitStack) -> Path:
    """An HF folder as is; a trainer checkpoint exported into a temporary folder (kept open by ``stack``)."""
    path = Path(path)
    if (path / "config.json").is_file():
        if not any((path / name).is_file() for name in VOCABULARY_FILES):
            # AutoTokenizer would quietly build a 5-token tokenizer from the config: chance-level scores.
            raise TaskError(
                f"{path}: no tokenizer files (none of {', '.join(VOCABULARY_FILES)}); copy the "
                f"tokenizer the model was trained with beside it (pretrain.export writes them)"
            )
        return path
    try:
        root, tag = resolve_checkpoint(path)
    except FileNotFoundError as exc:
        raise TaskError(
            f"{path}: neither a Hugging Face model folder (no config.json) nor a trainer checkpoint ({exc})"
        ) from exc
    out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eval-export-")))
    try:
        return export_checkpoint(root, tag, out)
    except UnsafeCheckpoint as exc:
        raise TaskError(str(exc)) from None


def evaluate_model(
    model_dir: str | Path,
    specs: list[DownstreamTaskConfig],
    protocol: str = "probe",
    data_dir: Optional[str] = None,
    device: str = "cpu",
    batch_size: int = 32,
    finetune: Optional[FinetuneSettings] = None,
) -> dict[str, float]:
    """Every task's metrics with both baselines, keyed ``downstream/<task>/...``."""
    from transformers import AutoModel

    tasks = prepare_tasks(specs, model_dir, data_dir)
    if protocol == "finetune":
        return finetune_metrics(model_dir, tasks, device, finetune or FinetuneSettings())
    no_pooler = (
        {"add_pooling_layer": False}
        if json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == "bert"
        else {}
    )  # ModernBertModel has no pooler to leave out
    encoder = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32, **no_pooler).to(device)
    return {
        **probe_metrics(encoder, tasks, device, batch_size),
        **baseline_metrics(encoder.config, tasks, device, batch_size),
    }


def format_results(metrics: dict[str, float], protocol: str) -> str:
    key = "finetune_" if protocol == "finetune" else ""
    tasks = list(dict.fromkeys(k.split("/")[1] for k in metrics))
    header = [
        "task",
        "protocol",
        "accuracy",
        "95% interval",
        "test examples",
        "macro-F1",
        "random-init acc",
        "random-init F1",
        "majority acc",
        "majority F1",
    ]

    def cells(task: str) -> list[str]:
        def value(what: str) -> float:
            return metrics[names.downstream(names.DOWNSTREAM, task, what)]

        examples = int(value(TEST_EXAMPLES))
        low, high = wilson(value(f"{key}accuracy"), examples)
        baselines = (f"{key}random_init_" if key else "random_init_", "majority_")
        return [
            task,
            protocol,
            f"{value(f'{key}accuracy'):.4f}",
            f"{low:.4f}-{high:.4f}",
            f"{examples:,}",
            f"{value(f'{key}macro_f1'):.4f}",
            *(f"{value(p + m):.4f}" for p in baselines for m in ("accuracy", "macro_f1")),
        ]

    rows = [cells(n) for n in tasks]
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header] + rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI


class _TestOf(argparse.Action):
    """``--test FILE`` after ``--task PATH``: that task's test split."""

    def __call__(self, parser, namespace, value, option_string=None):
        tasks = namespace.task or []
        tests = dict(namespace.tests or {})
        if not tasks:
            parser.error(f"--test {value}: give it after the --task it is the test split of")
        if len(tasks) - 1 in tests:
            parser.error(f"--test {value}: --task {tasks[-1]} already has --test {tests[len(tasks) - 1]}")
        if tasks[-1] == WORD_ORDER:
            parser.error(f"--test {value}: --task word_order makes its own test split from --data")
        tests[len(tasks) - 1] = value
        namespace.tests = tests


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m pretrain.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="a Hugging Face export folder or a trainer checkpoint")
    p.add_argument(
        "--task",
        action="append",
        required=True,
        help="a labelled .csv/.tsv/.jsonl file or label-folder, or 'word_order' (repeatable)",
    )
    p.add_argument(
        "--test",
        action=_TestOf,
        dest="tests",
        default={},
        metavar="FILE",
        help="the test split of the --task just before it: a file (or label-folder) of the same columns "
        "(default: a stratified --test-fraction of the task, drawn with --seed)",
    )
    p.add_argument("--protocol", choices=["probe", "finetune"], default="probe")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--data", help="held-out text for word_order: a data_prep folder or .txt/.jsonl file(s)")
    p.add_argument("--max-examples", type=int, default=2000, help="per split (0: all)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per example")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--finetune-epochs", type=int, default=3)
    p.add_argument("--finetune-lr", type=float, default=5e-5)
    p.add_argument("--finetune-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the metrics to this file")
    p.add_argument("--mlflow-run-id", help="log the metrics to this MLflow run")
    p.add_argument("--tracking-uri", default="", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    p.add_argument(
        "--step", type=int, default=None, help="MLflow step to log the metrics at (default: the run's last logged step)"
    )
    return p.parse_args(argv)


def _is_shard_folder(location: str) -> bool:
    """Whether ``location`` (a folder or a URL) holds a finalized data_prep manifest."""
    try:
        return open_store(location).stat(MANIFEST) is not None
    except StorageError as exc:
        raise TaskError(f"--data {exc}") from None


def task_specs(args) -> list[DownstreamTaskConfig]:
    specs = []
    data_is_shards = bool(args.data) and _is_shard_folder(args.data)
    for i, path in enumerate(args.task):
        spec = DownstreamTaskConfig(
            path=path,
            test_path=args.tests.get(i, ""),
            text_column=args.text_column,
            label_column=args.label_column,
            test_fraction=args.test_fraction,
            max_examples=args.max_examples,
            max_length=args.max_length,
            seed=args.seed,
        )
        if path == WORD_ORDER:
            spec.name = WORD_ORDER
            if args.data and not data_is_shards:
                spec.text_path = args.data
        problems = spec.check()
        if problems:
            raise TaskError(f"--task {path}: " + "; ".join(problems))
        specs.append(spec)
    task_names = [s.name or Path(s.path).stem for s in specs]
    if len(set(task_names)) != len(task_names):
        raise TaskError(f"--task: two tasks share a name ({task_names})")
    return specs


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()  # load reports would bury the table
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        specs = task_specs(args)
        if args.data and not is_url(args.data) and not Path(args.data).exists():
            raise TaskError(f"--data {args.data}: no such file or folder")
        problem = run_problem(args.mlflow_run_id, args.tracking_uri) if args.mlflow_run_id else None
        if problem:
            raise TaskError(problem)
        data_dir = args.data if args.data and _is_shard_folder(args.data) else None
        with ExitStack() as stack:
            model_dir = resolve_model(args.model, stack)
            settings = FinetuneSettings(
                epochs=args.finetune_epochs, lr=args.finetune_lr, batch_size=args.finetune_batch_size, seed=args.seed
            )
            metrics = evaluate_model(model_dir, specs, args.protocol, data_dir, args.device, args.batch_size, settings)
    except (TaskError, ShardError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_results(metrics, args.protocol))
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2))
    if args.mlflow_run_id:
        step = log_metrics_to_run(metrics, args.mlflow_run_id, args.tracking_uri, args.step)
        print(f"logged {len(metrics)} metrics to MLflow run {args.mlflow_run_id} at step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
