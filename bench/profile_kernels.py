"""Where a profiled GPU step's time goes, by kernel: read from a ``torch.profiler`` Chrome trace
(ours: ``impl.profile_at_step``, pretrain/runtime/profiling.py; the bare loop: bench/reference_loops.py's
``profile``), one report per trace:

    python bench/profile_kernels.py --steps 3 runs/profile-base/profile/step00000012-rank0.json.gz ...

* the device's busy share of the profiled span (the union of its kernels and copies over the time from
  the first event to the last): what is left is the device waiting for its host;
* the device's time a step by kernel class (matmul, attention, elementwise / norm / dropout, the MLM
  loss, the optimiser step, copies, collectives) and the idle gaps;
* the kernels that take longest, with their calls a step, mean time and, for matmuls and attention
  (whose launching op the trace records with its input shapes), the TFLOP/s they reach.

A kernel's class is read from its name (cuBLAS/CUTLASS/nvjet matmuls, flash/cuDNN/efficient/flex
attention, inductor's ``triton_*`` fusions by what they fuse); the classes' patterns are below. Pure
reading of a trace: no GPU needed (tests/bench/test_bench.py feeds it a small trace).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# First match wins; inductor names a fusion after the ops it holds (``triton_per_fused_native_layer_norm_0``).
CLASSES = (
    ("collectives", re.compile(r"nccl|all_?reduce|allgather|reduce_?scatter", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|lamb|_foreach|fused_sgd", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|flex|triton_tem_fused", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|gemv|splitk|sm\d\d_.*_tn|wgmma", re.I)),
    ("mlm loss", re.compile(r"log_softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatchedCopy|direct_copy", re.I)),
)
OTHER = "elementwise, norm, dropout"
ORDER = ("matmul", "attention", OTHER, "mlm loss", "optimizer", "copies", "collectives")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
SDPA_FWD = re.compile(r"aten::_(scaled_dot_product_\w+attention|flash_attention_forward|efficient_attention_forward)$")
SDPA_BWD = re.compile(
    r"aten::_(scaled_dot_product_\w+attention_backward|flash_attention_backward|efficient_attention_backward)$"
)


def kernel_class(name: str, cat: str = "kernel") -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return OTHER


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def op_flops(name: str, dims: list) -> float:
    """The FLOPs of one launching op from its recorded input shapes (0 where unknown)."""
    try:
        if name in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = dims[0][-2:], dims[1][-2:]
            return 2.0 * m * k * n
        if name == "aten::addmm":
            (m, k), (_, n) = dims[1], dims[2]
            return 2.0 * m * k * n
        if name in ("aten::bmm", "aten::baddbmm"):
            a, b = (dims[0], dims[1]) if name == "aten::bmm" else (dims[1], dims[2])
            return 2.0 * _prod(a[:-2]) * a[-2] * a[-1] * b[-1]
        forward, backward = SDPA_FWD.match(name), SDPA_BWD.match(name)
        if forward or backward:
            q, k = (dims[1], dims[2]) if backward else (dims[0], dims[1])  # backward's first is the grad
            fwd = 4.0 * _prod(q[:-2]) * q[-2] * k[-2] * q[-1]
            return 2.5 * fwd if backward else fwd  # the backward's five matmuls against two
    except (IndexError, TypeError, ValueError):
        return 0.0
    return 0.0


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def analyse(trace: dict, steps: int, top: int = 15) -> dict:
    """The trace's device time a step by class, its busy share, and its ``top`` kernels (times in ms)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ops_by_id: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ext = e.get("args", {}).get("External id")
            if ext is not None:
                ops_by_id[ext].append(e)
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not events:
        raise ValueError("the trace holds no timed events")
    start = min(e["ts"] for e in events)
    stop = max(e["ts"] + e["dur"] for e in events)
    by_class: dict = defaultdict(float)
    kernels: dict = defaultdict(lambda: {"us": 0.0, "calls": 0, "flops": 0.0, "class": OTHER})
    for e in gpu:
        label = kernel_class(e["name"], e["cat"])
        by_class[label] += e["dur"]
        k = kernels[e["name"]]
        k["us"] += e["dur"]
        k["calls"] += 1
        k["class"] = label
        if label in ("matmul", "attention"):
            for op in ops_by_id.get(e.get("args", {}).get("External id"), []):
                flops = op_flops(op["name"], op.get("args", {}).get("Input Dims") or [])
                if flops:
                    k["flops"] += flops
                    break
    span = (stop - start) / 1000
    busy = _busy([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / 1000
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top]
    return {
        "steps": steps,
        "span_ms": span / steps,
        "busy_ms": busy / steps,
        "by_class_ms": {c: by_class.get(c, 0.0) / 1000 / steps for c in ORDER},
        "idle_ms": (span - busy) / steps,
        "top": [
            {
                "name": name,
                "class": k["class"],
                "ms_a_step": k["us"] / 1000 / steps,
                "calls_a_step": k["calls"] / steps,
                "mean_us": k["us"] / k["calls"],
                "tflops": k["flops"] / (k["us"] * 1e-6) / 1e12 if k["flops"] else None,
            }
            for name, k in ranked
        ],
    }


def render(found: dict, label: str) -> str:
    lines = [
        f"{label}: {found['span_ms']:.1f} ms a step over {found['steps']} steps; the device busy "
        f"{found['busy_ms']:.1f} ms ({100 * found['busy_ms'] / found['span_ms']:.0f}%), idle {found['idle_ms']:.1f} ms"
    ]
    total = sum(found["by_class_ms"].values()) or 1.0
    lines.append(
        "  by class (ms a step, share of kernel time): "
        + ", ".join(f"{c} {ms:.2f} ({100 * ms / total:.0f}%)" for c, ms in found["by_class_ms"].items() if ms)
    )
    lines.append(f"  the {len(found['top'])} longest kernels:")
    for k in found["top"]:
        rate = f", {k['tflops']:.0f} TFLOP/s" if k["tflops"] else ""
        lines.append(
            f"    {k['ms_a_step']:7.2f} ms  {k['calls_a_step']:6.1f} calls x {k['mean_us']:8.1f} us  "
            f"[{k['class']}{rate}]  {k['name'][:110]}"
        )
    return "\n".join(lines)


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, required=True, help="the steps each trace holds")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    out = {}
    for path in args.traces:
        if not path.is_file():
            print(f"profile_kernels: {path}: no such file", file=sys.stderr)
            return 2
        found = analyse(load(path), args.steps, args.top)
        out[str(path)] = found
        print(render(found, str(path)))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
