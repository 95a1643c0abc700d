"""One leg of a resharding test, run under ``deepspeed --num_gpus W`` (or plain python for W = 1).

Builds the tiny model and engine through the project's own code at the given ZeRO stage and
precision, optionally loads a checkpoint saved at another layout through ``pretrain.checkpoint.reshard``,
trains a few steps on fixed random batches that do not depend on the layout (the global batch is
the same rows whatever the world size and accumulation), optionally saves a checkpoint, and has
rank 0 dump the losses and the full fp32 parameters and optimiser moments before and after.

    deepspeed --num_gpus 2 --master_port P tests/reshard_worker.py --stage 2 --steps 3 --save \
        --out-dir DIR --dump a.pt
"""

from __future__ import annotations

import gc

gc.disable()  # while torch, transformers and DeepSpeed load: frozen in main(), as pretrain.train does

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.checkpoint import (
    checkpointing,  # noqa: E402
    nodes,
    reshard,
)
from pretrain.config import loader as configlib
from pretrain.config.schema import Config  # noqa: E402
from pretrain.model.masking import SpecialIds  # noqa: E402
from pretrain.model.mlm import build_model  # noqa: E402
from pretrain.runtime import engine as eng

VOCAB, SEQ_LEN, MASK_ID, MASK_RATE = 512, 32, 4, 0.15
SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=MASK_ID, vocab_size=VOCAB)


def make_config(
    stage: int, precision: str, optimizer: str, micro_batch: int, out_dir: str, offload: bool = False
) -> Config:
    cfg = Config()
    for section, values in configlib.load_yaml(Path(__file__).resolve().parents[1] / "configs/tiny.yaml").items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0  # nothing random in a step
    cfg.model.max_position_embeddings = SEQ_LEN
    cfg.impl.zero_stage, cfg.impl.precision, cfg.optim.name = stage, precision, optimizer
    cfg.impl.micro_batch_size, cfg.impl.offload_optimizer = micro_batch, offload
    cfg.train.out_dir, cfg.train.keep_checkpoints = out_dir, 0
    return cfg


def build_engine(cfg: Config, info):
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, VOCAB, SPECIAL, cfg.impl, seq_len=SEQ_LEN)
    return eng.initialize(model, cfg, info, cfg.impl.precision)[0]


def load_any(engine, cfg: Config, tag: str) -> dict:
    """The trainer's own load path: converts when the saved layout is not the running one."""
    return checkpointing.load(engine, cfg, tag, nodes.single(dist.get_rank(), dist.get_world_size()))


def global_batch(step: int, size: int):
    """The step's whole batch (ids with [MASK] at the predicted positions, mask, original ids)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    chosen = torch.rand(size, SEQ_LEN, generator=gen) < MASK_RATE
    chosen[:, 0] = True  # every row predicts something
    return ids.masked_fill(chosen, MASK_ID), chosen, ids


def full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full fp32 value and optimiser moments, by name, on every rank: what a
    conversion must preserve. Collective under ZeRO (all ranks call it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if not reshard.is_partitioned(engine):
        masters = getattr(engine.optimizer, "fp32_groups", None)
        inner = engine.optimizer.optimizer if masters is not None else engine.optimizer
        module_params = dict(engine.module.named_parameters())
        out = {}
        for g, group_names in enumerate(reshard.param_names_by_group(engine)):
            for i, name in enumerate(group_names):
                held = inner.param_groups[g]["params"][i]  # the module's param, or its fp32 master
                out[name] = {
                    "fp32": held.detach().float().cpu().clone(),
                    **{
                        k: v.detach().cpu().clone()
                        for k, v in inner.state.get(held, {}).items()
                        if k in reshard.MOMENTS
                    },
                }
                assert module_params[name].shape == held.shape
        return out
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # ZeRO 1/2 link each parameter's view of the moments once, right after the first group's first
        # step, when a torch optimiser has not yet created the other groups' state: link them again.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {
            "fp32": safe_get_full_fp32_param(p).detach().cpu().clone(),
            **{k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in reshard.MOMENTS},
        }
    return out


def train_steps(engine, cfg: Config, info, first: int, count: int) -> list[float]:
    world, micro = info.world, cfg.impl.micro_batch_size
    accum = cfg.grad_accum_steps(world)
    losses = []
    for step in range(first, first + count):
        inputs, chosen, targets = global_batch(step, cfg.train.global_batch_size)
        scale = world * accum / chosen.sum().double()  # as pretrain.train: mean over the step
        total = torch.zeros(1, dtype=torch.float64)
        for i in range(accum):
            rows = slice((i * world + info.rank) * micro, (i * world + info.rank + 1) * micro)
            positions = chosen[rows].flatten().nonzero().squeeze(1)
            labels = targets[rows].flatten()[positions]
            loss_sum, _, _ = engine(inputs[rows], None, positions, labels)
            total += loss_sum.detach().double()
            engine.backward(loss_sum * scale)
            engine.step()
        dist.all_reduce(total)
        losses.append(float(total / chosen.sum()))
    return losses


def main() -> int:
    gc.freeze()
    gc.enable()
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimiser state in CPU memory")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--load", default="", help="tag to load from OUT_DIR/checkpoints (converted if needed)")
    p.add_argument("--save", action="store_true")
    p.add_argument("--dump", required=True)
    p.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    eng.prepare_env()
    cfg = make_config(args.stage, args.precision, args.optimizer, args.micro_batch, args.out_dir, args.offload)
    info = eng.init_distributed(cfg)
    engine = build_engine(cfg, info)
    step, before, client_state = 0, None, {}
    if args.load:
        client_state = load_any(engine, cfg, args.load)
        step = client_state["step"]
        before = full_state(engine)
    lr_before = engine.lr_scheduler.get_last_lr()
    losses = train_steps(engine, cfg, info, step, args.steps)
    step += args.steps
    if args.save:
        layout = reshard.describe(reshard.checkpoint_layout(engine))
        checkpointing.save(
            engine,
            cfg,
            step,
            {"step": step, "client_note": f"saved at {layout}"},
            {},
            {},
            nodes.single(info.rank, info.world),
        )
    after = full_state(engine)
    if info.rank == 0:
        torch.save(
            {
                "losses": losses,
                "before": before,
                "after": after,
                "client_state": client_state,
                "lr_before": lr_before,
                "optimizer_wrapper": type(engine.optimizer).__name__,
                "grad_accum_dtype": str(
                    getattr(engine.optimizer, "grad_acc_dtype", None)
                    or getattr(engine.optimizer, "gradient_accumulation_dtype", None)
                ),
                "lr_after": engine.lr_scheduler.get_last_lr(),
                "global_steps": engine.global_steps,
                "inductor_loaded": "torch._inductor.compile_fx" in sys.modules,
            },
            args.dump,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    eng.end_process(main())
