"""Downstream quality of an encoder: a linear probe on frozen features, and a short fine-tune.

* **Probe** (fast; runs during pretraining): the last hidden states, mean-pooled over the attention
  mask, feed a logistic regression (scikit-learn's L-BFGS on standardised features: deterministic
  given the features). ``probe_metrics`` is what the trainer calls on its own weights.
* **Fine-tune** (final numbers): ``AutoModelForSequenceClassification`` from an export, a few
  epochs of AdamW, then the test split.

Each reports accuracy and macro-F1 beside two baselines computed in the same call: the same
architecture with random (seeded) weights, put through the same protocol, and the majority class of
the training split. Nothing here touches the global RNG (seeded work runs under ``fork_rng``).
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from data_prep.common.manifest import Manifest
from pretrain import metric_names as names
from pretrain.config.schema import DownstreamTaskConfig
from pretrain.eval.intervals import TEST_EXAMPLES
from pretrain.eval.tasks import TaskSplits, load_task

_BASELINE_SEED = 1234


@dataclass
class PreparedTask:
    """A task tokenized once: lists of token ids per example (unpadded) and int labels."""

    name: str
    train_ids: list[list[int]]
    train_labels: np.ndarray
    test_ids: list[list[int]]
    test_labels: np.ndarray
    label_names: list[str]
    pad_id: int

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


def tokenize_task(task: TaskSplits, tokenizer, max_length: int) -> PreparedTask:
    def enc(texts):
        return tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)["input_ids"]

    return PreparedTask(
        task.name,
        enc(task.train_texts),
        task.train_labels,
        enc(task.test_texts),
        task.test_labels,
        task.label_names,
        tokenizer.pad_token_id or 0,
    )


def prepare_tasks(
    specs: Sequence[DownstreamTaskConfig],
    tokenizer_dir: str | Path,
    data_dir: Optional[str] = None,
    manifest: Optional[Manifest] = None,
) -> list[PreparedTask]:
    """Load and tokenize every task once (at start-up). ``tokenizer_dir``: the model's tokenizer,
    e.g. ``tokenizer_dir(manifest, data.dir)``. Raises ``TaskError`` naming the file."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return [tokenize_task(load_task(s, data_dir, manifest), tokenizer, s.max_length) for s in specs]


def probe_due(step: int, downstream_every: int, eval_every: int, last: bool) -> bool:
    """Whether the trainer probes at ``step``: every ``eval.downstream_every`` steps, or with every
    periodic evaluation (``train.eval_every``) when that is 0; always at the last step."""
    every = downstream_every or eval_every
    return last or bool(every and step % every == 0)


# ------------------------------------------------------------------------------ metrics


def scores(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> dict[str, float]:
    """Accuracy and macro-F1 (over the classes present in y_true or y_pred; F1 of a class with no
    true and no predicted example is undefined and left out, as scikit-learn does)."""
    acc = float(np.mean(y_true == y_pred)) if len(y_true) else float("nan")
    f1s = []
    for c in range(num_classes):
        tp = np.sum((y_pred == c) & (y_true == c))
        fp = np.sum((y_pred == c) & (y_true != c))
        fn = np.sum((y_pred != c) & (y_true == c))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": acc, "macro_f1": float(np.mean(f1s)) if f1s else float("nan")}


def majority_scores(task: PreparedTask) -> dict[str, float]:
    majority = int(np.bincount(task.train_labels, minlength=task.num_classes).argmax())
    return scores(task.test_labels, np.full_like(task.test_labels, majority), task.num_classes)


# ------------------------------------------------------------------------------ probe


def _batches(ids: list[list[int]], batch_size: int, pad_id: int):
    """Padded batches in order of length (less padding), with the examples' original indices."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        yield idx, _pad([ids[i] for i in idx], pad_id)


def _pad(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    x = torch.full((len(seqs), max(len(q) for q in seqs)), pad_id, dtype=torch.long)
    for r, q in enumerate(seqs):
        x[r, : len(q)] = torch.tensor(q)
    return x


@torch.no_grad()
def pooled_features(
    encoder: torch.nn.Module, ids: list[list[int]], device, batch_size: int = 32, pad_id: int = 0
) -> np.ndarray:
    """[N, H] fp32: last hidden states averaged over the non-padding tokens. ``encoder`` is a
    ``BertModel`` (the ``.bert`` of a ``BertForMaskedLM``) in eval mode."""
    out: Optional[np.ndarray] = None
    for idx, x in _batches(ids, batch_size, pad_id):
        x = x.to(device)
        mask = x != pad_id
        hidden = encoder(input_ids=x, attention_mask=mask).last_hidden_state.float()
        w = mask.unsqueeze(-1).float()
        pooled = ((hidden * w).sum(1) / w.sum(1).clamp(min=1.0)).cpu().numpy()
        if out is None:
            out = np.empty((len(ids), pooled.shape[1]), dtype=np.float32)
        out[idx] = pooled
    return out


def fit_probe(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, num_classes: int, c: float = 1.0
) -> np.ndarray:
    """Predicted test labels of a logistic regression on standardised features (deterministic)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(train_x)
    clf = LogisticRegression(C=c, max_iter=2000)
    clf.fit(scaler.transform(train_x), train_y)
    return clf.predict(scaler.transform(test_x)).astype(np.int64)


def probe_task(encoder: torch.nn.Module, task: PreparedTask, device, batch_size: int = 32) -> dict[str, float]:
    train_x = pooled_features(encoder, task.train_ids, device, batch_size, task.pad_id)
    test_x = pooled_features(encoder, task.test_ids, device, batch_size, task.pad_id)
    return scores(task.test_labels, fit_probe(train_x, task.train_labels, test_x, task.num_classes), task.num_classes)


def probe_metrics(
    encoder: torch.nn.Module,
    tasks: Sequence[PreparedTask],
    device,
    batch_size: int = 32,
    prefix: str = names.DOWNSTREAM,
    label: str = "",
) -> dict[str, float]:
    """``{prefix}/<task>/{label}accuracy`` and ``{prefix}/<task>/{label}macro_f1`` of a probe on
    ``encoder``'s current weights (``label`` ``init_from_``: the encoder a run started from). Deterministic given the weights; leaves the model in the mode it found it and
    the global RNG untouched. At ZeRO-3 call it on every rank inside
    ``deepspeed.zero.GatheredParameters(encoder.parameters())``."""
    was_training = encoder.training
    encoder.eval()
    try:
        out = {}
        for task in tasks:
            for k, v in probe_task(encoder, task, device, batch_size).items():
                out[names.downstream(prefix, task.name, f"{label}{k}")] = v
        return out
    finally:
        encoder.train(was_training)


def random_like(config, seed: int = _BASELINE_SEED, vocab_size: int | None = None) -> torch.nn.Module:
    """An encoder (``BertModel``, ``ModernBertModel``) with ``config``'s architecture and seeded random
    weights (global RNG untouched), in fp32 with SDPA attention whatever the run uses (flash-attn
    refuses fp32; keyed dropout's attention is the trainer's). ``vocab_size``: the tokenizer's, where
    ``config`` has more rows (a trainer pads its embedding to ``model.vocab_multiple``; its export
    has the tokenizer's rows): the rows set how the draws fall on every later weight, so a run's
    baseline and the evaluate CLI's on its export are one model only at one size."""
    from transformers import AutoModel, BertModel

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    config.vocab_size = vocab_size or config.vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if config.model_type == "bert":
            return BertModel(config, add_pooling_layer=False).eval()
        return AutoModel.from_config(config).eval()


def baseline_metrics(
    config,
    tasks: Sequence[PreparedTask],
    device,
    batch_size: int = 32,
    prefix: str = names.DOWNSTREAM,
    vocab_size: int | None = None,
) -> dict[str, float]:
    """The two baselines: ``{prefix}/<task>/random_init_{accuracy,macro_f1}`` (the probe on the same
    architecture with random weights, ``vocab_size`` rows: ``random_like``) and
    ``majority_{accuracy,macro_f1}``, and ``test_examples``, the number every accuracy of the task is
    over (``pretrain.eval.intervals``). Compute once per run."""
    model = random_like(config, vocab_size=vocab_size).to(device)
    out = {}
    for task in tasks:
        for k, v in probe_task(model, task, device, batch_size).items():
            out[names.downstream(prefix, task.name, f"random_init_{k}")] = v
        out.update(fixed_metrics(task, prefix))
    return out


def fixed_metrics(task: PreparedTask, prefix: str = names.DOWNSTREAM) -> dict[str, float]:
    """What a task's scores are measured against, whatever the encoder: the majority class's
    ``majority_{accuracy,macro_f1}`` and ``test_examples``."""
    out = {names.downstream(prefix, task.name, f"majority_{k}"): v for k, v in majority_scores(task).items()}
    out[names.downstream(prefix, task.name, TEST_EXAMPLES)] = len(task.test_labels)
    return out


# ------------------------------------------------------------------------------ fine-tune


@dataclass
class FinetuneSettings:
    epochs: int = 3
    lr: float = 5e-5
    batch_size: int = 16
    weight_decay: float = 0.01
    seed: int = 0


class StepProgress:
    """How far a fine-tune is: a tqdm bar on a terminal, else a line every ``every`` seconds (a batch
    log), each with steps done of the total, the rate and the time left. A fine-tune runs minutes to
    tens of minutes on a CPU; it said nothing before."""

    def __init__(self, label: str, total: int, every: float = 30.0, stream=None):
        self.label, self.total, self.every, self.done = label, total, every, 0
        self.stream = stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm  # lazy: only on a terminal

            self.bar = tqdm(total=total, desc=label, unit=" steps", file=self.stream, dynamic_ncols=True)

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.perf_counter()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / max(rate, 1e-9)
        return (
            f"{self.label}: step {self.done:,}/{self.total:,} ({rate:.2f} steps/s), "
            f"{int(left // 60)}m{int(left % 60):02d}s left"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def finetune_task(
    model: torch.nn.Module, task: PreparedTask, device, settings: FinetuneSettings, label: str = ""
) -> dict[str, float]:
    """Fine-tune a sequence classifier in place on the training split; scores on the test split.
    With a ``label``, says how far along it is (``StepProgress``)."""
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    steps = settings.epochs * -(-len(task.train_ids) // settings.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * max(0.0, 1 - s / steps)
    )
    labels = torch.as_tensor(task.train_labels)
    gen = np.random.default_rng(settings.seed)
    progress = StepProgress(label, steps) if label else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)  # dropout
        model.train()
        for _ in range(settings.epochs):
            order = gen.permutation(len(task.train_ids))
            for s in range(0, len(order), settings.batch_size):
                idx = order[s : s + settings.batch_size]
                x = _pad([task.train_ids[i] for i in idx], task.pad_id).to(device)
                y = labels[idx].to(device)
                loss = model(input_ids=x, attention_mask=x != task.pad_id, labels=y).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if progress is not None:
                    progress.step()
    if progress is not None:
        progress.close()
    model.eval()
    pred = np.empty(len(task.test_ids), dtype=np.int64)
    with torch.no_grad():
        for idx, x in _batches(task.test_ids, 64, task.pad_id):
            x = x.to(device)
            pred[idx] = model(input_ids=x, attention_mask=x != task.pad_id).logits.argmax(-1).cpu().numpy()
    return scores(task.test_labels, pred, task.num_classes)


def finetune_metrics(
    model_dir: str | Path,
    tasks: Sequence[PreparedTask],
    device,
    settings: FinetuneSettings = FinetuneSettings(),
    prefix: str = names.DOWNSTREAM,
) -> dict[str, float]:
    """Fine-tune the export in ``model_dir`` and, identically, the same config with random weights;
    ``{prefix}/<task>/finetune_{accuracy,macro_f1}``, ``..._random_init_...`` and ``majority_...``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = {}
    for task in tasks:
        config = AutoConfig.from_pretrained(str(model_dir), num_labels=task.num_classes)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)  # the new classifier head
            trained = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), config=config, dtype=torch.float32
            )
            torch.manual_seed(_BASELINE_SEED)
            random = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        for key, model in (("finetune", trained), ("finetune_random_init", random)):
            what = "the model" if key == "finetune" else "random weights"
            for k, v in finetune_task(model, task, device, settings, label=f"fine-tune {task.name} ({what})").items():
                out[names.downstream(prefix, task.name, f"{key}_{k}")] = v
        out.update(fixed_metrics(task, prefix))
    return out
