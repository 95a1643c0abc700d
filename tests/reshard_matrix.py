"""Which layout conversions work: every ZeRO stage x precision x world size into every other.

Not part of the test suite (it takes minutes); run by hand, one world size per pass:

    W=2; deepspeed --num_gpus $W --master_port 29700 tests/reshard_matrix.py save --dir /tmp/matrix
    W=1; python tests/reshard_matrix.py save --dir /tmp/matrix
    W=2; deepspeed --num_gpus $W --master_port 29701 tests/reshard_matrix.py load --dir /tmp/matrix
    W=1; python tests/reshard_matrix.py load --dir /tmp/matrix

``save`` trains each layout of this world size for a few steps, saves it, trains two steps more
and records the full state and those two losses. ``load`` loads every saved checkpoint into every
layout of this world size through ``pretrain.checkpoint.reshard`` and prints one line per pair: the largest
difference of the loaded fp32 parameters and moments from the saved ones, and of the next two
losses from the ones the saving layout had.

Seen with deepspeed 0.19.8, torch 2.13 on the CPU (avx512_bf16): all 512 pairs of
{world 1, 2} x {ZeRO 0, 1, 2, 3} x {fp32, bf16} x {AdamW, LAMB} (same optimiser) load with
parameters and moments bit-identical; the next two losses agree within 1.3e-8 / 3.6e-6 relative
(fp32 -> fp32) and 4.4e-5 (bf16 on either side, whose forward pass itself differs). The 3.6e-6 was a
defect, not round-off: every conversion into ZeRO 3 counted AdamW's steps twice (one step tensor
shared by its sub-groups; fixed in ``reshard.set_step_count``). Bit-identical state does not show
what the next steps do with it; tests/pretrain/test_resume_every_zero_stage_pair.py resumes every pair of stage x
world size through the trainer and compares the losses with the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain.checkpoint import files  # noqa: E402
from reshard_worker import (
    build_engine,
    eng,
    full_state,
    load_any,
    make_config,
    reshard,  # noqa: E402
    save_checkpoint,
    train_steps,
)

STEPS = 3


def layouts(optimizers: list[str], precisions: list[str]):
    return list(itertools.product(optimizers, precisions, range(4)))


def max_diff(a: dict, b: dict) -> float:
    return max((a[n][k].float() - b[n][k].float()).abs().max().item() for n in a for k in a[n])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--dir", required=True)
    p.add_argument("--optimizers", default="adamw,lamb")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    eng.prepare_env()
    info = eng.init_distributed(make_config(0, "fp32", "adamw", 4, args.dir))
    combos = layouts(args.optimizers.split(","), args.precisions.split(","))
    if args.mode == "save":
        for opt, precision, stage in combos:
            name = f"w{info.world}_z{stage}_{precision}_{opt}"
            cfg = make_config(stage, precision, opt, 4, f"{args.dir}/{name}")
            engine = build_engine(cfg, info)
            train_steps(engine, cfg, info, 0, STEPS)
            save_checkpoint(
                engine, cfg, STEPS, {"step": STEPS}, {files.LAYOUT_FILE: json.dumps(reshard.checkpoint_layout(engine))}
            )
            state = full_state(engine)
            losses = train_steps(engine, cfg, info, STEPS, 2)
            if info.rank == 0:
                torch.save({"state": state, "losses": losses}, f"{args.dir}/{name}.pt")
        sources, combos = [], []
    else:
        sources = sorted(Path(args.dir).glob("w*_z*.pt"))
    for (opt, precision, stage), source in itertools.product(combos, sources):
        if not source.stem.endswith(opt):
            continue
        want = torch.load(source, weights_only=False)
        cfg = make_config(stage, precision, opt, 4, str(Path(args.dir) / source.stem))
        line = f"{source.stem:>22} -> w{info.world}_z{stage}_{precision}_{opt}: "
        try:
            engine = build_engine(cfg, info)
            load_any(engine, Path(cfg.train.out_dir) / "checkpoints", f"step{STEPS:08d}")
            state_diff = max_diff(want["state"], full_state(engine))
            losses = train_steps(engine, cfg, info, STEPS, 2)
            rel = [abs(a - b) / a for a, b in zip(losses, want["losses"])]
            line += f"state {state_diff:.1e}  loss rel diff {rel[0]:.1e} {rel[1]:.1e}"
        except Exception as e:  # noqa: BLE001  (a table of what fails is the point)
            line += f"FAILED {type(e).__name__}: {str(e)[:150]}"
            if info.rank == 0:
                traceback.print_exc()
        if info.rank == 0:
            print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    eng.end_process(main())
