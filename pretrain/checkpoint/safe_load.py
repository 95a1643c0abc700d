"""Checkpoint files are data, never code: how every ``.pt`` file of a checkpoint is read.

A pickle may name any importable callable, and unpickling calls it: a model-states file whose
pickle calls ``os.system`` runs a command on every node that loads it. Whoever can write a shared
run folder or a mirror bucket could otherwise run code on every training node, so nothing here
unpickles with ``weights_only=False``, and neither does DeepSpeed in a process that loads one:

1. Before loading, ``code_problems(folder)`` reads each file's pickle statically
   (``torch.serialization.get_unsafe_globals_in_checkpoint``: nothing in it runs) and names every
   type outside PyTorch's weights-only set and ``ALLOWED``: the callers refuse the checkpoint with
   exit 2, naming the file and the type, before any process group starts where they can.
2. Loading is weights-only: ``load`` here, and DeepSpeed's checkpoint engine and universal loaders
   (which pass ``weights_only=False``) inside ``with weights_only():`` (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
   while inside), with ``ALLOWED`` allowed by name (``torch.serialization.add_safe_globals``). Static
   reading misses a type a pickle builds at run time, and a file in torch's legacy (non-zip) format;
   the weights-only unpickler refuses them there, and ``load`` names the file.

``ALLOWED`` is what DeepSpeed 0.19's files hold beyond tensors, numbers, strings and containers,
found by reading checkpoints of every layout this trainer writes (ZeRO 0-3, fp32 and bf16,
optimiser offload, AdamW and LAMB); each is a plain record or an enum.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

# "module.name" -> what it is in DeepSpeed's files
ALLOWED = {
    "deepspeed.utils.tensor_fragment.fragment_address": "a parameter's (numel, start) in a flat ZeRO partition",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "the static loss scaler (its scale) in ZeRO's optimiser state",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "the ZeRO stage, an int enum",
}
FORCE, NO_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_installed = False


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file that needs more than data to load: refused, nothing in it run."""


def allow_deepspeed_types() -> None:
    """``ALLOWED`` allowed by name in this process's weights-only loads, and its enums pickled by
    value in the files this process writes (``_pickle_by_value``). Idempotent; imports DeepSpeed's
    modules for them (on first call only). Called before every save and load."""
    global _installed
    if _installed:
        return
    allowed = []
    for dotted in ALLOWED:
        module, name = dotted.rsplit(".", 1)
        try:
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed: its files hold no such type either
            continue
        if isinstance(allowed[-1], enum.EnumMeta):
            _pickle_by_value(allowed[-1])
    torch.serialization.add_safe_globals(allowed)
    _installed = True


def _pickle_by_value(enum_class: type) -> None:
    """An enum member pickled as ``enum_class(value)``. Early Python 3.11 releases (Debian 12's 3.11.2
    among them; 3.11.7 and 3.12 pickle by value again) pickle it as ``getattr(enum_class, name)``, a
    call the weights-only unpickler refuses: every ZeRO checkpoint written there (its ZeroStageEnum)
    was refused at its own read-back, the demo's run ending with exit 2 after its last step."""
    enum_class.__reduce_ex__ = lambda member, protocol: (member.__class__, (member._value_,))


@contextlib.contextmanager
def weights_only():
    """While inside, every ``torch.load`` of this process is weights-only, DeepSpeed's included (they
    pass ``weights_only=False``), with ``ALLOWED`` allowed. Only while inside: other code of the
    process, and processes it starts, keep torch's own rules."""
    allow_deepspeed_types()
    saved = {name: os.environ.get(name) for name in (FORCE, NO_FORCE)}
    os.environ[FORCE] = "1"
    os.environ.pop(NO_FORCE, None)  # torch refuses both at once
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def unsafe_types(path: Path) -> list[str]:
    """The types ``path``'s pickle names beyond the weights-only set and ``ALLOWED`` (read, not run).
    A file in torch's legacy format (not a zip archive) cannot be read so: its load decides."""
    allow_deepspeed_types()
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (ValueError, RuntimeError, OSError):  # not a torch.save zip archive, or unreadable
        return []
    except (pickle.UnpicklingError, EOFError) as exc:  # opcodes torch.save does not write (another protocol)
        return [f"<a pickle the weights-only reader cannot read statically: {exc}>"]
    return sorted(found)


def code_problems(folder: Path) -> list[str]:
    """One line per ``.pt`` file under ``folder`` that holds anything but data, naming its types, or
    that is not a zip archive: torch's legacy format (a bare pickle, which neither this trainer nor
    DeepSpeed writes) cannot be read without running it, and torch's own refusal of one advises
    ``weights_only=False``."""
    problems = []
    for path in sorted(Path(folder).rglob("*.pt")):
        if not path.is_file():
            continue
        if not zipfile.is_zipfile(path):
            problems.append(
                f"{path} is not a zip archive as torch.save writes (a legacy pickle, or damaged): not loaded"
            )
        elif types := unsafe_types(path):
            problems.append(f"{path} holds {', '.join(types)}: not plain data, so it is not loaded")
    return problems


def load(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` of one checkpoint file, on the CPU, weights-only: UnsafeCheckpoint names the
    file and the type when it needs anything else (the unpickler refuses it before calling it).

    ``mmap``: memory-mapped (private, copy-on-write: nothing is written back), for a reader that
    copies out what it needs: a tensor's bytes are read when first used, so what it leaves untouched
    costs no memory (an export never reads AdamW's moments nor the module's copy of the weights;
    BENCHMARKS.md). Not for tensors kept as live state: their mapping would hold the file's disk space
    after the checkpoint is pruned."""
    allow_deepspeed_types()
    try:
        # a legacy (non-zip) file cannot be mapped: read whole, the weights-only unpickler refuses it
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL (\S+)", str(exc))
        what = named.group(1) if named else str(exc).strip().splitlines()[-1][:300]
        raise UnsafeCheckpoint(f"{path} holds {what}: not plain data, so it is not loaded") from None
