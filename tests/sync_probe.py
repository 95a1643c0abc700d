"""Runs ``pretrain.train`` in this process (world size 1) and records every read of a tensor's value
by the host (``item``, ``tolist``, ``bool``, ``float``, ``int``, ``nonzero``, ``cpu``, ``numpy``): on a
GPU each one waits for the device. Step k's reads are those from the start of its ``train_step`` to
the start of the next one's. Writes ``{"steps": [[site, ...], ...]}`` as JSON to the path in argv[1];
the rest of argv goes to ``pretrain.train``. A site is ``file:function`` of the caller, or
``deepspeed`` for DeepSpeed's own; host-side data (``pretrain/data``, the batches' checks) is not
counted: those tensors never leave the host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
HOST_ONLY = ("pretrain/data/", "pretrain/guards/bad_input.py")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy")
steps: list[list[str]] = []


def _site(frame) -> str | None:
    name = frame.f_code.co_filename
    if "deepspeed" in name:
        return "deepspeed/" + name.split("deepspeed/")[-1] + f":{frame.f_lineno}"
    try:
        rel = Path(name).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None
    if not rel.startswith("pretrain/") or rel.startswith(HOST_ONLY):
        return None
    return f"{rel}:{frame.f_code.co_name}"


def _counting(name: str):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if steps:
            site = _site(sys._getframe(1))
            if site:
                steps[-1].append(f"{site}.{name}")
        return original(self, *args, **kwargs)

    return read


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    for name in READS:
        setattr(torch.Tensor, name, _counting(name))
    import pretrain.train as train

    step_fn = train.train_step

    def counted_step(*args, **kwargs):
        steps.append([])
        return step_fn(*args, **kwargs)

    train.train_step = counted_step
    code = train.main(argv)
    out.write_text(json.dumps({"steps": steps, "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
