"""What ``impl.precision=auto`` measures on this CPU, and what it would pick, per model shape.

    python bench/precision_auto.py [--configs configs/mini.yaml configs/demo.yaml] [--threads 2]
        [--seq-len 128] [--micro-batch 32] [--repeats 3]

For each config's model (random weights of its shape, the bert-base-uncased vocabulary size): the
trainer's own probe (``pretrain.runtime.step_speed``: forward + backward at ``PROBE_BATCH`` sequences,
fp32 against a bf16 copy, CPU seconds per thread, fastest of ``--repeats``), measured fresh (the
trainer's cache is neither read nor written), beside the square-matmul peaks of both precisions,
so that the two ratios can be compared: the matmul alone does not tell whether a step wins.
Compare with whole training steps: ``bench/train_throughput.py --precision fp32`` and ``bf16``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 30522  # bert-base-uncased, what the sample shards and the demo use


def build_probe(config: str, seq_len: int, micro_batch: int):
    from pretrain.config.loader import load_yaml
    from pretrain.config.schema import ImplConfig, MaskingConfig, ModelConfig
    from pretrain.model.masking import SpecialIds
    from pretrain.model.mlm import build_model
    from pretrain.runtime.step_speed import step_probe

    raw = load_yaml(config)
    model_cfg = ModelConfig(**{**raw["model"], "init_from": ""})  # the shape, fresh weights
    impl = ImplConfig(**{k: v for k, v in raw.get("impl", {}).items() if k in ("attention", "sparse_head")})
    special = SpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103, vocab_size=VOCAB)
    model = build_model(model_cfg, VOCAB, special, impl, seq_len=seq_len)
    return step_probe(model, micro_batch, seq_len, MaskingConfig(**raw.get("masking", {})).rate)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["configs/mini.yaml"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    import torch

    from pretrain.model.flops import measure_matmul_peak_tflops
    from pretrain.runtime.hardware import cpu_info, native_bf16
    from pretrain.runtime.step_speed import BF16_MARGIN

    torch.set_num_threads(args.threads)
    info = cpu_info()
    native, why = native_bf16(torch.device("cpu"))
    peaks = {
        name: max(measure_matmul_peak_tflops("cpu", dtype, seconds=0.5) for _ in range(2))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    print(f"CPU: {info['model']}; flags {' '.join(info['flags'])}; {args.threads} threads; {why}")
    print(
        f"matmul peak: fp32 {peaks['fp32']:.3f}, bf16 {peaks['bf16']:.3f} TFLOP/s "
        f"({peaks['bf16'] / peaks['fp32']:.2f}x)"
    )
    print(
        f"| model | step fp32 s | step bf16 s | step bf16 speed-up | matmul bf16 speed-up | auto picks "
        f"(bf16 needs {BF16_MARGIN:.2f}x) |\n|---|---|---|---|---|---|"
    )
    for config in args.configs:
        probe = build_probe(config, args.seq_len, args.micro_batch)
        timing = probe.measure(args.repeats)
        pick = timing.choice() if native else "fp32 (emulated bf16: not timed)"
        print(
            f"| {Path(config).stem} ({probe.shape.split(' attn')[0]}, {probe.batch} x {probe.seq_len}) | "
            f"{timing.fp32_s:.4f} | {timing.bf16_s:.4f} | {timing.speedup:.3g}x | "
            f"{peaks['bf16'] / peaks['fp32']:.2f}x | {pick} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
