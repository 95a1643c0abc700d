"""Runs ``pretrain.train`` in this process (world size 1) and records every wait for the device a
step would have on a GPU, by call site:

- a read of a tensor's value by the host (``item``, ``tolist``, ``bool``, ``float``, ``int``,
  ``nonzero``, ``cpu``, ``numpy``);
- a device synchronisation (``torch.cuda.synchronize``, DeepSpeed's ``get_accelerator().synchronize()``,
  as its throughput timer calls it): ``.synchronize``;
- a tensor made from host values on a device (``torch.tensor(x, device=...)``: on CUDA a blocking
  copy from pageable memory, after the queued kernels): ``.tensor``;
- the other copies from host memory that indexing makes (pytorch#186482): a Python number or list
  written into a tensor (``t[i] = 1.0``: ``.setitem_host_value``) and an index given as a Python list
  (``t[[0, 2]]``, read or written: ``.index_host_list``).

On the CPU none of them waits, but each is counted where it is called. Step k's are those from the
start of its ``train_step`` to the start of the next one's. Writes ``{"steps": [[site, ...], ...]}``
as JSON to the path in argv[1]; the rest of argv goes to ``pretrain.train``. A site is
``file:function`` of the caller, or ``deepspeed/<file>:<line>`` for DeepSpeed's own; host-side data
(``pretrain/data``, the batches' checks) is not counted: those tensors never leave the host."""

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
        return "deepspeed/" + name.split("deepspeed/")[-1] + f":{frame.f_code.co_name}"
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


def _record(name: str, depth: int = 2) -> None:
    if steps:
        site = _site(sys._getframe(depth))
        if site:
            steps[-1].append(f"{site}.{name}")


def _counting_sync(original):
    def synchronize(*args, **kwargs):
        _record("synchronize")
        return original(*args, **kwargs)

    return synchronize


def _counting_tensor(original):
    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            _record("tensor")
        return original(*args, **kwargs)

    return tensor


def _host_list(index) -> bool:
    """``index`` holds a Python list (torch makes it a tensor on the host and copies it over)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) for part in parts)


def _counting_indexing():
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def read(self, index):
        if _host_list(index):
            _record("index_host_list")
        return getitem(self, index)

    def write(self, index, value):
        if _host_list(index):
            _record("index_host_list")
        if not isinstance(value, torch.Tensor):
            _record("setitem_host_value")
        return setitem(self, index, value)

    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = read, write


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    for name in READS:
        setattr(torch.Tensor, name, _counting(name))
    torch.cuda.synchronize = _counting_sync(torch.cuda.synchronize)
    torch.tensor = _counting_tensor(torch.tensor)
    _counting_indexing()
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    for accelerator in (CPU_Accelerator, CUDA_Accelerator):
        accelerator.synchronize = _counting_sync(accelerator.synchronize)
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
