"""The MLM loss alone, side by side: the fused, chunked decoder + cross-entropy
(``pretrain.model.mlm_loss``, the trainer's default) against the plain ``F.linear`` + ``F.cross_entropy``
that ``impl.fused_mlm_loss=false`` runs, forward and backward, with and without the accuracy's argmax.
Prints the median and best time of each, their ratio, the largest gap in loss and gradients, and on
CUDA the peak memory each takes.

    python bench/mlm_loss.py                               # CPU, mini's shape: 614 tokens x 256 -> 30,522
    python bench/mlm_loss.py --precision bf16 --chunk-rows 64 128 274 614
    python bench/mlm_loss.py --device cuda --tokens 65536 --hidden 768 --precision bf16   # bench/gpu_smoke.sh
    python bench/mlm_loss.py --memory --tokens 4096 --hidden 768 --vocab 50368   # eager vs torch.compile

``--memory``: the peak memory of one forward + backward of the plain loss, the fused one, the fused one
in one chunk (what ``torch.compile`` traced before issue 49), and the fused one under ``torch.compile``
(its chunks unrolled for a fixed token count), each in a fresh process. On
the CPU it is the peak growth of the resident set, sampled every 0.2 ms, with glibc told to map every
allocation over 64 KiB on its own (``MALLOC_MMAP_THRESHOLD_``) so that a freed tensor leaves the
resident set; on CUDA, ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cpu_record, format_table  # noqa: E402
from pretrain.model.masking import IGNORE_INDEX  # noqa: E402
from pretrain.model.mlm_loss import fused_linear_cross_entropy, rows_per_chunk  # noqa: E402


def plain(hidden, weight, bias, labels, want_correct: bool):
    logits = F.linear(hidden, weight, bias).float()
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum() if want_correct else None
    return loss, correct


def fused(chunk_rows: int | None):
    def run(hidden, weight, bias, labels, want_correct: bool):
        loss, _, correct = fused_linear_cross_entropy(hidden, weight, bias, labels, want_correct, chunk_rows)
        return loss, correct.sum() if want_correct else None

    return run


def inputs(args, device, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    bias = torch.zeros(args.vocab)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    return [t.to(device, dtype).requires_grad_() for t in (hidden, weight, bias)] + [labels.to(device)]


def step(fn, tensors, want_correct: bool):
    loss, _ = fn(*tensors, want_correct)
    loss.backward()
    grads = [t.grad for t in tensors[:3]]
    for t in tensors[:3]:
        t.grad = None
    return loss.detach(), grads


def timed(fn, tensors, want_correct: bool, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    step(fn, tensors, want_correct)
    sync()
    return time.perf_counter() - start


def gaps(reference, other) -> tuple[float, float]:
    """Relative gaps of the loss and of the worst gradient."""
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    rel = [float((b.float() - a.float()).norm() / a.float().norm().clamp(min=1e-30)) for a, b in zip(grads_a, grads_b)]
    return abs(float(loss_b - loss_a)) / abs(float(loss_a)), max(rel)


def peak_memory(fn, tensors, device) -> str:
    if device.type != "cuda":
        return "-"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step(fn, tensors, True)
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated(device) - base) / 2**20:,.0f} MiB"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured_peak(fn, tensors, device) -> int:
    """Bytes above what was live before, at the peak of one forward + backward."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step(fn, tensors, True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - base
    base, peak, done = _resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _resident_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step(fn, tensors, True)
    done.set()
    sampler.join()
    return max(peak[0], _resident_bytes()) - base


# "one chunk": what torch.compile traced before issue 49 (the whole [N, V] logits in one chunk)
MEMORY_VARIANTS = ("plain", "fused", "fused, one chunk", "fused, torch.compile")


def memory_child(args) -> None:
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    tensors = inputs(args, device, dtype)
    fn = {"plain": plain, "fused, one chunk": fused(args.tokens)}.get(args.memory_child, fused(None))
    if "compile" in args.memory_child:
        fn = torch.compile(fn)
        step(fn, tensors, True)  # compiles (the count is fixed: one graph)
    print(measured_peak(fn, tensors, device))


def memory_table(args) -> None:
    rows = []
    full = args.tokens * args.vocab * 4
    for name in MEMORY_VARIANTS:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            name,
            "--device",
            args.device,
            "--precision",
            args.precision,
            "--tokens",
            str(args.tokens),
            "--hidden",
            str(args.hidden),
            "--vocab",
            str(args.vocab),
        ]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout.split()
        peak = int(out[-1])
        rows.append([name, f"{peak / 2**20:,.0f} MiB", f"{peak / full:.2f}"])
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_record().get("model", "cpu")
    print(
        f"{args.tokens} tokens x {args.hidden} -> {args.vocab}, {args.precision}, {where}: peak memory of one "
        f"forward + backward above its inputs; fp32 [N, V] logits are {full / 2**20:,.0f} MiB"
    )
    print(format_table(["loss", "peak memory", "x full logits"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--tokens", type=int, default=614, help="predicted tokens (mini micro-batch: 32 x 128 x 15%%)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--chunk-rows", type=int, nargs="+", default=[], help="besides the default chunking")
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each, interleaved")
    p.add_argument("--threads", type=int, help="torch threads on the CPU")
    p.add_argument("--memory", action="store_true", help="peak memory: plain, fused, fused compiled")
    p.add_argument("--memory-child", choices=MEMORY_VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args)
    if args.memory:
        return memory_table(args)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    tensors = inputs(args, device, dtype)
    default_rows = rows_per_chunk(args.vocab, device)
    variants = {
        "plain (F.linear + F.cross_entropy)": plain,
        f"fused, {default_rows} rows a chunk (default)": fused(None),
    }
    variants.update({f"fused, {r} rows a chunk": fused(r) for r in args.chunk_rows if r != default_rows})
    reference = step(plain, tensors, True)
    times = {(name, c): [] for name in variants for c in (False, True)}
    for _ in range(args.repeats + 1):  # the first round warms up, untimed
        for (name, want_correct), ts in times.items():
            ts.append(timed(variants[name], tensors, want_correct, device))
    rows, worst = [], 0.0
    base = {c: statistics.median(times[(next(iter(variants)), c)][1:]) for c in (False, True)}
    for (name, want_correct), ts in times.items():
        median = statistics.median(ts[1:])
        loss_gap, grad_gap = gaps(reference, step(variants[name], tensors, True))
        worst = max(worst, loss_gap, grad_gap)
        rows.append(
            [
                name,
                "yes" if want_correct else "no",
                f"{median * 1e3:.1f}",
                f"{min(ts[1:]) * 1e3:.1f}",
                f"{base[want_correct] / median:.2f}x",
                f"loss {loss_gap:.1e}, grads {grad_gap:.1e}",
                peak_memory(variants[name], tensors, device) if want_correct else "",
            ]
        )
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_record().get("model", "cpu")
    print(
        f"{args.tokens} tokens x {args.hidden} -> {args.vocab}, {args.precision}, {where}, "
        f"{torch.get_num_threads()} threads; forward + backward, median of {args.repeats}"
    )
    print(
        format_table(["loss", "argmax", "median ms", "best ms", "speed vs plain", "gap vs plain", "peak memory"], rows)
    )
    # bf16 rounds each gradient to 8 bits (2^-8 = 3.9e-3 relative); a gap past a few roundings is a bug.
    allowed = 1e-4 if args.precision == "fp32" else 2e-2
    if worst > allowed:
        sys.exit(f"mlm_loss: a fused variant differs from the plain loss by {worst:.1e} > {allowed:.0e}")


if __name__ == "__main__":
    main()
