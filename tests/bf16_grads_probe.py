"""Run as a script: one rank of ZeRO 1 in bf16 (DeepSpeed's BF16_Optimizer, base.yaml's path) built by
the trainer's own engine module, two micro-batches, and after each backward the fp32 gradients it
accumulated (through ``pretrain/runtime/engine.py``'s multi-tensor ``update_hp_grads``) compared with
what DeepSpeed's own ``update_hp_grads`` makes of the same bf16 gradients from the same start; and the
calls ours makes, against what CUDA's multi-tensor kernels take (one launch for many tensors only where
their lists match in sizes and strides and an add's are of one dtype; otherwise a kernel a tensor).

    python tests/bf16_grads_probe.py SHARDS   # prints one JSON line; exit 0
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(shards: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", sys.argv[2] if len(sys.argv) > 2 else "29517")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from bench.step_profile import build
    from pretrain.model.masking import mask_batch
    from pretrain.runtime import deepspeed_patches as patches

    overrides = ["impl.precision=bf16", "impl.zero_stage=1", "impl.micro_batch_size=4", "train.global_batch_size=8"]
    s = build(REPO / "configs" / "tiny.yaml", overrides + ["impl.compile=false", f"data.dir={shards}"], Path(shards))
    opt = s.engine.optimizer
    assert type(opt).__name__ == "BF16_Optimizer", type(opt)
    deepspeeds = patches.original("deepspeed.runtime.bf16_optimizer:BF16_Optimizer.update_hp_grads")
    ours_update = type(opt).update_hp_grads
    flat = opt.fp32_groups_gradients_flat
    compared = []
    seen: list = []

    calls: list = []

    class Calls(TorchDispatchMode):  # the ops ours dispatches (a kernel's own inner calls are not seen)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func.overloadpacket.__name__, [a for a in args if isinstance(a, list)]))
            return func(*args, **(kwargs or {}))

    def keeping_a_copy(self, clear_lp_grads=False):  # the bf16 gradients ours adds, then frees
        seen[:] = [[p.grad.clone() if p.grad is not None else None for p in g] for g in self.bf16_groups]
        calls.clear()
        with Calls():
            return ours_update(self, clear_lp_grads=clear_lp_grads)

    def multi_tensor(name, lists) -> bool:  # CUDA's fast route: equal sizes and strides, one dtype a list
        same = all(len({(t.shape, t.stride()) for t in ts}) == 1 for ts in zip(*lists))
        return same and all(
            len({t.dtype for t in ts}) == 1 for ts in (lists if name == "_foreach_copy_" else [sum(lists, [])])
        )

    type(opt).update_hp_grads = keeping_a_copy
    for micro in range(2):
        batch = next(s.batches)
        m = mask_batch(
            batch["input_ids"], batch["word_starts"], s.special, s.cfg.masking, sample_ids=batch["sample_ids"], step=0
        )
        before = [f.clone() for f in flat]
        loss, _, _ = s.engine(m.input_ids, None, m.positions, m.labels)
        s.engine.backward(loss)  # its epilogue adds the bf16 gradients into the fp32 ones: ours
        ours = [f.clone() for f in flat]
        sums = [(name, args) for name, args in calls if "add" in name or "copy" in name]
        freed = all(p.grad is None for g in opt.bf16_groups for p in g)
        for f, b in zip(flat, before):
            f.copy_(b)
        for group, grads in zip(opt.bf16_groups, seen):
            for p, g in zip(group, grads):
                p.grad = g
        deepspeeds(opt)  # the same bf16 gradients, DeepSpeed's way
        theirs = [f.clone() for f in flat]
        for group in opt.bf16_groups:  # as ours leaves them, for the next micro-batch
            for p in group:
                p.grad = None
        compared.append(
            {
                "equal": all(torch.equal(a, b) for a, b in zip(ours, theirs)),
                "moved": any(not torch.equal(a, b) for a, b in zip(ours, before)),
                "has_gradients": all(all(h) for h in opt.fp32_groups_has_gradients),
                "bf16_freed": freed,
                "sums": sorted({name for name, _ in sums}),
                "multi_tensor": all(name.startswith("_foreach") and multi_tensor(name, args) for name, args in sums),
            }
        )
    type(opt).update_hp_grads = ours_update
    ours_in_place = ours_update is not deepspeeds
    print(
        json.dumps({"micro_batches": compared, "params": sum(len(g) for g in opt.bf16_groups), "ours": ours_in_place})
    )


if __name__ == "__main__":
    main(sys.argv[1])
