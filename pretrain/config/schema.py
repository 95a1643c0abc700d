"""The training configuration: one typed schema, YAML files in ``configs/``, dotted overrides.

Settings that change *results* (model, data, masking, optim, train) are kept apart from those that
change only *speed* (``impl``: ZeRO stage, precision, micro-batch, workers, compile), as Cramming
does. The DeepSpeed JSON is derived from this (``pretrain.runtime.engine.deepspeed_config``), never kept
beside it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Union

from data_prep.common.commands import location, python_command
from data_prep.common.manifest import MANIFEST
from data_prep.common.storage import StorageError, is_url, open_store
from pretrain.config import loader as configlib
from pretrain.config.loader import ConfigError  # noqa: F401  (re-exported)
from pretrain.config.objective import MaskingConfig, ModelConfig, OptimConfig

COMPILE_AUTO_MIN_STEPS = 500  # compile's start-up paid back after 50-150 steps on mini (bench/)


def _finalize(folder: str) -> str:
    return f"run `{python_command('data_prep', 'finalize', location(folder))}` after its shard tasks"


def _data_dir_problems(folder: str) -> list[str]:
    if not folder:
        return ["dir: required (a folder written by data_prep)"]
    if is_url(folder):
        try:
            found = open_store(folder).stat(MANIFEST) is not None
        except StorageError as exc:  # unsupported scheme, no access, no such bucket
            return [f"dir: {exc}"]
        return [] if found else [f"dir: {folder!r} has no {MANIFEST} ({_finalize(folder)})"]
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        return [f"dir: {folder!r} has no {MANIFEST} ({_finalize(folder)})"]
    return []


@dataclass
class SourceConfig:
    """One corpus of a mixture (``pretrain.data.mixture``): a data_prep folder and its share of every step."""

    name: str = ""  # metric keys data/<name>/tokens, eval/<name>/loss
    dir: str = ""
    weight: float = 1.0  # relative; normalised over the sources

    def check(self) -> list[str]:
        p = []
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            p.append(f"name: required, letters, digits, '-', '_' or '.' (a metric key part), got {self.name!r}")
        p += _data_dir_problems(self.dir)
        if not self.weight > 0:
            p.append(f"weight: must be positive, got {self.weight}")
        return p


@dataclass
class DataConfig:
    # A folder written by `data_prep shard` + `data_prep finalize`; only its manifest.json is trusted.
    # With `sources`, the first source's folder (filled in when left empty): its tokenizer is the run's.
    dir: str = ""
    train_split: str = "train"
    eval_split: str = "validation"
    seed: int = 1234  # shard/block order per epoch comes from (seed, epoch)
    # A data.dir URL (s3://, https://) whose store fails transiently (connection errors, 5xx, throttling)
    # is retried this long; then the run ends with exit 3 (requeue), the last checkpoint untouched.
    remote_timeout_s: float = 300.0
    # A node's cache of whole shards of a remote data.dir, shared by its ranks (pretrain/data/shard_cache.py):
    # empty: $TMPDIR/mlm-data-cache-<uid>. Least recently used shards go past the limit; 0 turns it off.
    cache_dir: str = ""
    cache_limit_gb: float = 50.0
    # A mixture of corpora sharing one tokenizer and sequence length (pretrain.data.mixture); empty: `dir`
    # alone (one source named "main").
    sources: list[SourceConfig] = field(default_factory=list)

    def __post_init__(self):
        if self.sources and not self.dir and isinstance(self.sources[0], SourceConfig):
            self.dir = self.sources[0].dir

    def check(self) -> list[str]:
        timeout = (
            [] if self.remote_timeout_s > 0 else [f"remote_timeout_s: must be positive, got {self.remote_timeout_s}"]
        )
        timeout += (
            [] if self.cache_limit_gb >= 0 else [f"cache_limit_gb: must be 0 (off) or more, got {self.cache_limit_gb}"]
        )
        if self.sources:
            return timeout + self._sources_problems()
        return timeout + _data_dir_problems(self.dir)

    def _sources_problems(self) -> list[str]:
        """Problems of the list as a whole (each source's own fields are checked by its check())."""
        names = [s.name for s in self.sources]
        p = [f"sources: name {n!r} used twice" for n in sorted({n for n in names if names.count(n) > 1})]
        if self.dir and self.dir != self.sources[0].dir:
            p.append(
                f"dir: {self.dir!r} with sources: the run's tokenizer comes from the first source "
                f"({self.sources[0].dir!r}); leave dir empty or give a one-source run without sources"
            )
        return p


@dataclass
class SpikeGuardConfig:
    """A loss spike: a step whose loss (all ranks) is more than ``sigmas`` standard deviations above
    the mean of the last ``window`` steps, ``consecutive`` steps in a row. The run goes back to the
    last complete checkpoint from before the spike and skips the samples from there to past it
    (at least ``skip_steps`` global batches). See pretrain/guards/spike_guard.py."""

    enabled: bool = False
    window: int = 100  # recent steps the mean and spread are taken over
    min_window: int = 20  # no verdict before this many steps are in the window
    sigmas: float = 6.0
    consecutive: int = 2
    skip_steps: int = 200  # global batches skipped from the reloaded position, at least
    max_recoveries: int = 5  # another spike after this many recoveries stops the run (exit 5)

    def check(self) -> list[str]:
        p = [
            f"{n}: must be >= 1, got {getattr(self, n)}"
            for n in ("window", "min_window", "consecutive", "skip_steps")
            if getattr(self, n) < 1
        ]
        if self.min_window > self.window:
            p.append(f"min_window ({self.min_window}) must be <= window ({self.window})")
        if self.sigmas <= 0:
            p.append(f"sigmas: must be positive, got {self.sigmas}")
        if self.max_recoveries < 0:
            p.append(f"max_recoveries: must be >= 0, got {self.max_recoveries}")
        return p


@dataclass
class TrainConfig:
    global_batch_size: int = 256  # sequences per optimiser step, all ranks and micro-steps together
    max_steps: int = 1000
    seed: int = 42  # model init and dropout
    out_dir: str = "runs/default"
    resume: str = "auto"  # auto (latest complete checkpoint if any) | none | a checkpoint tag
    log_every: int = 10
    eval_every: int = 200  # 0 disables periodic evaluation (one still runs at the end)
    # Held-out sequences per evaluation, the same at any world size and micro-batch (the first N of
    # the split; 0 or more than it holds = the whole split). See pretrain/eval/heldout.py.
    eval_sequences: int = 1024
    eval_batches: Optional[int] = None  # deprecated: micro-batches per rank; converted to eval_sequences
    checkpoint_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 3  # older complete checkpoints are deleted; 0 keeps all
    # Every complete checkpoint also uploaded, in the background, to s3://bucket/prefix or a folder on
    # another filesystem (pretrain/checkpoint/mirror.py); keep_checkpoints applies there too. "": off.
    checkpoint_mirror: str = ""
    max_nonfinite_in_a_row: int = 5  # that many skipped non-finite steps in a row stop the run
    export_every: int = 0  # Hugging Face export every N steps (0: only at the end)
    # A new phase of an earlier run (BERT's 512-token phase 2): a checkpoints folder (its latest complete
    # checkpoint) or one tag folder in it. Model weights and optimiser moments come from there; data,
    # batch, schedule, masking and the step counter (from 0) are this run's (pretrain/checkpoint/phases.py).
    init_from_checkpoint: str = ""
    # Checkpoint and exit (code 0) at this step without touching the schedule, which max_steps
    # defines: splits a run into jobs of fixed length. 0: run to max_steps.
    halt_at_step: int = 0
    spike_guard: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)
    # No step finished for this long: every rank writes its stacks to the run folder and the job
    # exits 3 (requeue). 0: automatic, max(300 s, 20 x the median step time); -1: off.
    hang_timeout_s: float = 0.0
    # A line on the first rank whenever none of the run's own came for this long: the step of the
    # total, its time and what is left (the first step, compiling: its time the last time). 0: off.
    progress_every_s: float = 60.0
    health_every: int = 0  # per-layer grad/param/update norms every N steps; 0 = off

    def check(self) -> list[str]:
        p = []
        if self.hang_timeout_s < 0 and self.hang_timeout_s != -1:
            p.append(f"hang_timeout_s: must be >= 0 (0 = automatic) or -1 (off), got {self.hang_timeout_s}")
        for name in ("global_batch_size", "max_steps", "log_every"):
            if getattr(self, name) <= 0:
                p.append(f"{name}: must be positive, got {getattr(self, name)}")
        for name in (
            "eval_every",
            "eval_sequences",
            "checkpoint_every",
            "keep_checkpoints",
            "export_every",
            "halt_at_step",
            "health_every",
            "progress_every_s",
        ):
            if getattr(self, name) < 0:
                p.append(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_nonfinite_in_a_row < 1:
            p.append(f"max_nonfinite_in_a_row: must be >= 1, got {self.max_nonfinite_in_a_row}")
        if self.eval_batches is not None and self.eval_batches < 0:
            p.append(f"eval_batches: must be >= 0, got {self.eval_batches}")
        return p


@dataclass
class DeepSpeedPatchesConfig:
    """The groups of changes to DeepSpeed's internals at ZeRO 1 in bf16 (pretrain/runtime/deepspeed_patches.py),
    each of which a run may turn off to measure it; off, DeepSpeed's own code runs, to the same numbers."""

    bf16_multi_tensor: bool = True  # BF16_Optimizer's norm, clip and gradient sums in multi-tensor calls
    decisions_ahead: bool = True  # BF16_Optimizer's norm check answered by the step's read


@dataclass
class ImplConfig:
    """Settings that change speed and memory, never the numbers a run converges to."""

    # Sequences a rank runs at once; accumulation = global / (micro * world). auto: of the powers of two
    # that divide the global batch at this world size, the one of the most tokens a second, timed at
    # start (pretrain.runtime.micro_batch; said on the start line, cached per device and shape).
    micro_batch_size: Union[Literal["auto"], int] = 32
    zero_stage: Literal[0, 1, 2, 3] = 2
    # auto: bf16 where the device computes it natively (CUDA sm80+, CPUs with AVX-512-BF16 or AMX),
    # else fp32. An emulated bf16 (AVX2 CPUs) runs ~50x slower than fp32. See pretrain/runtime/hardware.py.
    # fp8: bf16 weights, the encoder layers' matmuls in float8 (pretrain.model.fp8; CUDA sm89+ and
    # torchao; on a CPU emulated, for checking). auto never picks it.
    precision: Literal["auto", "bf16", "fp16", "fp32", "fp8"] = "auto"
    # auto: flash_attention_2 (unpadded, varlen kernels) on a CUDA GPU of compute capability 8+ with the
    # flash-attn package and bf16/fp16; else the trainer times the candidates below at the run's shape
    # and takes the fastest (pretrain.runtime.attention; named on the start line, kept on resume).
    # sdpa: PyTorch picks the SDPA kernel; sdpa_<backend>: that one (the math path for inputs it cannot
    # take); eager: Hugging Face's explicit attention; flex_attention: FlexAttention, whose block mask
    # skips the blocks between documents (model.attention_scope=document, CUDA; auto takes it in document
    # scope where flash-attn would run rows). flash_attention_2 or flex_attention asked for where it
    # cannot run falls back to sdpa with a warning (pretrain.model.mlm.attention_implementation).
    attention: Literal[
        "auto",
        "flash_attention_2",
        "flex_attention",
        "sdpa",
        "sdpa_flash",
        "sdpa_math",
        "sdpa_efficient",
        "sdpa_cudnn",
        "eager",
    ] = "auto"
    sparse_head: bool = True  # the MLM head only at masked positions
    # Each encoder layer's activations recomputed in the backward instead of kept from the forward
    # (torch's non-reentrant checkpoint, through Hugging Face's layers): the activations a micro-batch
    # holds fall from every layer's to about one layer's, for one more forward of the encoder (~1/3 more
    # compute), so that a longer sequence or a larger micro-batch fits. The same numbers: keyed dropout
    # draws the same masks again, and the recompute runs the same attention kernels (MLMModel.
    # recompute_context). micro_batch_size auto times the micro-batches with it.
    activation_checkpointing: bool = False
    # Keyed dropout's hash, compiled (pretrain.model.keyed_dropout.DropoutKey; the same bits either way).
    # per_pair: one int32 a pair of elements (the hash's first round), which inductor writes out and reads
    # back (2 bytes an element each way); per_element: each element hashes inside the kernel around it,
    # the mask never in memory, for twice the integer arithmetic. per_pair until a GPU lease measures per_element at the real shape
    # (bench/gpu_smoke.sh's dropout-hash unit; the H200 profile of 2026-11-28 found the hash kernels).
    dropout_hash: Literal["per_pair", "per_element"] = "per_pair"
    # The decoder and the cross-entropy fused in row chunks, no [N, V] log-softmax kept
    # (pretrain.model.mlm_loss); false: the plain F.linear + F.cross_entropy. Needs sparse_head.
    fused_mlm_loss: bool = True
    # torch.compile the model. auto: only when this launch has at least COMPILE_AUTO_MIN_STEPS steps
    # to run, where the start-up (20 s to minutes) pays for itself, and not for fp32 on a CPU, where
    # compiled steps measured no faster (Config.compile_now).
    compile: Union[Literal["auto"], bool] = "auto"
    # Compiled, inductor's own kernels chosen by timing (torch.compile's max-autotune): each matmul
    # shape timed as cuBLAS and as inductor's Triton templates, which can take the bias and GELU
    # (and, backward, GELU's derivative) into the matmul's epilogue, and the pointwise and norm kernels'
    # block sizes tuned. Minutes more of compilation at the start. false until a GPU lease measures it
    # at the real shape (bench/gpu_smoke.sh's autotune unit; the H200 profile of 2026-11-28: GELU's own
    # kernels 74 + 100 us a layer a micro-batch, at bandwidth).
    autotune_kernels: bool = False
    # AdamW's kernel. auto/true: torch's fused AdamW (CUDA and CPU, no build step); false: torch's
    # multi-tensor AdamW. LAMB is always ours (pretrain.model.optim). YAML's on/off read as booleans.
    fused_optimizer: Union[Literal["auto"], bool] = "auto"
    # A step that logs, evaluates and checkpoints nothing reads whether its update stands one step
    # later, its update masked on the device meanwhile, so that the host never waits for the GPU
    # inside a run of such steps (pretrain.step, "Deferred reads"). Where the optimiser is torch's fused
    # AdamW; false: every step reads before its update. The same numbers either way.
    deferred_reads: bool = True
    # The compiled forward and backward replayed as CUDA graphs (torch.compile's "reduce-overhead": one
    # launch for a graph's kernels), where a step's host time decides (few micro-batches a step).
    # true: where CUDA is, compiled, masking.fixed_count, ZeRO 0-2 (ZeRO 3 moves the weights between
    # gathers); auto: off until a GPU lease has measured graphs against eager (bench/gpu_smoke.sh's
    # graphs unit; docs/gpu-step.md); false: off. A graph recorded again or not used is a warning on
    # the run's log, with inductor's reason (pretrain.runtime.graph_records).
    cuda_graphs: Union[Literal["auto"], bool] = "auto"
    # CPU runs under glibc's malloc (no tcmalloc preloaded: pretrain.runtime.allocator): keep freed
    # memory for the next step (pretrain.runtime.hardware.keep_freed_cpu_memory): 10-20% faster steps on mini,
    # but the heap fragments and grows past the working set (demo rank 0: 2.3 -> 5.9 GB in 160 steps);
    # false for glibc's default. Ignored under tcmalloc or jemalloc, which keep freed memory anyway.
    keep_freed_cpu_memory: bool = True
    offload_optimizer: bool = False  # ZeRO-Offload of optimiser states to CPU memory
    num_workers: int = 2  # data loader worker processes per rank
    # micro-batches each worker buffers; raised to a whole step where that is more (pretrain.run)
    prefetch_factor: int = 4
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    # Where to train. auto: the GPUs if CUDA sees any, else the CPU. cuda: a run meant for GPUs; none
    # visible (a Slurm job without --gpus-per-node, say) is an input error, never a silent CPU run.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # MFU's denominator per process. 0: the GPU table, else a matmul measured once per machine
    # and cached (pretrain/runtime/hardware.py).
    peak_tflops: float = 0.0
    deepspeed: dict = field(default_factory=dict)  # extra keys merged into the derived DeepSpeed JSON
    deepspeed_patches: DeepSpeedPatchesConfig = field(default_factory=DeepSpeedPatchesConfig)
    # torch.profiler over steps profile_at_step .. + profile_steps - 1: a trace and an op table per rank
    # in train.out_dir/profile/, and a line saying where a step's time went (pretrain/runtime/profiling.py).
    # 0: off.
    profile_at_step: int = 0
    profile_steps: int = 5

    def check(self) -> list[str]:
        p = []
        if self.profile_at_step < 0:
            p.append(f"profile_at_step: must be >= 0 (0 = off), got {self.profile_at_step}")
        if self.profile_steps < 1:
            p.append(f"profile_steps: must be >= 1, got {self.profile_steps}")
        if self.micro_batch_size != "auto" and self.micro_batch_size <= 0:
            p.append(f"micro_batch_size: must be positive or auto, got {self.micro_batch_size}")
        if self.num_workers < 0:
            p.append(f"num_workers: must be >= 0, got {self.num_workers}")
        if self.offload_optimizer and self.zero_stage == 0:
            p.append("offload_optimizer needs zero_stage >= 1")
        return p


@dataclass
class TrackingConfig:
    backend: Literal["mlflow", "none"] = "mlflow"
    tracking_uri: str = ""  # "" -> $MLFLOW_TRACKING_URI, else a local store in train.out_dir
    experiment: str = "mlm-pretrain"
    run_name: str = ""
    register_model: str = ""  # register the final export under this Model Registry name
    system_metrics: bool = True
    report: bool = True  # write report/ (HTML + PNGs) at the end of a run and log it
    retry_seconds: float = 2.0  # at most this long per attempt when the server is unreachable
    parent_run_id: str = ""  # make the run a child of this one (pretrain.study sets it)


@dataclass
class DownstreamTaskConfig:
    """One downstream task (``pretrain.eval.tasks``): a labelled CSV/TSV/JSONL file or label-folder,
    or ``path: word_order``, the built-in task made from held-out text."""

    name: str = ""  # metric key downstream/<name>/...; default: the file's stem
    path: str = ""  # a labelled file or folder, or "word_order"
    text_column: str = "text"
    label_column: str = "label"
    test_path: str = ""  # "": a stratified test split of `path`, drawn with `seed`
    test_fraction: float = 0.25
    text_path: str = ""  # word_order only: raw text (.txt/.jsonl); "": data.dir's eval split
    shuffle_window: int = 3  # word_order only: words are shuffled inside windows this long
    max_examples: int = 2000  # per split, a seeded subsample above this (0: all)
    max_length: int = 128  # tokens per example
    seed: int = 0

    def check(self) -> list[str]:
        p = []
        if not self.path:
            p.append("path: required (a labelled .csv/.tsv/.jsonl file or folder, or 'word_order')")
        elif self.path != "word_order" and not os.path.exists(self.path):
            p.append(f"path: {self.path!r} does not exist")
        if self.test_path and not os.path.exists(self.test_path):
            p.append(f"test_path: {self.test_path!r} does not exist")
        if self.text_path and not os.path.exists(self.text_path):
            p.append(f"text_path: {self.text_path!r} does not exist")
        if not 0.0 < self.test_fraction < 1.0:
            p.append(f"test_fraction: must be in (0, 1), got {self.test_fraction}")
        if self.shuffle_window < 2:
            p.append(f"shuffle_window: must be >= 2, got {self.shuffle_window}")
        if self.max_examples < 0 or self.max_length < 8:
            p.append(f"max_examples must be >= 0 and max_length >= 8, got {self.max_examples}, {self.max_length}")
        return p


@dataclass
class EvalConfig:
    # A linear probe on frozen mean-pooled features of the trainer's own weights, logged as
    # downstream/<task>/{accuracy,macro_f1} (pretrain.eval.downstream.probe_metrics).
    downstream: list[DownstreamTaskConfig] = field(default_factory=list)
    downstream_every: int = 0  # steps between probes; 0: with every train.eval_every evaluation
    downstream_batch_size: int = 32

    def check(self) -> list[str]:
        p = []
        if self.downstream_every < 0 or self.downstream_batch_size <= 0:
            p.append(
                f"downstream_every must be >= 0 and downstream_batch_size > 0, got "
                f"{self.downstream_every}, {self.downstream_batch_size}"
            )
        names = [t.name or os.path.splitext(os.path.basename(t.path))[0] for t in self.downstream]
        p += [f"downstream: task name {n!r} used twice" for n in sorted({n for n in names if names.count(n) > 1})]
        return p  # each task's own check() runs through configlib.validate


# Keys this trainer once wrote under another name: refused in a config or an override (one line naming
# the new key), renamed in what a checkpoint or a study variant saved (``upgrade_saved``), so that
# those still resume.
RENAMED_KEYS = {
    "masking.mask_prob": "masking.mask_replace_prob",
    "masking.random_prob": "masking.random_replace_prob",
}
WHY_RENAMED = "Hugging Face's name for the share of predicted tokens replaced; the masking rate is masking.rate"


def upgrade_saved(data: dict) -> dict:
    """A config this trainer saved (a checkpoint's ``config.yaml``, a study's ``variant.yaml``) with
    today's key names."""
    return configlib.rename_keys(data, RENAMED_KEYS)


@dataclass
class Config:
    RENAMED: ClassVar[dict[str, str]] = RENAMED_KEYS
    RENAMED_WHY: ClassVar[str] = WHY_RENAMED

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    impl: ImplConfig = field(default_factory=ImplConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def grad_accum_steps(self, world_size: int | None = None) -> int:
        """Micro-batches a step; with ``impl.micro_batch_size: auto`` not chosen yet, the fewest it can be."""
        world = world_size or self.world_size()
        micro = self.impl.micro_batch_size
        return self.train.global_batch_size // (
            (self.train.global_batch_size // world if micro == "auto" else micro) * world
        )

    def check(self) -> list[str]:
        problems = batch_size_problems(self.train.global_batch_size, self.impl.micro_batch_size, self.world_size())
        problems += schedule_problems(self)
        if self.impl.attention == "flex_attention" and self.model.attention_scope != "document":
            problems.append(
                "impl.attention=flex_attention runs document scope's block mask: set "
                "model.attention_scope=document, or take another kernel for rows"
            )
        if self.impl.profile_at_step > self.train.max_steps:
            problems.append(
                f"impl.profile_at_step ({self.impl.profile_at_step}) is after train.max_steps "
                f"({self.train.max_steps}): nothing would be profiled"
            )
        if self.train.init_from_checkpoint and self.model.init_from:
            problems.append("train.init_from_checkpoint and model.init_from both give initial weights; keep one")
        if self.optim.name == "lamb" and self.impl.zero_stage > 0:
            problems.append(
                "optim.name=lamb needs impl.zero_stage=0: ZeRO hands the optimiser flat partitions, "
                "so LAMB's per-tensor trust ratio would be computed per partition (other results)"
            )
        if self.impl.cuda_graphs is True:
            problems += cuda_graphs_problems(self)
        if self.impl.autotune_kernels and self.impl.compile is False:
            problems.append(
                "impl.autotune_kernels=true tunes the compiled step's kernels: set impl.compile to true or auto"
            )
        if self.optim.name == "lamb" and self.impl.offload_optimizer:
            problems.append(
                "optim.name=lamb with impl.offload_optimizer=true: DeepSpeed's optimiser offload "
                "runs Adam only; use optim.name=adamw or turn the offload off"
            )
        return problems

    def compile_now(self, steps_left: int, device_type: str, precision: str) -> bool:
        if self.impl.compile == "auto":
            # fp32 on a CPU (what auto picks where bf16 is emulated): compiled mini steps measured 7-9%
            # slower than eager with AVX2 kernels, and only 4% faster with AVX-512 (bench/,
            # BENCHMARKS.md). In bf16 and on GPUs compiled steps are faster.
            if device_type == "cpu" and precision == "fp32":
                return False
            return steps_left >= COMPILE_AUTO_MIN_STEPS
        return bool(self.impl.compile)


def cuda_graphs_problems(cfg: Config) -> list[str]:
    """What ``impl.cuda_graphs=true`` needs of the rest of the config (a graph replays fixed shapes at
    fixed addresses)."""
    problems = []
    if cfg.impl.compile is False:
        problems.append("impl.cuda_graphs=true replays the compiled step: set impl.compile to true or auto")
    if not cfg.masking.fixed_count:
        problems.append(
            "impl.cuda_graphs=true needs masking.fixed_count=true: a masked count that changes from batch "
            "to batch changes the graph's shapes (a new graph each time)"
        )
    if cfg.impl.zero_stage == 3:
        problems.append(
            "impl.cuda_graphs=true with impl.zero_stage=3: ZeRO 3 gathers and frees the weights inside the "
            "forward, so they never sit at the addresses a graph replays; use ZeRO 0-2"
        )
    # Where PyTorch's graphed backward raises or gives wrong gradients (pytorch#169545).
    world = cfg.world_size()  # 0: not known yet (the launcher's check); the ranks check again
    if cfg.impl.zero_stage == 0 and world > 0 and cfg.grad_accum_steps(world) > 1:
        problems.append(
            f"impl.cuda_graphs=true with impl.zero_stage=0 and {cfg.grad_accum_steps(world)} micro-batches a "
            "step: graphed backward passes that accumulate gradients give wrong ones there (pytorch#169545); "
            "use ZeRO 1-2, or one micro-batch a step"
        )
    if cfg.impl.zero_stage == 1 and cfg.impl.precision == "fp32":
        problems.append(
            "impl.cuda_graphs=true with impl.zero_stage=1 in fp32: PyTorch's graphed backward raises or gives "
            "wrong gradients there (pytorch#169545); use bf16 or ZeRO 2"
        )
    bf16_optimizer = cfg.impl.zero_stage == 1 and cfg.impl.precision not in ("fp32", "fp16")
    if bf16_optimizer and not cfg.impl.offload_optimizer and not cfg.impl.deepspeed_patches.bf16_multi_tensor:
        # DeepSpeed's BF16_Optimizer (ZeRO 1 in bf16) zeroes the bf16 gradients after summing them, so the
        # next backward adds into gradients a graph owns (inductor warns of it); the patch frees them.
        problems.append(
            "impl.cuda_graphs=true with impl.zero_stage=1 in bf16 and "
            "impl.deepspeed_patches.bf16_multi_tensor=false: DeepSpeed keeps the bf16 gradients for the next "
            "backward to add into, which a replayed graph owns; keep the patch group on, or ZeRO 2"
        )
    return problems


def batch_size_problems(global_batch: int, micro_batch: int | str, world: int) -> list[str]:
    """The one place where micro-batch x accumulation x world size = global batch is checked (``auto``:
    that the global batch splits evenly among the ranks, the largest micro-batch it may choose)."""
    if micro_batch == "auto":
        micro_batch = 1 if global_batch % max(world, 1) else global_batch // max(world, 1)
    if global_batch <= 0 or micro_batch <= 0 or world <= 0:
        return []
    if global_batch % (micro_batch * world):
        return [
            f"train.global_batch_size ({global_batch}) must be a multiple of impl.micro_batch_size "
            f"({micro_batch}) x world size ({world}) = {micro_batch * world}"
        ]
    return []


def load_config(path: str | None, overrides: list[str] = ()) -> Config:

    cfg = configlib.load(Config, path, overrides)
    convert_eval_batches(cfg)  # the deprecated train.eval_batches, once, with this layout
    return cfg


def convert_eval_batches(cfg) -> None:
    """``train.eval_batches`` (deprecated: micro-batches per rank) becomes ``train.eval_sequences``,
    once, at load: the resolved config then holds only the sequence count, which later layouts keep."""
    if cfg.train.eval_batches is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.impl.micro_batch_size == "auto":
        raise ConfigError(
            [
                "train.eval_batches (deprecated, in micro-batches) needs a number for "
                "impl.micro_batch_size, not auto: give train.eval_sequences instead"
            ],
            "train",
        )
    sequences = cfg.train.eval_batches * cfg.impl.micro_batch_size * world
    warnings.warn(
        f"train.eval_batches is deprecated: use train.eval_sequences (the sequences evaluated, "
        f"at any layout). {cfg.train.eval_batches} micro-batches x {cfg.impl.micro_batch_size} x "
        f"world {world} = train.eval_sequences={sequences}",
        FutureWarning,
        stacklevel=2,
    )
    cfg.train.eval_sequences, cfg.train.eval_batches = sequences, None


def wsd_decay_steps(optim, max_steps: int) -> int:
    """``optim.decay_steps``, or ``optim.decay_fraction`` of the run when that is 0."""
    return optim.decay_steps or round(optim.decay_fraction * max_steps)


def schedule_problems(cfg) -> list[str]:
    """A wsd schedule must fit its warm-up and its decay into the run."""
    o = cfg.optim
    if o.schedule != "wsd":
        return []
    decay = wsd_decay_steps(o, cfg.train.max_steps)
    if decay < 1:
        return [
            (
                f"optim.decay_steps: wsd needs a decay of at least 1 step (decay_steps {o.decay_steps}, "
                f"decay_fraction {o.decay_fraction} of train.max_steps {cfg.train.max_steps})"
            )
        ]
    if o.warmup_steps + decay > cfg.train.max_steps:
        return [
            (
                f"optim.schedule=wsd: warmup_steps ({o.warmup_steps}) + decay ({decay} steps) exceed "
                f"train.max_steps ({cfg.train.max_steps})"
            )
        ]
    return []
