"""Resume a checkpoint at another world size, ZeRO stage or precision.

DeepSpeed's checkpoints are tied to their layout: ZeRO 1/2 (and BF16_Optimizer, bf16 with fp32
gradient accumulation) store each rank's slice of one flat fp32 buffer per parameter group, ZeRO 3
stores each parameter cut in ``world`` padded pieces, and stage 0 stores the client optimiser's
state dict by position (in bf16, beside FP16_UnfusedOptimizer's per-parameter fp32 masters).
Loading at another world size or stage fails deep inside DeepSpeed. Here every layout is
consolidated once, by rank 0, into DeepSpeed's universal folder format
(``zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` plus ``zero/optimizer_state.pt``), cached
inside the checkpoint's tag folder, and loaded into the running engine: through the ZeRO / BF16
optimiser's own universal loader where there is one (its ``load_state_dict(checkpoint_folder=)``),
and at stage 0, where DeepSpeed has none, into the module, the fp32 masters and the client
optimiser's ``load_state_dict``. No DeepSpeed config key is involved.

API for the checkpoint code: ``checkpoint_layout(engine)`` (saved as ``layout.json`` beside each
checkpoint), ``read_layout(folder)``, ``check_convertible(saved, wanted)`` (before the process group
starts) and ``load_resharded(engine, root, tag, saved)`` (instead of ``engine.load_checkpoint``
when ``needs_conversion(saved, checkpoint_layout(engine))``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from pretrain.checkpoint import safe_load
from pretrain.checkpoint.files import LAYOUT_FILE, MODEL_STATES_FILE, UNIVERSAL_DIR, rank_files
from pretrain.runtime import hardware
from pretrain.tracking.console import ByteMeter

log = logging.getLogger("pretrain")


_DONE = "conversion.json"  # written last into the universal folder
PROGRESS_S = 30.0  # a conversion reading or writing says how far along it is this often
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's and our LAMB's state besides "step"
# Keys of a DeepSpeed model-states file that are DeepSpeed's, not the client's (as engine.load_checkpoint).
_DEEPSPEED_KEYS = {
    "module",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "lr_scheduler",
    "optimizer",
}
# The parts of a layout that change how state is stored; the rest is informative.
_LAYOUT_KEYS = ("world", "zero_stage", "precision", "offload_optimizer")


class ReshardError(RuntimeError):
    """A checkpoint whose saved layout cannot be converted into the running one."""


# ------------------------------------------------------------------ layouts
def param_names_by_group(engine) -> Optional[list[list[str]]]:
    """Parameter names in the optimiser's group order, where its groups still hold the module's own
    parameters (fp32 at stage 0; bf16 at stage 0, whose FP16_UnfusedOptimizer keeps them as
    ``fp16_groups``): the layouts whose files index state by position, not by name."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    for groups in (getattr(opt, "fp16_groups", None), [g["params"] for g in opt.param_groups]):
        if groups and all(id(p) in names for group in groups for p in group):
            return [[names[id(p)] for p in group] for group in groups]
    return None


def is_partitioned(engine) -> bool:
    """ZeRO 1-3 and BF16_Optimizer own flat fp32 partitions; below that, every rank holds it all."""
    return any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in engine.module.parameters())


def _optimizer_name(engine) -> str:
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and isinstance(getattr(opt, "optimizer"), torch.optim.Optimizer):
        opt = opt.optimizer
    return type(opt).__name__


def checkpoint_layout(engine) -> dict[str, Any]:
    """How the running engine stores its state; saved beside each checkpoint as ``layout.json``."""
    import deepspeed

    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return {
        "world": engine.dp_world_size,
        "zero_stage": int(engine.zero_optimization_stage()),
        "precision": precision,
        "offload_optimizer": bool(engine.zero_cpu_offload()),
        "optimizer": _optimizer_name(engine),
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__.split("+")[0],
        "param_shapes": {n: list(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()},
        "param_names_by_group": param_names_by_group(engine),
    }


def wanted_layout(world: int, zero_stage: int, precision: str, offload_optimizer: bool, optimizer: str) -> dict:
    """The layout a run will have, known from its config before any process group starts
    (``precision`` resolved: fp32 | bf16 | fp16 | fp8, kept as its weights are; ``optimizer``: ``optim.name``)."""
    return {
        "world": world,
        "zero_stage": zero_stage,
        "precision": hardware.weights_precision(precision),
        "offload_optimizer": offload_optimizer,
        "optimizer": optimizer,
    }


def config_layout(cfg) -> dict:
    """The layout a config will run at on this machine, known before any model exists: on a CPU with
    native bf16, ``impl.precision=auto`` is guessed bf16 (the trainer times the step and may take
    fp32). Only fp16 decides what can be converted, and ``auto`` never picks it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = hardware.auto_precision(device)[0] if cfg.impl.precision == "auto" else cfg.impl.precision
    return wanted_layout(cfg.world_size(), cfg.impl.zero_stage, precision, cfg.impl.offload_optimizer, cfg.optim.name)


def read_layout(folder: Path) -> Optional[dict]:
    path = Path(folder) / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def describe(layout: dict) -> str:
    offload = ", optimizer offloaded" if layout.get("offload_optimizer") else ""
    return f"world {layout['world']} / ZeRO {layout['zero_stage']} / {layout['precision']}{offload}"


def needs_conversion(saved: dict, running: dict) -> bool:
    return any(saved[k] != running[k] for k in _LAYOUT_KEYS)


_OPTIMIZER_FAMILY = {
    "AdamW": "adamw",
    "FusedAdam": "adamw",
    "DeepSpeedCPUAdam": "adamw",
    "Lamb": "lamb",
    "FusedLamb": "lamb",
    "adamw": "adamw",
    "lamb": "lamb",
}


def check_convertible(saved: dict, wanted: dict) -> list[str]:
    """Problems that make ``saved`` unloadable as ``wanted`` (empty: fine). Call before the process
    group starts; raise ``ReshardError`` (or report with the other config problems) on any."""
    problems = []
    if saved is None:
        return problems
    families = [_OPTIMIZER_FAMILY.get(o, o) for o in (saved.get("optimizer"), wanted.get("optimizer"))]
    if families[0] != families[1]:
        problems.append(
            f"optimizer {saved.get('optimizer')} was saved, {wanted.get('optimizer')} is configured: "
            "moments of one optimiser do not resume another"
        )
    if not needs_conversion(saved, wanted):
        return problems
    if "fp16" in (saved["precision"], wanted["precision"]):
        problems.append(
            f"precision fp16 (saved {saved['precision']}, wanted {wanted['precision']}): its "
            "loss-scaler state is not converted; only fp32 and bf16 change layout"
        )
    if saved["zero_stage"] == 0 and not saved.get("param_names_by_group"):
        problems.append("the layout file has no param_names_by_group, needed to read a ZeRO 0 checkpoint")
    return problems


# ------------------------------------------------------- reading any layout
def _load(path: Path) -> Any:
    return safe_load.load(path)


def _group_state(base: Any, group: int) -> tuple[dict, dict]:
    """(state, hyperparameters) of flat group ``group`` in a saved base-optimiser state."""
    if isinstance(base, dict):  # torch state_dict: state keyed by group index
        return base["state"].get(group, {}), {k: v for k, v in base["param_groups"][group].items() if k != "params"}
    return base[group], {}  # DeepSpeed's "elastic" list of per-group states


def _consolidate_flat_partitions(
    optim_files: list[Path], shapes: dict, load, moments: tuple[str, ...]
) -> tuple[dict, Any, list[dict]]:
    """ZeRO 1/2 and BF16_Optimizer: every rank holds one contiguous slice of each group's flat fp32
    buffer, and ``param_slice_mappings`` says where each parameter's fragment lies in it; a
    parameter's fragments follow one another in rank order."""
    whole = _Gathered(shapes)
    step, hyper = None, []
    for rank_file in optim_files:
        osd = load(rank_file)["optimizer_state_dict"]
        hyper = []
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            state, group_hyper = _group_state(osd["base_optimizer_state"], g)
            hyper.append(group_hyper)
            step = state.get("step", step)
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g], **{k: state[k] for k in moments if k in state}}
            for name, where in mapping.items():
                whole.append(
                    name, {key: tensor.flatten().narrow(0, where.start, where.numel) for key, tensor in flat.items()}
                )
    return whole.result(), step, hyper


class _Gathered:
    """Whole tensors filled piece by piece as each rank file is read: the file's bytes are read
    (from its memory map) while its turn lasts, so the reading's progress line is true, and no list
    of pieces is held beside the result."""

    def __init__(self, shapes: dict):
        self.shapes, self.tensors, self.filled = shapes, {}, {}

    def put(self, name: str, at: int, pieces: dict[str, torch.Tensor]) -> None:
        numel = math.prod(self.shapes[name])
        for key, piece in pieces.items():
            if piece.numel():
                by_key = self.tensors.setdefault(name, {})
                if key not in by_key:
                    by_key[key] = torch.empty(numel, dtype=piece.dtype)
                by_key[key].narrow(0, at, piece.numel()).copy_(piece)
        self.filled[name] = self.filled.get(name, 0) + next(iter(pieces.values())).numel()

    def append(self, name: str, pieces: dict[str, torch.Tensor]) -> None:
        self.put(name, self.filled.get(name, 0), pieces)

    def result(self) -> dict:
        short = [n for n, count in self.filled.items() if count != math.prod(self.shapes[n])]
        if short:
            raise ReshardError(f"the rank files do not hold every element of {short[:5]}")
        return {n: {k: t.view(self.shapes[n]) for k, t in by_key.items()} for n, by_key in self.tensors.items()}


def _consolidate_zero3(folder: Path, load, moments: tuple[str, ...]) -> tuple[dict, Any, list[dict], dict]:
    """ZeRO 3: each parameter is cut into ``world`` pieces of ceil(numel / world), the last padded;
    a rank's flat group is its pieces of the group's parameters, one after another. Also returns rank
    0's model-states dict, read once with the others."""
    optim_files, model_files = rank_files(folder, "optim_states.pt"), rank_files(folder, "model_states.pt")
    world = len(optim_files)
    whole: Optional[_Gathered] = None
    step, hyper, first_model_states = None, [], {}
    for rank, (opt_file, model_file) in enumerate(zip(optim_files, model_files)):
        osd = load(opt_file)["optimizer_state_dict"]
        base = osd["optimizer_state_dict"]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
        model_states = load(model_file)
        if rank == 0:
            first_model_states = model_states
            whole = _Gathered({n: s for group in model_states["param_shapes"] for n, s in group.items()})
        for g, group_shapes in enumerate(model_states["param_shapes"]):
            state = base["state"].get(g, {})
            step = state.get("step", step)
            flat = {"fp32": osd["fp32_flat_groups"][g], **{k: state[k] for k in moments if k in state}}
            offset = 0
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / world)
                mine = max(0, min(part, numel - rank * part))
                whole.put(name, rank * part, {key: t.flatten().narrow(0, offset, mine) for key, t in flat.items()})
                offset += part
    return (whole.result() if whole else {}), step, hyper, first_model_states  # no rank files: named by the caller


def _consolidate_unpartitioned(
    model_states: dict, layout: dict, moments: tuple[str, ...]
) -> tuple[dict, Any, list[dict]]:
    """Stage 0: the optimiser's state is keyed by position in its groups (names from the layout
    file); the fp32 weights are the module's own (fp32) or FP16_UnfusedOptimizer's masters (bf16)."""
    module, optim = model_states["module"], model_states["optimizer"]
    masters = optim.get("fp32_groups")
    base = optim["optimizer_state_dict"] if masters is not None else optim
    params, step, index = {}, None, 0
    for g, group_names in enumerate(layout["param_names_by_group"]):
        for i, name in enumerate(group_names):
            state = base["state"].get(index, {})
            step = state.get("step", step)
            fp32 = masters[g][i] if masters is not None else module[name]
            params[name] = {"fp32": fp32.float(), **{k: state[k] for k in moments if k in state}}
            index += 1
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    return params, step, hyper


def consolidate(folder: Path, layout: dict, moments: tuple[str, ...] = MOMENTS) -> tuple[dict, Any, list[dict], dict]:
    """Full fp32 parameters and optimiser ``moments`` by parameter name, the optimiser step, the
    per-group hyperparameters and rank 0's model-states dict (schedule, counters, client state).
    Reading the files says how far along it is every ``PROGRESS_S``. An export takes no moments: the
    files are memory-mapped (``safe_load.load``), so those are never even read."""
    folder = Path(folder)
    zero3 = layout["zero_stage"] == 3
    reading = rank_files(folder, "optim_states.pt")
    reading += rank_files(folder, "model_states.pt") if zero3 else [folder / MODEL_STATES_FILE]
    meter = ByteMeter(f"reading checkpoint {folder}", sum(f.stat().st_size for f in reading), log.info, PROGRESS_S)

    def load(path: Path) -> Any:
        meter.starting(path.stat().st_size)
        return safe_load.load(path, mmap=True)  # what is gathered is copied out (_Gathered)

    # The saved fp32 partitions are Parameters that require grad: pieces cut from them under autograd
    # kept every whole rank file's partition alive through their graph (and its memory map open).
    with torch.no_grad():
        if zero3:
            params, step, hyper, model_states = _consolidate_zero3(folder, load, moments)
        else:
            model_states = load(folder / MODEL_STATES_FILE)
            optim_files = rank_files(folder, "optim_states.pt")
            if optim_files:
                params, step, hyper = _consolidate_flat_partitions(optim_files, layout["param_shapes"], load, moments)
            else:
                params, step, hyper = _consolidate_unpartitioned(model_states, layout, moments)
    shards = len(rank_files(folder, "optim_states.pt"))
    if shards and shards != layout["world"]:
        raise ReshardError(
            f"{folder}: {LAYOUT_FILE} says world {layout['world']}, but {shards} optimiser shard files are there"
        )
    if step is None:  # DeepSpeed's fused kernels count steps per group
        step = next((h["step"] for h in hyper if "step" in h), None)
    missing = sorted(set(layout["param_shapes"]) - set(params))
    if missing:
        raise ReshardError(f"{folder}: no saved state for parameters {missing[:5]}")
    return params, step, hyper, model_states


def _write_universal(out: Path, params: dict, step: Any, hyper: list[dict], model_states: dict, source: Path) -> None:
    """DeepSpeed's universal layout, which its ZeRO and BF16 optimisers load at any world size; says
    how far along it is every ``PROGRESS_S`` (``source``: the checkpoint converted)."""
    import deepspeed

    zero = out / "zero"
    total = sum(t.numel() * 4 for by_key in params.values() for t in by_key.values())  # written as fp32
    meter = ByteMeter(f"writing checkpoint {source} in the universal layout", total, log.info, PROGRESS_S)
    for name, by_key in params.items():
        (zero / name).mkdir(parents=True)
        for key, tensor in by_key.items():
            meter.starting(tensor.numel() * 4)
            torch.save({"param": tensor.float().contiguous()}, zero / name / f"{key}.pt")
        if step is not None:
            torch.save(step, zero / name / "step.pt")
    global_state = {
        "param_groups": hyper,  # read by ZeRO 1/2 and BF16
        "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": hyper},  # read by ZeRO 3
        "ds_version": deepspeed.__version__,
    }
    torch.save(global_state, zero / "optimizer_state.pt")
    torch.save({k: v for k, v in model_states.items() if k != "module" and k != "optimizer"}, out / "model_states.pt")


def ensure_universal(
    tag_folder: Path, saved: dict, out: Optional[Path] = None, converts: Optional[bool] = None
) -> Path:
    """The consolidated folder (``out``, by default cached inside the tag folder), written once per
    folder by the rank that ``converts`` (rank 0 by default), atomically, while the others wait; a
    failure there is raised on every rank instead of leaving them at a barrier."""
    tag_folder = Path(tag_folder)
    out = Path(out) if out is not None else tag_folder / UNIVERSAL_DIR
    converts = dist.get_rank() == 0 if converts is None else converts
    failure = None
    if converts and not (out / _DONE).is_file():
        try:
            for stale in out.parent.glob(f"{out.name}.tmp*"):  # from a conversion that crashed
                shutil.rmtree(stale, ignore_errors=True)
            tmp = out.parent / f"{out.name}.tmp{os.getpid()}"
            tmp.mkdir()
            params, step, hyper, model_states = consolidate(tag_folder, saved)
            _write_universal(tmp, params, step, hyper, model_states, tag_folder)
            (tmp / _DONE).write_text(json.dumps({"from": saved}, indent=1) + "\n")
            shutil.rmtree(out, ignore_errors=True)  # an incomplete one (no _DONE) cannot be trusted
            os.replace(tmp, out)
        except Exception as e:  # noqa: BLE001  (re-raised on every rank below)
            failure = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    if any(failures):
        raise ReshardError(f"converting checkpoint {tag_folder} failed: {'; '.join(f for f in failures if f)}")
    return out


# ------------------------------------------------------ loading any layout
def _set_step(optimizer: torch.optim.Optimizer, universal: Path) -> None:
    step = _load(universal / "zero" / "optimizer_state.pt")["optimizer_state_dict"]["state"][0]["step"]
    if step is not None:
        set_step_count(optimizer, int(step.item() if torch.is_tensor(step) else step))


def set_step_count(optimizer: torch.optim.Optimizer, count: int) -> None:
    """Each kernel counts steps its own way: torch's Adam(W) a float tensor per parameter, DeepSpeed's
    fused kernels an int per group, DeepSpeedCPUAdam and our LAMB an int per parameter. torch's tensor
    goes where its own ``load_state_dict`` puts it: beside the parameter for a fused or capturable
    group (the fused CUDA kernel refuses a CPU step), on the CPU otherwise.

    Every state entry gets its own count, including those of parameters outside ``param_groups``:
    ZeRO 3 puts each sub-group's fp32 partition into its group only for the step, and its universal
    loader gives all of them one shared step tensor, which torch's kernels then advance in place once
    per sub-group (two groups: the count ran two steps a step, and Adam's bias correction drifted)."""
    if type(optimizer).__name__ in ("FusedAdam", "FusedLamb"):
        for group in optimizer.param_groups:
            group["step"] = count
        return
    # torch's AdamW subclasses Adam only from 2.7; both refuse a step that is not a tensor
    tensor_steps = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for param, state in optimizer.state.items():
        if not state:
            continue
        group = group_of.get(id(param), optimizer.param_groups[0])  # ZeRO 3: the flags are every group's
        on_device = bool(group.get("fused") or group.get("capturable"))
        state["step"] = (
            torch.tensor(float(count), dtype=torch.float32, device=param.device if on_device else "cpu")
            if tensor_steps
            else count
        )


def _restore_hyperparameters(groups: list[dict], saved: list[dict]) -> None:
    """lr (and initial_lr, betas, weight decay...) per group; only keys the running optimiser knows,
    so a kernel switch (FusedAdam <-> torch AdamW) brings no foreign flags."""
    for group, saved_group in zip(groups, saved):
        group.update({k: v for k, v in saved_group.items() if k in group and k != "params"})


def _load_unpartitioned(engine, universal: Path) -> None:
    """No DeepSpeed optimiser here reads the universal folder: the module, FP16_UnfusedOptimizer's
    fp32 masters (bf16) and the client optimiser's ``load_state_dict`` take the state directly."""
    zero = universal / "zero"
    masters = getattr(engine.optimizer, "fp32_groups", None)
    inner = engine.optimizer.optimizer if masters is not None else engine.optimizer
    module_params = dict(engine.module.named_parameters())
    state_dict = inner.state_dict()
    index = 0
    with torch.no_grad():
        for g, group_names in enumerate(param_names_by_group(engine)):
            for i, name in enumerate(group_names):
                fp32 = _load(zero / name / "fp32.pt")["param"]
                module_params[name].copy_(fp32)
                if masters is not None:
                    masters[g][i].copy_(fp32)
                entry = {
                    k: _load(zero / name / f"{k}.pt")["param"] for k in MOMENTS if (zero / name / f"{k}.pt").is_file()
                }
                if (zero / name / "step.pt").is_file():
                    entry["step"] = _load(zero / name / "step.pt")
                if entry:
                    state_dict["state"][index] = entry
                index += 1
    _restore_hyperparameters(state_dict["param_groups"], _load(zero / "optimizer_state.pt")["param_groups"])
    inner.load_state_dict(state_dict)
    _set_step(inner, universal)


def _load_partitioned(engine, universal: Path) -> None:
    """ZeRO 1/2/3 and BF16_Optimizer slice the full tensors for this rank themselves."""
    opt = engine.optimizer
    if hasattr(opt, "checkpoint_event_prologue"):
        opt.checkpoint_event_prologue()
    opt.load_state_dict(None, load_optimizer_states=True, load_from_fp32_weights=True, checkpoint_folder=str(universal))
    if hasattr(opt, "checkpoint_event_epilogue"):
        opt.checkpoint_event_epilogue()
    if engine.zero_optimization_stage() < 3:
        opt.update_lp_params()  # the module's weights from the fp32 masters just set
    # ZeRO 3's universal loader gives every group the hyperparameters of the first (its weight decay too)
    _restore_hyperparameters(
        opt.optimizer.param_groups, _load(universal / "zero" / "optimizer_state.pt")["param_groups"]
    )
    _set_step(opt.optimizer, universal)


def load_weights_and_moments(engine, universal: Path) -> None:
    """The fp32 weights, moments, step count and per-group hyperparameters of a consolidated folder,
    into the running engine whatever its layout; nothing else (schedule, counters, client state)."""
    problems = safe_load.code_problems(universal)  # DeepSpeed's universal loader reads it, not _load
    if problems:
        raise safe_load.UnsafeCheckpoint("; ".join(problems))
    with safe_load.weights_only():
        if is_partitioned(engine):
            _load_partitioned(engine, universal)
        else:
            _load_unpartitioned(engine, universal)


def load_resharded(engine, root: Path, tag: str, saved: dict, converts: Optional[bool] = None) -> dict:
    """Load checkpoint ``root/tag``, saved with layout ``saved``, into the running engine, whatever
    its layout; returns the client state, as ``engine.load_checkpoint`` does. ``converts``: this rank
    makes the conversion for its folder (rank 0 by default; each node's first on node-local disks)."""
    running = checkpoint_layout(engine)
    problems = check_convertible(saved, running)
    if problems:
        raise ReshardError(f"checkpoint {tag}: " + "; ".join(problems))
    if set(saved["param_shapes"]) != set(running["param_shapes"]) or any(
        list(saved["param_shapes"][n]) != running["param_shapes"][n] for n in saved["param_shapes"]
    ):
        raise ReshardError(f"checkpoint {tag}: its parameters' names or shapes differ from the model's")
    if dist.get_rank() == 0:
        log.info("checkpoint %s was saved at %s; converting to %s", tag, describe(saved), describe(running))
    universal = ensure_universal(Path(root) / tag, saved, converts=converts)
    load_weights_and_moments(engine, universal)
    model_states = _load(universal / "model_states.pt")
    if engine.lr_scheduler is not None and model_states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    engine.global_steps = model_states["global_steps"]
    engine.global_samples = model_states.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = model_states["skipped_steps"]
    return {k: v for k, v in model_states.items() if k not in _DEEPSPEED_KEYS}
