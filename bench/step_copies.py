"""Where a training step's copies come from: every ``aten::copy_`` and dtype conversion (``_to_copy``)
of one step of ours (the DeepSpeed engine, one process), counted by the code that asked for it.

    python bench/step_copies.py                       # configs/mini.yaml, fp32, ZeRO as configured
    python bench/step_copies.py --precision bf16 --set impl.zero_stage=2

A profiler counts the copies; this says whose they are (the two innermost frames outside torch), with the
elements moved, so that the ones not needed can be told from those that are.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import ensure_sample_shards, format_table  # noqa: E402
from bench.step_profile import build, timed_step  # noqa: E402

COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.elements: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COPIES:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][::-1][:2]
            caller = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
            src = args[1] if func is COPIES[0] else args[0]
            dst = args[0].dtype if func is COPIES[0] else kwargs.get("dtype", src.dtype)
            key = (f"{str(src.dtype).removeprefix('torch.')} -> {str(dst).removeprefix('torch.')}", caller)
            self.calls[key] += 1
            self.elements[key] += src.numel()
        return func(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/mini.yaml")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--work-dir", default="/tmp/bench_step_copies")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    shards = ensure_sample_shards(args.work_dir)
    overrides = [
        f"data.dir={shards}",
        f"impl.precision={args.precision}",
        "impl.num_workers=0",
        f"train.out_dir={args.work_dir}/run",
        "tracking.backend=none",
        f"impl.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        *args.set,
    ]
    setup = build(Path(args.config), overrides, shards)
    for step in range(2):  # past the first steps' one-off allocations
        timed_step(setup, step)
    counter = CountCopies()
    with counter:
        timed_step(setup, 2)
    rows = [
        [n, f"{counter.elements[key] / 1e6:.2f} M", key[0], key[1]] for key, n in counter.calls.most_common(args.top)
    ]
    print(
        f"{args.config}, {args.precision}, micro-batch {args.micro_batch}, ZeRO {setup.cfg.impl.zero_stage}, one "
        f"process: {sum(counter.calls.values())} copies in one step, {sum(counter.elements.values()) / 1e6:.1f} M "
        f"elements"
    )
    print(format_table(["calls", "elements", "dtypes", "asked for by"], rows))


if __name__ == "__main__":
    main()
