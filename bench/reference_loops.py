"""The two yardsticks ``bench/train_throughput.py`` runs beside our trainer, each in a child process
of its own (fresh thread pools and allocator, the same environment as ours):

    python bench/reference_loops.py '{"kind": "hf" | "bare", ...spec...}'

* ``hf``: ``transformers.Trainer`` + ``DataCollatorForLanguageModeling`` over the shards'
  ``input_ids``, ``BertForMaskedLM`` from the same ``BertConfig`` as ours (SDPA attention): what
  ``run_mlm.py`` does. Its MLM head runs on every token.
* ``bare``: the efficiency yardstick, a plain PyTorch loop around *our* model (``build_model``:
  same shape, same sparse head, the same keyed dropout and fixed prediction slots, the same attention
  scope) with our data stream and masking: forward, backward, clip,
  ``torch.optim.AdamW``, schedule. No engine, no collectives, no logging. bf16 is
  ``torch.autocast`` over fp32 weights (what a plain PyTorch user writes). On the GPU where CUDA is
  (``bench/gpu_smoke.sh``'s yardsticks), reading the loss once a step, as such a loop does.

A spec's ``training_args`` (HF only) add to ``TrainingArguments``: ``{"torch_compile": true}``.
``"profile": [FIRST, STEPS]`` (bare only) takes ``torch.profiler`` over steps FIRST to FIRST + STEPS - 1
(counted from 1) into ``out_dir/profile/``, as our trainer's ``impl.profile_at_step`` does: the same
summary and a trace for bench/profile_kernels.py.

Both write ``result.json`` into the spec's ``out_dir``: wall and CPU time at the end of every
optimiser step, and the last loss.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _write_result(spec: dict, ends: list[float], cpu: list[float], loss: float) -> None:
    (Path(spec["out_dir"]) / "result.json").write_text(
        json.dumps({"step_end_unix": ends, "step_end_cpu": cpu, "final_loss": loss})
    )


def hf_mlm_trainer(
    shards: Path,
    cfg,
    batch_size: int,
    precision: str,
    threads: int,
    out_dir: str | Path,
    callbacks: list,
    **training_args,
):
    """The Hugging Face recipe both benches compare with (``run_mlm.py``): ``Trainer`` +
    ``DataCollatorForLanguageModeling(mlm_probability=masking.rate)`` over the shards' train
    ``input_ids``, ``BertForMaskedLM`` from the same ``BertConfig`` as ours (SDPA), the optimiser
    hyperparameters of ``cfg.optim``. ``training_args`` add to or replace ``TrainingArguments``."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from data_prep.common.manifest import load_manifest
    from data_prep.common.shards import iter_blocks
    from data_prep.common.tokenizer_cache import tokenizer_dir
    from pretrain.model.masking import SpecialIds
    from pretrain.model.mlm import bert_config

    torch.set_num_threads(threads)
    manifest = load_manifest(shards)
    special = SpecialIds.from_manifest(manifest)
    ids = np.concatenate(
        [
            block
            for entry in sorted(manifest.shards_of("train"), key=lambda s: s.name)
            for block, _ in iter_blocks(shards / entry.name, manifest.seq_len)
        ]
    )
    ids = torch.from_numpy(ids.astype(np.int64))

    class Sequences(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "attention_mask": (ids[i] != special.pad).long()}

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(manifest, shards))
    if tokenizer.mask_token_id != special.mask or len(tokenizer) != manifest.tokenizer.vocab_size:
        raise RuntimeError(f"{shards}: the shard folder's tokenizer disagrees with its manifest")
    torch.manual_seed(cfg.train.seed)
    model = BertForMaskedLM(bert_config(cfg.model, manifest.tokenizer.vocab_size, special, "sdpa"))
    o = cfg.optim
    kwargs = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=batch_size,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.grad_clip,
        warmup_steps=o.warmup_steps,
        lr_scheduler_type=o.schedule,
        optim="adamw_torch",
        bf16=precision == "bf16",
        use_cpu=not torch.cuda.is_available(),
        seed=cfg.train.seed,
        dataloader_num_workers=0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**(kwargs | training_args)),
        train_dataset=Sequences(),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=cfg.masking.rate),
        callbacks=callbacks,
    )
    return trainer, tokenizer


def hf_worker(spec: dict) -> None:
    from transformers import TrainerCallback

    from pretrain.config.schema import load_config

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.cpu: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())
            self.cpu.append(time.process_time())

    if spec.get("keep_freed_memory"):  # what our trainer does on a CPU, for comparison
        from pretrain.runtime.hardware import keep_freed_cpu_memory

        keep_freed_cpu_memory()
    timer = StepTimer()
    trainer, _ = hf_mlm_trainer(
        Path(spec["shards"]),
        load_config(spec["config"], spec["overrides"]),
        spec["batch_size"],
        spec["precision"],
        spec["threads"],
        spec["out_dir"],
        [timer],
        max_steps=spec["steps"],
        gradient_accumulation_steps=spec["grad_accum"],
        optim=spec["optim"],
        logging_strategy="steps",
        logging_steps=spec["warmup_steps"],
        **spec.get("training_args", {}),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _write_result(spec, timer.ends, timer.cpu, losses[-1] if losses else float("nan"))


def bare_worker(spec: dict) -> None:
    import torch

    from data_prep.common.manifest import load_manifest
    from pretrain.config.schema import load_config
    from pretrain.data.stream import TrainStream
    from pretrain.model import keyed_dropout
    from pretrain.model.masking import SpecialIds, mask_batch
    from pretrain.model.mlm import build_model
    from pretrain.model.schedule import lr_schedule
    from pretrain.runtime.profiling import StepProfiler

    torch.set_num_threads(spec["threads"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shards = Path(spec["shards"])
    manifest = load_manifest(shards)
    special = SpecialIds.from_manifest(manifest)
    cfg = load_config(spec["config"], spec["overrides"])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, manifest.tokenizer.vocab_size, special, cfg.impl, seq_len=manifest.seq_len)
    # Like for like with ours (issue 84, item 0c): the same keyed dropout and fixed prediction slots.
    model.dropout_key = keyed_dropout.install(model.hf_model, cfg.train.seed, cfg.impl.dropout_hash == "per_element")
    model.fixed_predictions = cfg.masking.fixed_count
    model.to(device)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        fused=spec["fused"],
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    forward = torch.compile(model) if spec["compile"] else model
    batches = iter(
        TrainStream(
            shards, manifest, "train", 0, 1, spec["batch_size"], spec["batch_size"] * spec["grad_accum"], cfg.data.seed
        )
    )
    ends, cpu, loss = [], [], float("nan")
    first, count = spec.get("profile") or (0, 0)
    profiler = StepProfiler(first, count, spec["out_dir"], 0, device) if count else None
    model.train()
    for step in range(spec["steps"]):
        if profiler:
            profiler.before_step(step)
        for micro in range(spec["grad_accum"]):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items() if torch.is_tensor(v)}
            model.key_dropout(batch["sample_ids"], step)
            m = mask_batch(
                batch["input_ids"],
                batch["word_starts"],
                special,
                cfg.masking,
                sample_ids=batch["sample_ids"],
                step=step,
            )
            with torch.autocast(device.type, torch.bfloat16, enabled=spec["precision"] == "bf16"):
                loss_sum, _, count = forward(m.input_ids, batch["input_ids"] != special.pad, m.positions, m.labels)
            loss_sum = loss_sum / count.clamp(min=1) / spec["grad_accum"]
            loss_sum.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(loss_sum.detach()) * spec["grad_accum"]
        ends.append(time.time())
        cpu.append(time.process_time())
    if profiler:
        profiler.stop(spec["steps"])
    _write_result(spec, ends, cpu, loss)


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    {"hf": hf_worker, "bare": bare_worker}[job["kind"]](job)
