"""What one training step asks of a GPU's host, by phase: ops dispatched, kernel launches and waits for
the device, for ours (``pretrain.step.train_step``) against DeepSpeed's engine alone and a bare PyTorch
loop, on the same model, in one run. The counts are exact on any machine (a CPU will do):

    python bench/step_ops.py                                  # configs/base.yaml (BERT-base), bf16, ZeRO 1
    python bench/step_ops.py --micro-batches 1 --set impl.zero_stage=2

* **ops**: every aten op dispatched (``TorchDispatchMode``), views included: each costs host time.
* **launches**: what the ops would launch on a GPU: not views, not allocations; a multi-tensor
  (``_foreach_*``, ``_fused_*``) op counted as CUDA's multi-tensor kernel splits it (at most 110/64/48/
  36/30 tensors for 1-5 lists and 320 blocks of 65,536 elements a launch: ``MultiTensorApply.cuh``).
* **waits**: what would make the host wait for the device: a read of a tensor's value (``item``,
  ``tolist``, ``bool``, ...), a device synchronisation, a tensor made from host values on the device;
  counted where ``pretrain/`` or DeepSpeed asks (the loader's host-side tensors are not counted).

Eager (``impl.compile=false``): compiled, the forward's and backward's elementwise ops fuse (fewer
launches there), while the mask, sync and optimizer phases, where the loops differ, are the same.
DeepSpeed's engine alone: ``deepspeed.initialize`` with our JSON but DeepSpeed's defaults (its
throughput timer on) and none of ``pretrain/runtime/engine.py``'s patches; built first, before they
apply. Each loop masks with ``mask_batch`` on the device; ours masks a step's micro-batches at once.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import ensure_sample_shards, format_table  # noqa: E402
from bench.step_profile import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PHASES = ("mask", "forward", "backward", "sync", "optimizer", "other")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy")
HOST_ONLY = ("pretrain/data/", "pretrain/guards/bad_input.py")
# The step before's decision, read from the host memory it was copied to behind that step's work
# (pretrain/step.py, "Deferred reads"): on a GPU the device is past it, and nothing queued is drained.
BEHIND = ("pretrain/step.py", "read_deferred")
MAX_TENSORS = (110, 64, 48, 36, 30)  # a multi-tensor launch's tensors, by its number of lists
MAX_BLOCKS, CHUNK = 320, 65536
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros_like"}


def multi_tensor_launches(lists: list[list[torch.Tensor]]) -> int:
    """Launches of CUDA's multi-tensor apply over ``lists``: a launch when its tensors or its blocks
    are full, the last tensor's chunks carried over."""
    limit, launches, tensors, blocks = MAX_TENSORS[min(len(lists), 5) - 1], 0, 0, 0
    for t in lists[0]:
        tensors += 1
        chunks = max(1, math.ceil(t.numel() / CHUNK))
        for c in range(chunks):
            blocks += 1
            if blocks == MAX_BLOCKS or (tensors == limit and c == chunks - 1):
                launches, blocks = launches + 1, 0
                tensors = 0 if c == chunks - 1 else 1
    return launches + (blocks > 0)


def _launches(func, args) -> int:
    name = func.__name__.split(".")[0]
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if lists and (name.startswith("_foreach_") or name.startswith("_fused_")):
        return multi_tensor_launches(lists)
    if name in ALLOCATIONS or name == "_local_scalar_dense":
        return 0
    is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    return 0 if is_view else 1


def _asked_by_us(frame) -> bool:
    """The caller is ours (not a host-only data path) or DeepSpeed's."""
    name = frame.f_code.co_filename
    if "deepspeed" in name:
        return True
    try:
        rel = Path(name).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return False
    if (rel, frame.f_code.co_name) == BEHIND:
        return False
    return rel.startswith(("pretrain/", "bench/step_ops.py")) and not rel.startswith(HOST_ONLY)


class StepCounts(TorchDispatchMode):
    """Ops, launches and waits, by the phase ``current`` names."""

    def __init__(self):
        super().__init__()
        self.current, self.counting = "other", False
        self.by_phase: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            c = self.by_phase[self.current]
            c["ops"] += 1
            c["launches"] += _launches(func, args)
        return func(*args, **(kwargs or {}))

    def wait(self, depth: int = 2) -> None:
        if self.counting and _asked_by_us(sys._getframe(depth)):
            self.by_phase[self.current]["waits"] += 1

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, self.current = self.current, name
        try:
            yield
        finally:
            self.current = outer


def count_waits(counts: StepCounts) -> None:
    """Every way of waiting for the device reports to ``counts`` (for the rest of the process)."""

    def reading(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            counts.wait()
            return original(self, *args, **kwargs)

        return read

    def synchronising(original):
        def synchronize(*args, **kwargs):
            counts.wait()
            return original(*args, **kwargs)

        return synchronize

    original_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            counts.wait()
        return original_tensor(*args, **kwargs)

    for name in READS:
        setattr(torch.Tensor, name, reading(name))
    torch.tensor = tensor
    torch.cuda.synchronize = synchronising(torch.cuda.synchronize)
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    for accelerator in (CPU_Accelerator, CUDA_Accelerator):
        accelerator.synchronize = synchronising(accelerator.synchronize)


def _masked(setup, step: int, batch: dict):
    from pretrain.model.masking import mask_batch

    device, special = setup.info.device, setup.special
    on_device = {k: batch[k].to(device, non_blocking=True) for k in ("input_ids", "word_starts", "sample_ids")}
    m = mask_batch(
        on_device["input_ids"],
        on_device["word_starts"],
        special,
        setup.cfg.masking,
        sample_ids=on_device["sample_ids"],
        step=step,
    )
    attention_mask = (on_device["input_ids"] != special.pad) if batch.get("has_padding", True) else None
    return m, attention_mask


def ours(setup, counts: StepCounts):
    """The trainer's own step, its phases named by ``pretrain.step``'s ``phase()``."""
    import pretrain.step as step_module
    from pretrain.model import keyed_dropout

    step_module.phase = counts.phase
    c = setup.cfg
    # as pretrain/run.py builds the model: dropout keyed by sample, the masked count fixed
    setup.model.dropout_key = keyed_dropout.install(
        setup.model.hf_model, c.train.seed, c.impl.dropout_hash == "per_element"
    )
    setup.model.fixed_predictions = c.masking.fixed_count
    parts = step_module.StepParts(
        setup.engine,
        setup.optimizer,
        setup.model,
        setup.info.device,
        1,
        setup.special,
        c.masking,
        c.train.max_steps,
        c.impl.zero_stage,
        step_module.StopSignal(),
        deferred_reads=step_module.deferrable(setup.optimizer),
    )
    before: list = [None]  # the step that logged nothing before: this one reads its decision

    def one(step: int, batches: list[dict]) -> None:
        before[0] = step_module.train_step(parts, step, batches, False, None, before[0], defer=True)

    return one


def deepspeed_alone(engine, setup, counts: StepCounts):
    """A DeepSpeed user's loop: per micro-batch, mask, ``engine(...)``, ``backward``, ``step``."""

    def one(step: int, batches: list[dict]) -> None:
        for batch in batches:
            with counts.phase("mask"):
                m, attention_mask = _masked(setup, step, batch)
            with counts.phase("forward"):
                loss_sum, _, count = engine(m.input_ids, attention_mask, m.positions, m.labels)
            with counts.phase("backward"):
                engine.backward(loss_sum / count.clamp(min=1))
            with counts.phase("optimizer"):
                engine.step()

    return one


def bare(setup, counts: StepCounts):
    """The model, autocast, torch's AdamW, clipping and schedule; nothing else."""
    model, optimizer, cfg = setup.model, setup.optimizer, setup.cfg

    def one(step: int, batches: list[dict]) -> None:
        for batch in batches:
            with counts.phase("mask"):
                m, attention_mask = _masked(setup, step, batch)
            with (
                counts.phase("forward"),
                torch.autocast(setup.info.device.type, torch.bfloat16, enabled=setup.precision == "bf16"),
            ):
                loss_sum, _, count = model(m.input_ids, attention_mask, m.positions, m.labels)
            with counts.phase("backward"):
                (loss_sum / count.clamp(min=1) / len(batches)).backward()
        with counts.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            setup.scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    return one


def counted(counts: StepCounts, setup, one_step, micro_batches: int, warmup: int, steps: int) -> dict:
    """Per phase, the counts of the steps after ``warmup``, divided by ``steps``; the batches are read
    before each step (the loader is not what is counted)."""
    counts.by_phase.clear()
    for step in range(warmup + steps):
        batches = [next(setup.batches) for _ in range(micro_batches)]
        counts.counting = step >= warmup
        one_step(step, batches)
        counts.counting = False
    return {p: {k: v / steps for k, v in counts.by_phase[p].items()} for p in PHASES}


def table(results: dict[str, dict]) -> str:
    header = ["phase"] + [f"{loop}: {what}" for loop in results for what in ("ops", "launches", "waits")]
    rows = []
    for p in (*PHASES, "total"):
        row = [p]
        for by_phase in results.values():
            got = by_phase[p] if p != "total" else Counter()
            if p == "total":
                for c in by_phase.values():
                    got.update(c)
            row += [f"{got.get(k, 0):,.0f}" for k in ("ops", "launches", "waits")]
        rows.append(row)
    return format_table(header, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/base.yaml")
    p.add_argument("--micro-batch", type=int, default=4, help="rows of a micro-batch (the counts barely move)")
    p.add_argument("--micro-batches", type=int, default=8, help="a step's (base.yaml at 8 GPUs: 4; at 1: 32)")
    p.add_argument("--steps", type=int, default=2, help="counted, after two steps of warm-up")
    p.add_argument("--work-dir", default="/tmp/bench_step_ops")
    p.add_argument("--data", help="a shard folder (default: the embedded sample's, written in --work-dir)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = p.parse_args()
    shards = Path(args.data) if args.data else ensure_sample_shards(args.work_dir)
    overrides = [
        f"data.dir={shards}",
        "impl.precision=bf16",
        "impl.compile=false",
        "impl.num_workers=0",
        f"train.out_dir={args.work_dir}/run",
        "tracking.backend=none",
        f"impl.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch * args.micro_batches}",
        *args.set,
    ]
    import deepspeed

    from pretrain.runtime import engine as eng

    counts = StepCounts()
    results = {}
    # DeepSpeed alone first: pretrain/runtime/engine.py's patches apply from our first engine on.
    plain = build(Path(args.config), overrides, shards, bare=True)
    ds = eng.deepspeed_config(plain.cfg, 1, plain.precision, num_params=eng.num_parameters(plain.model))
    ds.pop("timers")
    engine, *_ = deepspeed.initialize(model=plain.model, optimizer=plain.optimizer, config=ds)
    count_waits(counts)
    loops = [("DeepSpeed alone", plain, lambda s: deepspeed_alone(engine, s, counts))]
    loops += [("ours", None, lambda s: ours(s, counts)), ("bare loop", None, lambda s: bare(s, counts))]
    for name, setup, make in loops:  # each built after the one before has run
        setup = setup or build(Path(args.config), overrides, shards, bare=name == "bare loop")
        with counts:
            results[name] = counted(counts, setup, make(setup), args.micro_batches, 2, args.steps)
    cfg = plain.cfg
    print(
        f"{args.config} ({cfg.model.num_layers} x {cfg.model.hidden_size}), bf16, eager, ZeRO {cfg.impl.zero_stage}, "
        f"{args.micro_batches} micro-batches of {args.micro_batch} a step, one process; a step's counts:"
    )
    print(table(results))


if __name__ == "__main__":
    main()
