#!/usr/bin/env bash
# Every GPU-only path of the trainer, on one node, in under 10 minutes, through the real launch path
# (pretrain.launch, as launchers/local.sh: the device list, the allocator, the signal relay):
#   adamw         torch's fused AdamW (the default; no build step), bf16, ZeRO 1 (DeepSpeed's BF16_Optimizer);
#                 every run: the attention kernel timed at start-up (impl.attention=auto), the fused MLM loss
#   lamb          our LAMB (the same maths as on the CPU), bf16, ZeRO 0 (its per-tensor trust ratio needs whole tensors)
#   zero3         fused AdamW, bf16, ZeRO 3
#   compile-fixed torch.compile + masking.fixed_count (static shapes), fused AdamW, bf16, ZeRO 1
#   dropout       dropout 0.1: keyed dropout on the hidden states, attention run eagerly to key its dropout
#   nccl-N        NCCL across all N visible GPUs of this node, ZeRO 2 with overlap_comm (on wherever CUDA is)
#   nonfinite     ZeRO 1 bf16 with an absurd learning rate: non-finite steps skipped, the schedule held, exit 4
#   halted        adamw halted at mid-run at ZeRO 1, resumed at ZeRO 2 (converted on load): adamw's losses
#   phase2        a new phase from adamw's checkpoint (train.init_from_checkpoint), converted to ZeRO 2
#   modernbert    configs/modernbert-tiny.yaml (local attention: a sliding-window mask), bf16, ZeRO 1
#   flash-attn    modernbert with impl.attention=flash_attention_2, where the flash-attn package is installed
#   documents     model.attention_scope=document, on mini (BERT) and modernbert-tiny (windowed local layers):
#                 FlexAttention's block mask where flash-attn would run rows, else SDPA with a boolean mask;
#                 and mini with impl.attention=flex_attention, FlexAttention wherever torch has it
#   export        the lamb run's Hugging Face export (ZeRO 0 bf16: the fp32 masters) loads and fills masks
#   profile       torch.profiler (impl.profile_at_step) over PROFILE_STEPS steps of base.yaml at its real shape
#                 (compiled, 8 micro-batches a step) and of the bare compiled loop at the same shape: the device's
#                 busy share, its time by kernel class and the longest kernels (bench/profile_kernels.py)
#   bert-base     configs/base.yaml at sequence 128: MFU to compare with NVIDIA's BERT (~45%); one micro-batch a
#                 step, its decisions read a step late (impl.deferred_reads, the default)
#   reads         bert-base with every decision read at once (impl.deferred_reads=false): what deferring gains
#   patches       bert-base with each group of DeepSpeed patches off in turn (impl.deepspeed_patches): what each gains
#   real-shape    base.yaml at its real shape, ACCUM (8) micro-batches of --base-micro-batch a step, its decisions
#                 read a step late (ours) and at once; beside it, at the same shape on the same GPU,
#                 the Hugging Face Trainer (bf16, SDPA across the row, fused AdamW, compiled) and a bare
#                 compiled loop around our model with fused AdamW (bench/reference_loops.py), and ours with
#                 attention across the row as HF's: tokens/s, MFU, and the ratios at the same attention
#                 scope (issue 84's goals: >= 2.5x HF, >= 0.9x the bare loop, >= 40% MFU)
#   micro-batch   base.yaml at its real global batch with impl.micro_batch_size=auto: the micro-batches timed,
#                 the one chosen, tokens/s and MFU at it
#   fp8           base.yaml at its real shape with impl.precision=fp8 (the encoder's matmuls in float8) beside
#                 bert-base-accum: the losses within float8's band of bf16's, tokens/s and MFU (against bf16's peak)
#   dropout-hash  base.yaml at its real shape with impl.dropout_hash=per_element (each element hashes inside the
#                 kernel around it, no hash in memory) beside bert-base-accum (one hash a pair, written out and
#                 read back): the same losses to bf16 round-off, tokens/s and MFU
#   autotune      base.yaml at its real shape with impl.autotune_kernels=true (torch.compile's max-autotune: matmuls
#                 timed as cuBLAS and as inductor's templates, bias and GELU in their epilogues) beside
#                 bert-base-accum: the same losses to bf16 round-off, tokens/s and MFU (the compile's cost: the run times)
#   graphs        bert-base (one micro-batch a step) with impl.cuda_graphs=true: the compiled forward and backward
#                 replayed as CUDA graphs; the same losses to bf16 round-off, tokens/s against bert-base's,
#                 and no graph recorded again or left unused (the run's "cuda graphs:" warnings)
#   bert-base-nodrop  the same without dropout: what keyed dropout costs in base.yaml's step
#   checkpointing base.yaml at its real shape with impl.activation_checkpointing=true beside bert-base-accum:
#                 the same losses to bf16 round-off, its tokens/s and peak memory against the default's
# before them, bench/gpu_smoke_checks.py checks the optimisers and the flash SDPA kernel directly,
# bench/mlm_loss.py times the fused MLM loss (every run's default) against the plain one at a GPU batch;
# after them, one line per check (ok / FAILED) and tokens/s and MFU (against the peak printed first)
# from each run's metrics.jsonl. On a machine that reaches no package index: bench/gpu_bundle.py.
#
#   bench/gpu_smoke.sh [--dry-run] [--gpus N] [--steps 50] [--micro-batch 64] [--base-micro-batch 128]
#                      [--config configs/mini.yaml] [--data SHARD_DIR] [--work-dir /tmp/gpu_smoke] [--budget-s 540]
#                      [--only UNIT,...] [--skip UNIT,...] [--resume-from RESULTS_FILE]
#
# Units, in the order they run (a unit's runs and the check that reads them): profile real-shape
# micro-batch fp8 dropout-hash autotune bert-base graphs reads patches checkpointing paths mlm-loss adamw nonfinite resume export zero3 phase2 modernbert flash-attn
# documents dropout compile-fixed bert-base-nodrop nccl. Each line of WORK/results.txt is written as a run or check ends, and
# "done UNIT" once a unit has passed; --resume-from that file (carried to the next lease) runs only
# the units not done, so two short leases cover everything; on the same machine and --work-dir, the
# runs it lists as finished count as run.
#
# --dry-run prints the commands without running them (needs no GPU), planned as a lease would run them:
# each run's estimate on a clock, what would be skipped, what the call leaves undone; tests/bench/test_bench.py
# loads every config and override they use, the Python checks' included, on the CPU. --budget-s: what does not
# start within it is skipped (said on its line), so that the summary always prints; the checks most
# likely to fail on a first GPU run come first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

DRY_RUN=0 GPUS="" STEPS=50 MICRO=64 BASE_MICRO=128 CONFIG=configs/mini.yaml DATA="" WORK=/tmp/gpu_smoke BUDGET=540
ONLY="" SKIP="" RESUME_FROM="" PREVIOUS_DONE="" PREVIOUS_OK=""
UNITS=(profile real-shape micro-batch fp8 dropout-hash autotune bert-base graphs reads patches checkpointing paths mlm-loss adamw nonfinite resume export zero3 phase2
       modernbert flash-attn documents dropout compile-fixed bert-base-nodrop nccl)
usage() { grep -A2 '^#   bench/gpu_smoke.sh \[' "$0" | sed 's/^# \{0,3\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --gpus) GPUS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --micro-batch) MICRO=$2; shift 2 ;;
    --base-micro-batch) BASE_MICRO=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --work-dir) WORK=$2; shift 2 ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    --resume-from) RESUME_FROM=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_smoke: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for pair in "--steps:$STEPS" "--micro-batch:$MICRO" "--base-micro-batch:$BASE_MICRO" "--budget-s:$BUDGET" ${GPUS:+"--gpus:$GPUS"}; do
  case "${pair#*:}" in ''|*[!0-9]*|0) echo "gpu_smoke: ${pair%%:*} must be a positive integer, got '${pair#*:}'" >&2; exit 2 ;; esac
done
[ -f "$CONFIG" ] || { echo "gpu_smoke: --config $CONFIG: no such file" >&2; exit 2; }
for unit in ${ONLY//,/ } ${SKIP//,/ }; do
  [[ " ${UNITS[*]} " == *" $unit "* ]] || { echo "gpu_smoke: no unit '$unit' (units: ${UNITS[*]})" >&2; exit 2; }
done
if [ -n "$RESUME_FROM" ]; then
  [ -f "$RESUME_FROM" ] || { echo "gpu_smoke: --resume-from $RESUME_FROM: no such file" >&2; exit 2; }
  # read before results.txt is rewritten (it may be this --work-dir's own)
  PREVIOUS_DONE=" $(sed -n 's/^done    //p' "$RESUME_FROM" | tr '\n' ' ')"
  PREVIOUS_OK=$(grep '^ok      run ' "$RESUME_FROM" || true)
fi
if [ "$STEPS" -lt 20 ]; then echo "gpu_smoke: --steps must be >= 20 (two logging windows of 10)" >&2; exit 2; fi

if [ "$DRY_RUN" = 1 ]; then
  GPUS=${GPUS:-2}
  DATA=${DATA:-$WORK/shards-seq128}
  PEAK="<peak>"   # filled in from the GPU model on a real run
else
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_smoke: torch.cuda.is_available() is False on $(hostname): no CUDA GPU to smoke-test." >&2
    echo "gpu_smoke: run it on a GPU node (or --dry-run to see the commands)." >&2
    exit 2
  fi
  VISIBLE=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  GPUS=${GPUS:-$VISIBLE}
  if [ "$GPUS" -gt "$VISIBLE" ]; then echo "gpu_smoke: --gpus $GPUS but only $VISIBLE visible" >&2; exit 2; fi
  mkdir -p "$WORK"
  rm -f "$WORK/results.txt"   # one line per run and check, written as each ends: what a cut lease leaves
  for unit in $PREVIOUS_DONE; do echo "done    $unit" >>"$WORK/results.txt"; done  # a third lease resumes too
  if [ -z "$DATA" ]; then
    DATA=$("$PY" -c "import sys; sys.path.insert(0, '.'); from bench.common import ensure_sample_shards; print(ensure_sample_shards(sys.argv[1]))" "$WORK")
  fi
  PEAK_LINE=$("$PY" bench/gpu_smoke_checks.py peak)
  PEAK=${PEAK_LINE%%$'\t'*}
  echo "peak: $PEAK TFLOP/s (${PEAK_LINE#*$'\t'})"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}   # the deepspeed launcher leaves it unset

COMMON=(data.dir="$DATA" train.max_steps="$STEPS" train.log_every=10 train.eval_every=0 train.checkpoint_every=0
        train.resume=none train.keep_checkpoints=1 tracking.backend=none tracking.report=false impl.precision=bf16 impl.attention=auto
        impl.dist_backend=nccl impl.micro_batch_size="$MICRO" impl.num_workers=2 impl.peak_tflops="$PEAK")
# base.yaml's runs at its own micro-batch (128, --base-micro-batch), one micro-batch a step: 64 left
# an H200 at 5.6 GB of 141 and its step host-bound (BENCHMARKS.md).
BASE_BATCH=(impl.micro_batch_size="$BASE_MICRO" train.global_batch_size="$BASE_MICRO")
# base.yaml's real shape: several micro-batches a step (on one GPU base.yaml itself has 32), where the
# waits inside a step and the next step's readiness show, not only the per-step floor.
ACCUM=8
REAL_BATCH=(impl.micro_batch_size="$BASE_MICRO" train.global_batch_size=$((BASE_MICRO * ACCUM)))
RUN_DIRS=()
FAILED=()
RESULTS=()
DONE=()
declare -A SEEN=()
START=$SECONDS

# What a run costs here: an estimate per kind (a mini run: three launcher processes, CUDA and NCCL
# start-up, a checkpoint, an export; a compiled base.yaml run adds its compile), replaced by what the
# last run of that kind took on this machine. A run starts only when its estimate fits in what is left
# of --budget-s less RESERVE (the summary's time) with a quarter to spare; what does not fit is said as
# skipped, never killed (a run that overruns even that is stopped 10 s before the budget ends).
# --resume-from's file gives the last lease's times (the longest of each kind) in place of the guesses.
# A base.yaml run with impl.autotune_kernels times every matmul shape's candidates while it compiles: a
# kind of its own (a guess until a lease has run one).
# base.yaml's and the bare loop's 110 s: the H200 lease of 2026-11-28 ran two base.yaml runs in a 214-s
# call, and two of ours and two bare loops in 523 s with the HF Trainer's 87 s (stopped while it still
# compiled: HF keeps the guess of 150 s).
EST_MINI=45 EST_COMPILED=90 EST_BASE=110 EST_BARE=110 EST_HF=150 EST_AUTOTUNE=420 RESERVE=15
kind_of() {  # kind_of NAME CONFIG OVERRIDES...: what a run costs like
  if [[ " ${*:3} " == *" impl.autotune_kernels=true "* ]]; then echo AUTOTUNE
  elif [ "$2" = configs/base.yaml ]; then echo BASE; elif [[ " ${*:3} " == *" impl.compile=true "* ]]; then echo COMPILED
  else echo MINI; fi
}
if [ -n "$RESUME_FROM" ]; then
  while read -r name took; do
    var=EST_$(case "$name" in *-autotune) echo AUTOTUNE ;; bert-base*|profile-base) echo BASE ;; compile-fixed) echo COMPILED ;; hf-base) echo HF ;; bare-base|profile-bare) echo BARE ;; *) echo MINI ;; esac)
    if [ -z "${SEEN[$var]:-}" ] || [ "$took" -gt "${!var}" ]; then printf -v "$var" %d "$took"; SEEN[$var]=1; fi
  done < <(sed -n 's/^ok      run \([^ ]*\) (exit [0-9]*, \([0-9]*\) s)$/\1 \2/p' <<<"$PREVIOUS_OK")
  echo "run times from $RESUME_FROM: mini ${EST_MINI} s, compiled ${EST_COMPILED} s, base.yaml ${EST_BASE} s," \
    "bare loop ${EST_BARE} s, HF Trainer ${EST_HF} s, autotuned ${EST_AUTOTUNE} s"
fi
# A dry run plans the lease as it would run: each run's estimate (above) on a clock of its own, skipped
# where a lease would skip it, and what the runs before it left done for the checks and units after it.
PLANNED=0
left_s() { if [ "$DRY_RUN" = 1 ]; then echo $((BUDGET - PLANNED)); else echo $((BUDGET - (SECONDS - START))); fi; }
plan() {  # plan NAME EST_S: a dry run's run, done at its estimate
  echo "  $1: ~$2 s, planned to end at $((PLANNED + $2)) s of --budget-s $BUDGET"
  PLANNED=$((PLANNED + $2)); DONE+=("$1")
}
record() { RESULTS+=("$1"); [ "$DRY_RUN" = 1 ] || echo "$1" >>"$WORK/results.txt"; }
# A second call on the same warm machine (the same --work-dir, --resume-from its results.txt): the runs
# that file lists as finished, whose folders are still here, count as run in this call too, so that a
# unit the first call left half done (its base run finished, the run beside it skipped) picks up from
# them (issue 84, item 6). A new machine has no such folders: there they run again.
while read -r line; do
  read -r _ _ name _ <<<"$line"
  [ -n "$name" ] && [ -d "$WORK/runs/$name" ] || continue
  echo "  $name: finished in an earlier call, here in $WORK/runs/$name"
  record "$line"; DONE+=("$name")
  [[ "$line" == *"(exit 0, "* ]] && RUN_DIRS+=("$WORK/runs/$name")
done <<<"$PREVIOUS_OK"

run() {  # run NAME NUM_GPUS OVERRIDES...   (a fresh run folder; CONTINUE=1 keeps it, to resume; EXPECT=N: its exit code)
  local name=$1 ngpu=$2; shift 2
  local out="$WORK/runs/$name" expect=${EXPECT:-0}
  local cmd=("$PY" -m pretrain.launch --num_gpus "$ngpu" --master_port $((29500 + RANDOM % 1000)) --module pretrain.train
             --config "${RUN_CONFIG:-$CONFIG}" "${COMMON[@]}" train.out_dir="$out" train.global_batch_size=$((MICRO * ngpu)) "$@")
  echo "+ ${cmd[*]}"
  local kind; kind=$(kind_of "$name" "${RUN_CONFIG:-$CONFIG}" "$@")
  local est_var=EST_$kind; local est=${!est_var} left; left=$(left_s)
  if [ $((left - RESERVE)) -lt $((est + est / 4)) ]; then  # a quarter over the estimate still fits
    echo "  $name: skipped (~$est s expected, $left s of --budget-s $BUDGET left)"
    record "skipped run $name (~$est s expected, $left s left)"
    return 0
  fi
  if [ "$DRY_RUN" = 1 ]; then
    plan "$name" "$est"; [ "${CONTINUE:-0}" = 1 ] && DONE+=("$name-resumed")
    return 0
  fi
  [ "${CONTINUE:-0}" = 1 ] || rm -rf "$out"
  mkdir -p "$out"
  local t0=$SECONDS rc=0
  # -k: SIGTERM asks the ranks to finish their step and checkpoint; a rank stuck in a compile gets KILL.
  timeout -k 5 $((left - 10)) "${cmd[@]}" >"$out/stdout.log" 2>&1 || rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" = "$expect" ]; then
    printf -v "$est_var" %d "$took"
    echo "  $name: done (exit $rc) in $took s"
    record "ok      run $name (exit $rc, $took s)"
    if [ "${CONTINUE:-0}" = 1 ]; then DONE+=("$name-resumed"); else DONE+=("$name"); fi
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "  $name: stopped at the budget after $took s (not a failure); last lines of $out/stdout.log:"
    tail -n 5 "$out/stdout.log" | sed 's/^/    /'
    record "skipped run $name (stopped at the budget after $took s)"
  else
    echo "  $name: FAILED (exit $rc, expected $expect) after $took s; last lines of $out/stdout.log:"
    tail -n 15 "$out/stdout.log" | sed 's/^/    /'
    FAILED+=("$name")
    record "FAILED  run $name (exit $rc, expected $expect): $out/stdout.log"
  fi
  [ "${CONTINUE:-0}" = 1 ] || [ "$expect" != 0 ] || [[ " ${RUN_DIRS[*]:-} " == *" $out "* ]] || RUN_DIRS+=("$out")
}

ran() {  # ran NAME...: every named run finished as expected in this lease (in a dry run: was planned)
  local n d; for n in "$@"; do for d in "${DONE[@]:-}"; do [ "$d" = "$n" ] && continue 2; done; return 1; done
}

selected() {  # selected UNIT: runs in this lease (--only, --skip, and what --resume-from's file says is done)
  local unit=$1
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$unit,"* ]]; then return 1; fi
  if [[ ",$SKIP," == *",$unit,"* ]]; then return 1; fi
  if [[ "$PREVIOUS_DONE " == *" $unit "* ]]; then echo "  $unit: done in an earlier lease ($RESUME_FROM)"; return 1; fi
}

close() {  # close UNIT NEEDED...: the unit is done when everything it needed finished as expected here
  local unit=$1; shift
  if ran "$@"; then record "done    $unit"; fi
}

check_with() {  # check_with NAME MIN_S SCRIPT ARGS...: a Python check (MIN_S left to start it), FAILED on error
  local name=$1 min_s=$2; shift 2
  echo "+ $PY $*"
  if [ $(($(left_s) - RESERVE)) -lt "$min_s" ]; then
    record "skipped check $name (--budget-s $BUDGET spent)"; return 0
  fi
  if [ "$DRY_RUN" = 1 ]; then DONE+=("check:$name"); return 0; fi
  if timeout -k 5 $(($(left_s) - RESERVE)) "$PY" "$@"; then
    record "ok      check $name"; DONE+=("check:$name")
  else
    FAILED+=("$name"); record "FAILED  check $name"
  fi
}

yardstick() {  # yardstick NAME KIND [STEPS [PROFILE]]: bench/reference_loops.py (hf | bare) at base.yaml's real
  # shape; PROFILE: [FIRST, COUNT], the steps the bare loop profiles
  local name=$1 kind=$2 out="$WORK/runs/$1" steps=${3:-$STEPS} profile=${4:-null}
  local spec
  spec=$(printf '{"kind": "%s", "shards": "%s", "config": "configs/base.yaml", "overrides": ["data.dir=%s"], "batch_size": %d, "grad_accum": %d, "steps": %d, "warmup_steps": 10, "precision": "bf16", "threads": %d, "out_dir": "%s", "optim": "adamw_torch_fused", "fused": true, "compile": true, "training_args": {"torch_compile": true}, "profile": %s}' \
    "$kind" "$DATA" "$DATA" "$BASE_MICRO" "$ACCUM" "$steps" "$OMP_NUM_THREADS" "$out" "$profile")
  echo "+ $PY bench/reference_loops.py '$spec'"
  local left; left=$(left_s)
  local est_var=EST_${kind^^}; local est=${!est_var}
  if [ $((left - RESERVE)) -lt $((est + est / 4)) ]; then
    echo "  $name: skipped (~$est s expected, $left s of --budget-s $BUDGET left)"
    record "skipped run $name (~$est s expected, $left s left)"
    return 0
  fi
  if [ "$DRY_RUN" = 1 ]; then plan "$name" "$est"; return 0; fi
  rm -rf "$out"; mkdir -p "$out"; echo "$spec" >"$out/spec.json"
  local t0=$SECONDS rc=0
  timeout -k 5 $((left - 10)) "$PY" bench/reference_loops.py "$spec" >"$out/stdout.log" 2>&1 || rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" = 0 ]; then
    printf -v "$est_var" %d "$took"; echo "  $name: done in $took s"; record "ok      run $name (exit 0, $took s)"; DONE+=("$name")
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    record "skipped run $name (stopped at the budget after $took s)"
  else
    echo "  $name: FAILED (exit $rc) after $took s; last lines of $out/stdout.log:"
    tail -n 15 "$out/stdout.log" | sed 's/^/    /'
    FAILED+=("$name"); record "FAILED  run $name (exit $rc): $out/stdout.log"
  fi
}

check() {  # check NAME ARGS... : one of bench/gpu_smoke_checks.py's checks
  local name=$1; shift
  check_with "$name" 10 bench/gpu_smoke_checks.py "$@"
}

# The order: what the lease is for first (issue 84, item 6), so a lease that runs out leaves the least
# valuable unanswered: the profile at the real shape, the real shape beside the HF Trainer and the bare
# loop, then what was built without a GPU (the deferred reads in every base.yaml run, CUDA graphs, reading
# at once); then the GPU-only paths (paths, the fused loss, adamw: ZeRO 1 bf16 fused AdamW), the
# non-finite skip, the converted resume and the export (what a week-long run relies on); then the other
# ZeRO stages, phase 2 and the other architectures; last, what only measures a cost (no dropout) or
# repeats a path on one GPU (NCCL across a single device).
# First, where a step's time goes at base.yaml's real shape (issue 84, item 1): ours and the bare compiled
# loop over the same model, PROFILE_STEPS steps each from step PROFILE_AT of PROFILE_RUN (after the
# compile and the first window), read by bench/profile_kernels.py: the device's busy share, its time by
# kernel class against the budget, the longest kernels with their TFLOP/s.
PROFILE_RUN=20 PROFILE_AT=12 PROFILE_STEPS=3
if selected profile; then
  ran profile-base || RUN_CONFIG=configs/base.yaml run profile-base 1 "${REAL_BATCH[@]}" train.max_steps=$PROFILE_RUN \
    impl.profile_at_step=$PROFILE_AT impl.profile_steps=$PROFILE_STEPS
  ran profile-bare || yardstick profile-bare bare $PROFILE_RUN "[$PROFILE_AT, $PROFILE_STEPS]"
  if ran profile-base profile-bare; then
    check profile profile "$WORK/runs/profile-base" "$WORK/runs/profile-bare"
    check_with kernels 10 bench/profile_kernels.py --steps $PROFILE_STEPS --json "$WORK/kernels.json" \
      "$WORK"/runs/profile-base/profile/*.json.gz "$WORK"/runs/profile-bare/profile/*.json.gz
  else record "skipped check profile (needs the profile-base and profile-bare runs)"; fi
  close profile check:profile check:kernels
fi
# base.yaml at its real shape (ACCUM micro-batches a step), the two yardsticks at the same shape on the
# same GPU, then ours with attention across the whole row, the HF Trainer's scope (base.yaml's attends
# inside each document, as the bare loop around our model does), and last every step's decision read at
# once (what the deferred reads gain: the least valuable, so the one a short budget leaves out; the
# 2026-11-27 H100 lease ran out before the bare loop when it came second). DeepSpeed's throughput timer
# cost 1.049x there (BENCHMARKS.md); impl.deepspeed.timers.throughput.enabled=true turns it back on.
# The unit is done once ours across the row has run too (the HF ratio at one scope, issue 84's goal);
# a second call on the same machine runs only what the first left (--resume-from, the same --work-dir).
if selected real-shape; then
  ran bert-base-accum || RUN_CONFIG=configs/base.yaml run bert-base-accum 1 "${REAL_BATCH[@]}"
  if ran bert-base-accum; then
    ran bare-base || yardstick bare-base bare
    ran hf-base || yardstick hf-base hf
    ran bert-base-accum-row ||
      RUN_CONFIG=configs/base.yaml run bert-base-accum-row 1 "${REAL_BATCH[@]}" model.attention_scope=row
    ran bert-base-accum-at-once ||
      RUN_CONFIG=configs/base.yaml run bert-base-accum-at-once 1 "${REAL_BATCH[@]}" impl.deferred_reads=false
  else record "skipped run bare-base, hf-base, bert-base-accum-row, bert-base-accum-at-once (need the bert-base-accum run to compare with)"; fi
  if ran bert-base-accum hf-base bare-base; then
    AT_ONCE_RUN=-; if ran bert-base-accum-at-once; then AT_ONCE_RUN="$WORK/runs/bert-base-accum-at-once"; fi
    ROW_RUN=-; if ran bert-base-accum-row; then ROW_RUN="$WORK/runs/bert-base-accum-row"; fi
    check real-shape yardsticks "$PEAK" "$WORK/runs/bert-base-accum" "$AT_ONCE_RUN" \
      "$WORK/runs/hf-base" "$WORK/runs/bare-base" "$ROW_RUN"
  else record "skipped check real-shape (needs the bert-base-accum, hf-base and bare-base runs)"; fi
  close real-shape check:real-shape bert-base-accum-row
fi
# impl.micro_batch_size=auto at base.yaml's real global batch: the micro-batches timed on this GPU, the one
# chosen, and the run's tokens/s at it beside bert-base-accum's 128 (issue 84, item 2).
if selected micro-batch; then
  RUN_CONFIG=configs/base.yaml run bert-base-auto-micro 1 "${REAL_BATCH[@]}" impl.micro_batch_size=auto
  if ran bert-base-auto-micro; then check micro-batch micro "$WORK/runs/bert-base-auto-micro"
  else record "skipped check micro-batch (needs the bert-base-auto-micro run)"; fi
  close micro-batch check:micro-batch
fi
# beside_real_shape UNIT RUN CHECK OVERRIDE...: base.yaml at its real shape with OVERRIDE, beside the run
# without it (bert-base-accum), compared by gpu_smoke_checks.py's CHECK: the same losses within the
# change's band, and what it gains.
beside_real_shape() {  # the unit's own run first, then bert-base-accum where no earlier unit or call ran it:
  # a budget that holds one of the two keeps the one no lease has run (an autotuned compile's ~420 s
  # leave room for bert-base-accum only if the guess is long)
  local unit=$1 name=$2 fn=$3; shift 3
  ran "$name" || RUN_CONFIG=configs/base.yaml run "$name" 1 "${REAL_BATCH[@]}" "$@"
  ran bert-base-accum || RUN_CONFIG=configs/base.yaml run bert-base-accum 1 "${REAL_BATCH[@]}"
  if ran bert-base-accum "$name"; then check "$unit" "$fn" "$WORK/runs/bert-base-accum" "$WORK/runs/$name"
  else record "skipped check $unit (needs the bert-base-accum and $name runs)"; fi
  close "$unit" "check:$unit"
}
# impl.precision=fp8 (issue 84, item 4): within float8's rounding, what the float8 matmuls gain.
if selected fp8; then beside_real_shape fp8 bert-base-accum-fp8 fp8 impl.precision=fp8; fi
# impl.dropout_hash=per_element beside the default per_pair (issue 84, item 3): what keeping keyed
# dropout's hash out of memory gains against hashing every element.
if selected dropout-hash; then
  beside_real_shape dropout-hash bert-base-accum-per-element dropout_hash impl.dropout_hash=per_element
fi
# impl.autotune_kernels=true (issue 84, item 3): what inductor's timed kernel choice (GELU and the bias in
# the matmuls' epilogues) gains; its compile's cost is the run's time.
if selected autotune; then beside_real_shape autotune bert-base-accum-autotune autotune impl.autotune_kernels=true; fi
# BERT-base at sequence 128 (configs/base.yaml: compiled, fused AdamW, ZeRO 1, fixed-count masking, BERT's
# hidden dropout 0.1): its MFU is the figure to set beside the anchors' (NVIDIA's BERT phase 1: about 45%
# of an A100's bf16 peak).
# It also evaluates the held-out split at its last step, compiled (after the last timed window).
# One command for the run whichever unit starts it: graphs, reads and patches compare against it, and
# a second call's bert-base may be the first call's, run by another unit.
bert_base() { RUN_CONFIG=configs/base.yaml run bert-base 1 "${BASE_BATCH[@]}" train.eval_every="$STEPS" train.eval_sequences=512; }
if selected bert-base; then
  bert_base
  if ran bert-base; then check heldout heldout "$WORK/runs/bert-base"
  else record "skipped check heldout (needs the bert-base run)"; fi
  close bert-base check:heldout
fi
# CUDA graphs where a step's host time decides (one micro-batch a step, the multi-node regime), beside
# the bert-base run above: what impl.cuda_graphs=auto waits for before it turns them on.
if selected graphs; then
  RUN_CONFIG=configs/base.yaml run bert-base-graphs 1 "${BASE_BATCH[@]}" impl.cuda_graphs=true
  if ran bert-base bert-base-graphs; then check graphs graphs "$WORK/runs/bert-base" "$WORK/runs/bert-base-graphs"
  else record "skipped check graphs (needs the bert-base and bert-base-graphs runs)"; fi
  close graphs check:graphs
fi
# What reading every step's decision at once costs where the step's host time shows (one micro-batch a
# step), beside bert-base: after graphs, the least valuable of the three.
if selected reads; then
  ran bert-base || bert_base
  RUN_CONFIG=configs/base.yaml run bert-base-at-once 1 "${BASE_BATCH[@]}" impl.deferred_reads=false
  if ran bert-base bert-base-at-once; then check reads reads "$WORK/runs/bert-base" "$WORK/runs/bert-base-at-once"
  else record "skipped check reads (needs the bert-base and bert-base-at-once runs)"; fi
  close reads check:reads
fi
# Each group of DeepSpeed patches that base.yaml's path runs, off in turn (impl.deepspeed_patches), at one
# micro-batch a step beside bert-base: what each is worth (issue 84, item 5); a group that shows no gain
# goes (docs/gpu-step.md).
if selected patches; then
  ran bert-base || bert_base
  OFF_RUNS=()
  for group in bf16_multi_tensor decisions_ahead; do
    RUN_CONFIG=configs/base.yaml run "bert-base-no-$group" 1 "${BASE_BATCH[@]}" "impl.deepspeed_patches.$group=false"
    OFF_RUNS+=("$WORK/runs/bert-base-no-$group")
  done
  if ran bert-base bert-base-no-bf16_multi_tensor bert-base-no-decisions_ahead; then
    check patches patches "$WORK/runs/bert-base" "${OFF_RUNS[@]}"
  else record "skipped check patches (needs bert-base and its two runs without a group)"; fi
  close patches check:patches
fi
# impl.activation_checkpointing=true beside the default at the real shape: the losses to bf16 round-off
# (the recompute under torch.compile), what the recompute costs and the peak memory it saves.
if selected checkpointing; then
  beside_real_shape checkpointing bert-base-accum-checkpointed checkpointing impl.activation_checkpointing=true
fi
if selected paths; then check paths paths "$CONFIG" "$DATA"; close paths check:paths; fi
# 128 x 512 tokens at 15%: a BERT-base phase-2 micro-batch's predicted tokens, at its hidden size.
if selected mlm-loss; then
  check_with mlm-loss 30 bench/mlm_loss.py --device cuda --precision bf16 --tokens 9830 --hidden 768 \
    --chunk-rows 1024 9830
  close mlm-loss check:mlm-loss
fi
adamw() { run adamw 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=1; }
if selected adamw; then adamw; close adamw adamw; fi
# A non-finite loss at ZeRO 1 bf16 (configs/base.yaml's setting: DeepSpeed's BF16_Optimizer): each such
# step skipped on every rank without moving the schedule, and after three in a row exit 4.
if selected nonfinite; then
  EXPECT=4 run nonfinite 1 impl.zero_stage=1 optim.lr=1e30 optim.warmup_steps=8 train.max_nonfinite_in_a_row=3 \
    train.log_every=1 train.checkpoint_every=1
  if ran nonfinite; then check nonfinite nonfinite "$WORK/runs/nonfinite"
  else record "skipped check nonfinite (needs the nonfinite run)"; fi
  close nonfinite check:nonfinite
fi
# A halt at mid-run and a resume at another ZeRO stage (the checkpoint converted on load, AdamW's step
# count put where the fused kernel wants it): the losses of the uninterrupted adamw run (run here first
# when an earlier lease ran it).
if selected resume; then
  ran adamw || adamw
  HALF=$((STEPS / 2 / 10 * 10)); HALF=$((HALF > 0 ? HALF : 10))
  run halted 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=1 train.halt_at_step=$HALF train.checkpoint_every=$HALF
  if ran halted; then
    CONTINUE=1 run halted 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=2 train.resume=auto
  fi
  if ran adamw halted-resumed; then check resume resumed "$WORK/runs/adamw" "$WORK/runs/halted"
  else record "skipped check resume (needs the adamw and halted runs)"; fi
  close resume check:resume
fi
if selected export; then
  run lamb 1 optim.name=lamb impl.zero_stage=0
  if ran lamb; then check export export "$WORK/runs/lamb"
  else record "skipped check export (needs the lamb run)"; fi
  close export check:export
fi
if selected zero3; then run zero3 1 impl.fused_optimizer=true impl.zero_stage=3; close zero3 zero3; fi
# Phase 2 of the BERT recipe: a new run from adamw's last checkpoint (ZeRO 1), converted to ZeRO 2.
if selected phase2; then
  ran adamw || adamw
  if ran adamw; then
    run phase2 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=2 \
      train.init_from_checkpoint="$WORK/runs/adamw/checkpoints"
  else record "skipped run phase2 (needs the adamw run's checkpoint)"; fi
  close phase2 phase2
fi
# ModernBERT: its local layers hand SDPA a sliding-window mask (flash cannot take it; the fallbacks can).
if selected modernbert; then
  RUN_CONFIG=configs/modernbert-tiny.yaml run modernbert 1 impl.zero_stage=1 model.max_position_embeddings=128
  close modernbert modernbert
fi
if ! selected flash-attn; then :
elif [ "$DRY_RUN" = 1 ] || "$PY" -c "import flash_attn" 2>/dev/null; then
  RUN_CONFIG=configs/modernbert-tiny.yaml run flash-attn 1 impl.zero_stage=1 model.max_position_embeddings=128 \
    impl.attention=flash_attention_2
  close flash-attn flash-attn
else
  echo "  flash-attn: not installed here, not run"
  record "skipped run flash-attn (the flash-attn package is not installed)"
fi
# Attention inside each packed document: its tokens/s beside adamw's (the same run in row scope).
if selected documents; then
  run documents 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=1 model.attention_scope=document
  RUN_CONFIG=configs/modernbert-tiny.yaml run documents-modernbert 1 impl.zero_stage=1 \
    model.max_position_embeddings=128 model.attention_scope=document
  run documents-flex 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=1 model.attention_scope=document \
    impl.attention=flex_attention
  close documents documents documents-modernbert documents-flex
fi
if selected dropout; then
  run dropout 1 model.hidden_dropout=0.1 model.attention_dropout=0.1 impl.zero_stage=1; close dropout dropout
fi
if selected compile-fixed; then
  run compile-fixed 1 impl.compile=true masking.fixed_count=true impl.fused_optimizer=true impl.zero_stage=1
  close compile-fixed compile-fixed
fi
# The same BERT-base without dropout: what keyed dropout costs in base.yaml's step.
if selected bert-base-nodrop; then
  RUN_CONFIG=configs/base.yaml run bert-base-nodrop 1 "${BASE_BATCH[@]}" model.hidden_dropout=0.0
  close bert-base-nodrop bert-base-nodrop
fi
if selected nccl; then run "nccl-$GPUS" "$GPUS" impl.zero_stage=2 impl.fused_optimizer=true; close nccl "nccl-$GPUS"; fi

if [ "$DRY_RUN" = 1 ]; then
  echo
  printf '%s\n' "${RESULTS[@]}"
  LEFT=()
  for unit in "${UNITS[@]}"; do
    if selected "$unit" >/dev/null && [[ " ${RESULTS[*]} " != *" done    $unit "* ]]; then LEFT+=("$unit"); fi
  done
  echo "planned: ~$PLANNED s of runs in --budget-s $BUDGET (the machine's start and the bundle's unpacking come" \
    "before it); selected and not done in it: ${LEFT[*]:-none}"
  exit 0
fi
echo
printf '%s\n' "${RESULTS[@]}"
echo
"$PY" bench/gpu_smoke_checks.py report "${RUN_DIRS[@]}" || true
echo "total: $((SECONDS - START)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "gpu_smoke: FAILED: ${FAILED[*]}" >&2; exit 1; fi
LEFT=()
for unit in "${UNITS[@]}"; do grep -qx "done    $unit" "$WORK/results.txt" 2>/dev/null || LEFT+=("$unit"); done
if [ ${#LEFT[@]} -gt 0 ]; then
  echo "gpu_smoke: nothing failed; not done yet: ${LEFT[*]}"
  echo "gpu_smoke: another lease runs only those: bench/gpu_smoke.sh --resume-from $WORK/results.txt"
else echo "gpu_smoke: all GPU paths ran"; fi
