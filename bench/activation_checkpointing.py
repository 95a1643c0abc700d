"""What ``impl.activation_checkpointing`` saves and costs: one micro-batch's forward and backward, with
the layers' activations kept (the default) and recomputed in the backward, side by side.

    .venv/bin/python bench/activation_checkpointing.py [--config configs/base.yaml] [--seq-len 512]
                                                       [--micro-batch 4] [--threads 2] [--repeats 2]

Each mode runs in a process of its own (a fresh heap, so that its peak is its own): the config's model
built as the trainer builds it (``pretrain.model.mlm.build_model``, keyed dropout installed, in fp32,
the attention SDPA picks), ``--micro-batch`` rows of ``--seq-len`` random tokens, the config's masking
rate. Printed per mode: the seconds of the fastest of ``--repeats`` passes after one to warm up, and the
process's peak resident memory above what it held before its first pass (on a CPU the activations live
in the host's memory; on a GPU the same bytes are device memory), then the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import cpu_record, format_table, load_average, thread_env  # noqa: E402

MODES = {"kept": False, "recomputed": True}


def one_mode(args) -> dict:
    """In the child: build, warm up, time; the peak above the start (resident memory on a CPU,
    ``pretrain.runtime.hardware``'s figures, as ``perf/memory_gb`` reports them)."""
    import torch

    from pretrain.config.loader import load_yaml
    from pretrain.config.schema import ImplConfig, MaskingConfig, ModelConfig
    from pretrain.model import keyed_dropout
    from pretrain.model.masking import SpecialIds
    from pretrain.model.mlm import build_model
    from pretrain.runtime.hardware import current_memory_gb, peak_memory_gb
    from pretrain.runtime.step_speed import probe_inputs

    raw = load_yaml(str(REPO / args.config))
    model_cfg = ModelConfig(**{**raw["model"], "init_from": ""})  # the shape, fresh weights
    rate = MaskingConfig(**raw.get("masking", {})).rate
    special = SpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103, vocab_size=30522)
    impl = ImplConfig(attention="sdpa", precision="fp32", activation_checkpointing=MODES[args.mode])
    torch.manual_seed(0)
    model = build_model(model_cfg, special.vocab_size, special, impl, seq_len=args.seq_len).train()
    key = keyed_dropout.install(model.hf_model, seed=1)
    ids, positions, labels = probe_inputs(
        special.vocab_size, args.micro_batch, args.seq_len, round(rate * args.micro_batch * args.seq_len)
    )
    key.set(torch.arange(args.micro_batch), step=1)
    cpu = torch.device("cpu")
    before = current_memory_gb(cpu)
    best = float("inf")
    for attempt in range(args.repeats + 1):
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        loss, _, _ = model(ids, None, positions, labels)
        with model.recompute_context():
            loss.backward()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return {"seconds": best, "peak_above_start": (peak_memory_gb(cpu) - before) * 2**30, "loss": float(loss)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/base.yaml")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)  # the child's
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(one_mode(args)))
        return 0
    cpu = cpu_record()
    print(f"{args.config}, {args.micro_batch} x {args.seq_len} tokens, fp32, {args.threads} threads; {cpu}")
    print(f"load average at start: {load_average()[0]:.2f}")
    results = {}
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--mode", mode],
            capture_output=True,
            text=True,
            env=thread_env(args.threads),
            cwd=REPO,
        )
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [
        [mode, f"{r['seconds']:.2f}", f"{r['peak_above_start'] / 2**30:.2f}", f"{r['loss']:.6f}"]
        for mode, r in results.items()
    ]
    print(format_table(["activations", "forward + backward (s)", "peak memory above start (GiB)", "loss"], rows))
    kept, recomputed = results["kept"], results["recomputed"]
    print(
        f"recomputed / kept: time x{recomputed['seconds'] / kept['seconds']:.2f}, peak memory "
        f"x{recomputed['peak_above_start'] / max(kept['peak_above_start'], 1):.2f}; the same loss: "
        f"{recomputed['loss'] == kept['loss']}"
    )
    print(f"load average at end: {load_average()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
