"""What DeepSpeed's engine holds in memory beyond the model's weights and gradients, at each ZeRO stage and
precision, on rank 0, run under ``deepspeed --num_gpus W`` (or plain python for W = 1): the tiny model's
engine built through the project's own code (``tests/reshard_worker.py``), one step taken, and the bytes of
every distinct tensor storage alive then, less those before the model and the weights and gradients in
the run's dtype (which ``impl.micro_batch_size=auto``'s timing copy of the model holds too).

    python tests/engine_memory_worker.py --dump held.json 1:bf16 2:bf16 0:fp32
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.runtime import engine as eng  # noqa: E402
from tests.reshard_worker import build_engine, global_batch, make_config, train_steps  # noqa: E402


def storages(module=None) -> dict[int, int]:
    """Bytes of each distinct tensor storage the collector sees, by address, and of ``module``'s gradients
    (held by autograd, not by a Python object until asked for)."""
    found: dict[int, int] = {}
    grads = [p.grad for p in module.parameters() if p.grad is not None] if module is not None else []
    for obj in gc.get_objects() + grads:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = max(found.get(storage.data_ptr(), 0), storage.nbytes())
    return found


def held_beyond_the_model(stage: int, precision: str, out_dir: str, info) -> dict:
    before = storages()
    cfg = make_config(stage, precision, "adamw", 4, out_dir)
    engine = build_engine(cfg, info)
    train_steps(engine, cfg, info, 0, 1)  # the optimiser's states exist from its first step
    inputs, chosen, targets = global_batch(1, cfg.train.global_batch_size)
    rows = slice(info.rank * 4, info.rank * 4 + 4)
    positions = chosen[rows].flatten().nonzero().squeeze(1)
    loss_sum, _, _ = engine(inputs[rows], None, positions, targets[rows].flatten()[positions])
    engine.backward(loss_sum)  # measured here, gradients and states alike alive: a step's peak less activations
    del loss_sum
    gc.collect()
    new = sum(size for address, size in storages(engine.module).items() if address not in before)
    parameters = eng.num_parameters(engine.module)
    model = 2 * parameters * (4 if precision == "fp32" else 2)  # weights and gradients in the run's dtype
    del engine
    gc.collect()
    return {"stage": stage, "precision": precision, "parameters": parameters, "held": new - model}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--out-dir", default="/tmp/engine_memory")
    p.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    p.add_argument("layouts", nargs="+", help="STAGE:PRECISION")
    args = p.parse_args()
    eng.prepare_env()
    info = eng.init_distributed(make_config(1, "fp32", "adamw", 4, args.out_dir))
    rows = []
    for layout in args.layouts:
        stage, precision = layout.split(":")
        rows.append(held_beyond_the_model(int(stage), precision, args.out_dir, info) | {"world": info.world})
    if info.rank == 0:
        Path(args.dump).write_text(json.dumps(rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
