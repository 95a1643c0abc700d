"""The run's parts, built once before the loop: ``Run`` holds what ``fit`` and ``checkpoint`` share
(``train_step`` is given only its ``StepParts``, ``Run.step_parts``); ``build_run`` assembles it from
small ``build_*`` steps (precision, model and engine, attention, resume, data stream, tracker, peak)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from data_prep.common.manifest import Manifest
from pretrain.checkpoint import checkpointing, phases, reshard
from pretrain.checkpoint import nodes as checkpoint_nodes
from pretrain.checkpoint.hf_export import final_export_dir
from pretrain.checkpoint.mirror import CheckpointMirror
from pretrain.checkpoint.state import STATE_KEY, TrainState
from pretrain.config import loader as configlib
from pretrain.config.schema import Config
from pretrain.data import make_train_stream, mixture
from pretrain.data.stream import Stream
from pretrain.eval.downstream import PreparedTask, probe_metrics
from pretrain.model import fp8, keyed_dropout
from pretrain.model.flops import mlm_flops_per_sequence
from pretrain.model.masking import SpecialIds
from pretrain.model.mlm import MLMModel, build_model
from pretrain.model.schedule import continue_schedule
from pretrain.runtime import allocator, attention, hardware, micro_batch
from pretrain.runtime import engine as eng
from pretrain.runtime.step_speed import step_probe
from pretrain.step import StepParts, StopSignal, deferrable
from pretrain.tracking import console, make_tracker, resume_log, run_params
from pretrain.tracking.base import Tracker
from pretrain.tracking.heartbeat import Heartbeat

log = logging.getLogger("pretrain")


@dataclass
class Run:
    """What ``fit`` and ``checkpoint`` share: the run's parts, built once by ``build_run``; ``train_step``
    reads the few of them in ``step_parts``."""

    cfg: Config
    info: eng.DistInfo
    nodes: checkpoint_nodes.NodeLayout
    manifest: Manifest
    tasks: list[PreparedTask]
    stop: StopSignal
    special: SpecialIds
    model: MLMModel
    engine: eng.Engine
    optimizer: torch.optim.Optimizer  # ours, inside DeepSpeed's wrappers (its updates can be skipped)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: TrainState
    stream: Optional[Stream] = None
    tracker: Optional[Tracker] = None
    mirror: Optional[CheckpointMirror] = None  # a folder writer's uploader to train.checkpoint_mirror
    resolved_yaml: str = ""
    peak: float = 0.0
    mfu_check: Optional[hardware.MfuCheck] = None
    exit_code: int = 0
    status: str = "FAILED"  # what the tracker marks the run with when fit returns
    latest: dict = field(default_factory=dict)  # the last value of every metric, for the summary
    cuda_graphs: bool = False  # the compiled step replays as CUDA graphs (impl.cuda_graphs)
    precision: str = ""  # as impl.precision resolved
    heartbeat: Optional[Heartbeat] = None  # the line said when the run has been quiet (fit's)
    started: float = field(default_factory=time.perf_counter)  # this job's
    seconds_before: float = 0.0  # the run's wall seconds before this job (the resumed checkpoint's)

    @property
    def step_parts(self) -> StepParts:
        """What ``train_step`` reads of the run."""
        return StepParts(
            engine=self.engine,
            optimizer=self.optimizer,
            model=self.model,
            device=self.info.device,
            world=self.info.world,
            special=self.special,
            masking=self.cfg.masking,
            max_steps=self.cfg.train.max_steps,
            zero_stage=self.cfg.impl.zero_stage,
            stop=self.stop,
            deferred_reads=self.cfg.impl.deferred_reads and deferrable(self.optimizer),
            cuda_graphs=self.cuda_graphs,
        )

    @property
    def export_engine(self):
        """Where an export takes the weights from: the engine when rank 0's folder lacks other ranks'
        shards (node-local disks, ZeRO 1-3), else (None) the checkpoint's files."""
        return self.engine if not self.nodes.shared and self.cfg.impl.zero_stage > 0 else None

    def flops_per_seq(self, masking_rate: float) -> float:
        seq_len = self.manifest.seq_len
        return mlm_flops_per_sequence(
            self.model.hf_model.config, seq_len, masking_rate * seq_len, self.cfg.impl.sparse_head
        )

    def doing(self, what: str) -> None:
        """What the run does between steps, for the line said when it has been quiet for long."""
        if self.heartbeat is not None:
            self.heartbeat.doing(what)

    def emit(self, metrics: dict, step: int, suffix: str = "") -> None:
        if metrics:
            log.info("step %d %s%s", step, console.metrics_line(metrics), suffix)
            self.tracker.log_metrics(metrics, step)
            resume_log.remember(self.state, metrics, step)
            self.latest.update(metrics)

    def probe(self, step: int) -> None:
        """The downstream probe on the trainer's own weights (whole at ZeRO-3: every rank calls)."""
        self.emit(self.probe_scores(), step)

    def probe_scores(self, label: str = "") -> dict[str, float]:
        self.engine.eval()
        with eng.full_weights(self.engine) as module:
            scores = probe_metrics(
                module.hf_model.base_model,
                self.tasks,
                self.info.device,
                self.cfg.eval.downstream_batch_size,
                label=label,
            )
        self.engine.train()
        return scores


@dataclass(frozen=True)
class BuiltEngine:
    """What ``build_engine`` makes: the model, its precision and DeepSpeed's engine around it."""

    special: SpecialIds
    model: MLMModel
    engine: eng.Engine
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ds_config: dict  # the DeepSpeed JSON used
    optimizer: torch.optim.Optimizer  # ours, inside DeepSpeed's wrappers
    precision: str
    precision_why: str  # how impl.precision resolved, for the start line


def build_engine(
    cfg: Config, manifest: Manifest, resume_from: str | None, info: eng.DistInfo, node_local: bool
) -> BuiltEngine:
    """The model (in a new phase's shape when it starts from another run), its precision (``auto``
    times this model's step on a CPU), and DeepSpeed's engine."""
    special = SpecialIds.from_manifest(manifest)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    rows = eng.rank0_value(phases.saved_vocab_rows(cfg, resume_from) if info.rank == 0 else None)
    model = build_model(
        cfg.model,
        manifest.tokenizer.vocab_size,
        special,
        cfg.impl,
        seq_len=manifest.seq_len,
        shape_from=phases.model_shape_file(cfg, resume_from),
        vocab_rows=rows,
        resuming=resume_from is not None,
    )
    precision, why = build_precision(cfg, model, manifest, resume_from, info)
    if precision == "fp8":  # before any timing: the micro-batch and the attention are timed in float8
        why += f", {fp8.convert(model)} encoder linear layers in float8"
    choose_micro_batch(model, cfg, info, precision, manifest.seq_len)
    per_element = cfg.impl.dropout_hash == "per_element"
    model.dropout_key = keyed_dropout.install(model.hf_model, cfg.train.seed, per_element)  # the same at any layout
    model.dropout_key.prepare(info.device)
    model.fixed_predictions = cfg.masking.fixed_count
    choose_attention(model, cfg, info, precision, manifest.seq_len)
    engine, scheduler, ds_config, optimizer = eng.initialize(model, cfg, info, precision, node_local)
    return BuiltEngine(special, model, engine, scheduler, ds_config, optimizer, precision, why)


def build_precision(cfg: Config, model: MLMModel, manifest: Manifest, resume_from: str | None, info: eng.DistInfo):
    """(precision, why): ``impl.precision`` as configured; ``auto`` keeps the precision the checkpoint a
    run resumes from was trained in (a new timing on a busy machine, or at another world size, had
    switched a resumed bf16 run to fp32, 7x slower a step), else times this model's step on a CPU.
    Every node takes the first rank's choice."""
    saved = None
    if cfg.impl.precision == "auto" and resume_from and info.rank == 0:
        layout = reshard.read_layout(checkpointing.checkpoint_root(cfg) / resume_from)
        saved = layout.get("precision") if layout and layout.get("precision") in ("fp32", "bf16") else None
    saved = eng.rank0_value(saved)
    if saved:
        return saved, f"auto: {saved}, as checkpoint {resume_from} was trained (impl.precision=fp32 or bf16 changes it)"
    probe = step_probe(model, cfg.impl.micro_batch_size, manifest.seq_len, cfg.masking.rate)
    with torch.random.fork_rng():  # the timing leaves the run's RNG as it was
        precision, why = hardware.resolve_precision(cfg.impl.precision, info.device, probe)
    return eng.rank0_value((precision, why))


def choose_micro_batch(model: MLMModel, cfg: Config, info: eng.DistInfo, precision: str, seq_len: int) -> None:
    """``impl.micro_batch_size``: as configured, or with ``auto`` the micro-batch of the most tokens a
    second among those that divide the global batch here, timed once on the first rank
    (pretrain.runtime.micro_batch); every rank takes it, and the config from here on holds it."""
    if cfg.impl.micro_batch_size != "auto":
        return
    choice = None
    if info.rank == 0:
        sizes = micro_batch.candidates(cfg.train.global_batch_size, info.world, info.device.type)
        shape = step_probe(model, 1, seq_len, cfg.masking.rate).shape
        dtype = hardware.DTYPES[precision]
        held = micro_batch.engine_state_bytes(
            eng.num_parameters(model), precision, cfg.impl.zero_stage, info.world, cfg.impl.offload_optimizer
        )
        choice = micro_batch.choose(model, sizes, seq_len, cfg.masking.rate, dtype, info.device, shape, held_bytes=held)
    size, why = eng.rank0_value(choice)
    cfg.impl.micro_batch_size = size
    log.info("micro-batch: %d sequences (%s)", size, why)


def choose_attention(model: MLMModel, cfg: Config, info: eng.DistInfo, precision: str, seq_len: int) -> None:
    """The attention kernel: ``impl.attention``, or with ``auto`` the fastest at this run's shape,
    timed once on the first rank (pretrain.runtime.attention); every rank runs the same."""
    choice = None
    if info.rank == 0:
        choice = attention.resolve(
            model, cfg.impl.attention, info.device, hardware.DTYPES[precision], cfg.impl.micro_batch_size, seq_len
        )
    name, why = eng.rank0_value(choice)
    model.use_attention(name)
    log.info("attention: %s (%s)", name, why)


def restore(run: Run, resume_from: str | None) -> dict:
    """Load the checkpoint to resume from, or a new phase's start; the schedule follows the config.
    Returns where a new phase came from (empty otherwise)."""
    if resume_from:
        run.state.load_state_dict(checkpointing.load(run.engine, run.cfg, resume_from, run.nodes)[STATE_KEY])
        run.seconds_before = run.state.seconds
    origin = (
        phases.start_from(run.engine, run.cfg, run.nodes.writes_folder)
        if run.cfg.train.init_from_checkpoint and not resume_from
        else {}
    )
    log.info(continue_schedule(run.scheduler, run.cfg))  # the config's schedule, whatever a checkpoint held
    return origin


def keep_attention(run: Run) -> None:
    """A resumed run computes with the attention its first launch chose (at any layout), unless
    impl.attention now names one; the choice goes into every checkpoint."""
    recorded, model = run.state.attention, run.model
    if recorded and run.cfg.impl.attention == "auto" and recorded != model.attention:
        if recorded == "flash_attention_2" and model.config._attn_implementation != recorded:
            # the kernels compute the same maths up to rounding: continuing beats refusing a requeue
            log.warning(
                "attention: this run started with flash_attention_2, which cannot run here "
                "(see the model line); continuing with %s, as timed here",
                model.attention,
            )
        else:
            log.info("attention: %s, as this run started (timed here: %s)", recorded, model.attention)
            model.use_attention(recorded)
    run.state.attention = model.attention


def as_trained(cfg: Config, model: MLMModel) -> Config:
    """The config with the architecture actually trained: a run started from a checkpoint
    (``model.init_from``, ``train.init_from_checkpoint``) has that checkpoint's shape, whatever
    ``model.*`` says (the MLflow params and the resolved config.yaml had said 4 x 256, the
    schema's defaults, for a 6 x 384 encoder)."""
    if not (cfg.model.init_from or cfg.train.init_from_checkpoint):
        return cfg
    return dataclasses.replace(cfg, model=cfg.model.with_shape_of(model.hf_model.config))


def loader_prefetch(cfg: Config, world: int) -> int:
    """``impl.prefetch_factor``, raised where the workers would buffer less than a step: the next step's
    micro-batches are then read while the current one trains, not pulled after its last wait
    (base.yaml on one GPU: 32 micro-batches a step, of which 4 workers x 4 buffered 16)."""
    workers = cfg.impl.num_workers
    if workers <= 0:
        return cfg.impl.prefetch_factor
    return max(cfg.impl.prefetch_factor, -(-cfg.grad_accum_steps(world) // workers))


def build_stream(run: Run, resume_from: str | None):
    cfg, info = run.cfg, run.info
    prefetch = loader_prefetch(cfg, info.world)
    stream = make_train_stream(cfg, run.manifest, info.rank, info.world, cfg.impl.num_workers, prefetch)
    if resume_from:
        stream.load_state_dict(run.state.data)  # another world size or micro-batch continues the same order
    return stream


def build_tracker(run: Run, origin: dict, precision: str, ds_config: dict):
    cfg, state = run.cfg, run.state
    if run.info.rank == 0 and cfg.train.resume == "none":  # a fresh start is a new tracking run too
        (Path(cfg.train.out_dir) / "mlflow_run_id").unlink(missing_ok=True)
    tracker = make_tracker(phases.tracked_under(cfg, origin), run.info.rank, resume_step=state.step)
    params = {**run_params(as_trained(cfg, run.model), run.info.world, precision, run.manifest), **origin}
    state.run_id = eng.rank0_value(
        tracker.start(
            state.run_id, params, {"config.yaml": run.resolved_yaml, "deepspeed.json": json.dumps(ds_config, indent=2)}
        )
    )
    return tracker


def compile_model(run: Run, precision: str) -> None:
    """``torch.compile`` the engine's model where it pays (``impl.compile``), its forward and backward
    replayed as CUDA graphs where asked and possible (``impl.cuda_graphs``, said on its own line)."""
    cfg, device_type = run.cfg, run.info.device.type
    compiled = cfg.compile_now(cfg.train.max_steps - run.state.step, device_type, precision)
    run.cuda_graphs, why = eng.cuda_graphs_plan(cfg, device_type, compiled)
    if compiled:
        eng.compile_engine(run.engine, run.cuda_graphs, cfg.impl.autotune_kernels)
        if cfg.impl.autotune_kernels:
            log.info("compile: inductor's kernels chosen by timing (impl.autotune_kernels: minutes more at the start)")
    if cfg.impl.cuda_graphs is True or (cfg.impl.cuda_graphs == "auto" and device_type == "cuda"):
        log.info("CUDA graphs: %s", why)


def build_run(
    cfg: Config, manifest: Manifest, tasks: list, resume_from: str | None, info: eng.DistInfo, stop: StopSignal
) -> Run:
    """Assemble the run: precision, model and engine, resume, data stream, tracker, FLOPs and peak."""
    if info.device.type == "cpu" and cfg.impl.keep_freed_cpu_memory and allocator.in_use() == "glibc":
        hardware.keep_freed_cpu_memory()  # no page faults on every step's large tensors (tcmalloc keeps them anyway)
    nodes = checkpoint_nodes.probe(cfg.train.out_dir)  # one shared train.out_dir, or one per node
    built = build_engine(cfg, manifest, resume_from, info, not nodes.shared)
    precision, why, model = built.precision, built.precision_why, built.model
    run = Run(
        cfg=cfg,
        info=info,
        nodes=nodes,
        manifest=manifest,
        tasks=tasks,
        stop=stop,
        special=built.special,
        model=model,
        engine=built.engine,
        optimizer=built.optimizer,
        scheduler=built.scheduler,
        state=TrainState(config=configlib.redact(configlib.to_dict(cfg))),  # a checkpoint holds no credentials
        resolved_yaml=configlib.dump_yaml(as_trained(cfg, model)),
        precision=precision,
    )
    resume_from = eng.rank0_value(resume_from)  # the first rank chose it, holding the run lock
    if resume_from:
        checkpointing.ensure_on_every_node(cfg, resume_from, nodes)
    origin = restore(run, resume_from)
    keep_attention(run)
    compile_model(run, precision)
    run.stream = build_stream(run, resume_from)
    run.tracker = build_tracker(run, origin, precision, built.ds_config)
    if cfg.train.checkpoint_mirror and nodes.writes_folder:
        run.mirror = CheckpointMirror(cfg.train.checkpoint_mirror, cfg.train.keep_checkpoints, nodes)
        run.mirror.catch_up(checkpointing.checkpoint_root(cfg), final_export_dir(cfg.train.out_dir))
    resume_log.relog(run.tracker, run.state)  # a kill may have cut the checkpoint step's line short
    run.peak, peak_source = hardware.peak_tflops(info.device, precision, cfg.impl.peak_tflops)
    run.mfu_check = hardware.MfuCheck(run.peak, peak_source)
    log.info(
        "start: step %d%s, world %d, grad_accum %d, precision %s (%s), attention %s within each %s, ZeRO %d%s, "
        "%d params, peak %.3f TFLOP/s per process (%s), allocator %s",
        run.state.step,
        f" (resumed from {resume_from})" if resume_from else "",
        info.world,
        cfg.grad_accum_steps(info.world),
        precision,
        why,
        model.attention,
        cfg.model.attention_scope,
        cfg.impl.zero_stage,
        ", activation checkpointing" if model.checkpointed else "",
        eng.num_parameters(model),
        run.peak,
        peak_source,
        allocator.describe(info.device.type),
    )
    if mixture.is_mixture(cfg):
        log.info("data mixture:\n  %s", "\n  ".join(run.stream.plan_lines(cfg.train.max_steps)))
    return run
