"""What per-layer health (``pretrain/guards/health.py``) costs against a training step, in CPU seconds (so a
shared, loaded machine does not blur it), on one process at ZeRO 0 (every weight local).

    python bench/health_cost.py [--config configs/mini.yaml] [--batch 32] [--seq-len 128] [--repeats 10] --data SHARDS

A step: sparse-head MLM forward, backward and AdamW on a random batch. Health: ``before_step`` +
``after_step`` (norms of every weight and gradient, a copy of the weights, the update norms).
Printed: both, and the cost per step at ``train.health_every=10``. ``bench/train_throughput.py
--variants ours ours-health10`` measures the same end to end through the trainer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.guards.health import LayerHealth  # noqa: E402
from pretrain.model.masking import SpecialIds  # noqa: E402
from pretrain.model.mlm import build_model  # noqa: E402


class _Holder:  # LayerHealth reads engine.module only
    def __init__(self, module):
        self.module = module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/mini.yaml")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--data", required=True, help="any shard folder (the config check wants one; not read)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = _config(args.config, args.data)
    vocab = 30522
    special = SpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103, vocab_size=vocab)
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab, special, cfg.impl, seq_len=args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1000, vocab, (args.batch, args.seq_len))
    positions = (torch.rand(ids.shape) < 0.15).flatten().nonzero().squeeze(1)
    labels = ids.flatten()[positions]
    health = LayerHealth(_Holder(model), 10, 0)

    def step(with_health: bool) -> tuple[float, float]:
        t0 = time.process_time()
        loss_sum, _, count = model(ids, None, positions, labels)
        (loss_sum / count).backward()
        t1 = time.process_time()
        if with_health:
            health.before_step()
        t2 = time.process_time()
        opt.step()
        t3 = time.process_time()
        if with_health:
            health.after_step(1)
        t4 = time.process_time()
        opt.zero_grad(set_to_none=True)
        return (t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3)

    step(True)  # warm-up
    runs = [step(True) for _ in range(args.repeats)]
    step_s = min(r[0] for r in runs)
    health_s = min(r[1] for r in runs)
    print(f"{args.config}: batch {args.batch} x {args.seq_len}, {len(health.groups)} groups, 1 thread")
    print(
        f"step {step_s * 1e3:.1f} ms CPU, health {health_s * 1e3:.2f} ms CPU ({health_s / step_s:.2%} of a step "
        f"when done every step; {health_s / step_s / 10:.2%} per step at health_every=10)"
    )


def _config(path: str, data_dir: str):
    from pretrain.config.loader import build, load_yaml
    from pretrain.config.schema import Config

    data = load_yaml(path)
    data.setdefault("data", {})["dir"] = data_dir  # only the model and impl groups are used
    return build(Config, data)


if __name__ == "__main__":
    main()
