#!/usr/bin/env bash
# Every GPU-only path of the trainer, on one node, in a few minutes, through the real entry point:
#   adamw         torch's fused AdamW (the default; no build step), bf16, ZeRO 1; every run: the attention
#                 kernel timed at start-up (impl.attention=auto: its line in each run's stdout.log), the fused MLM loss
#   lamb          our LAMB (the same maths as on the CPU), bf16, ZeRO 0 (its per-tensor trust ratio needs whole tensors)
#   compile-fixed torch.compile + masking.fixed_count (static shapes), fused AdamW, bf16, ZeRO 1
#   dropout       dropout 0.1: keyed dropout on the hidden states, attention run eagerly to key its dropout
#   nccl-N        NCCL across all N visible GPUs of this node, ZeRO 2, bf16
#   halted        adamw halted at mid-run, then resumed at ZeRO 2: the uninterrupted run's losses
#   export        the lamb run's Hugging Face export (ZeRO 0 bf16: the fp32 masters) loads and fills masks
#   bert-base     configs/base.yaml at sequence 128: MFU to compare with NVIDIA's BERT (~45%)
# before them, bench/gpu_smoke_checks.py checks the optimisers and the flash SDPA kernel directly,
# bench/mlm_loss.py times the fused MLM loss (every run's default) against the plain one at a GPU batch,
# and after them prints tokens/s and MFU (against the peak printed first) from each run's metrics.jsonl.
#
#   bench/gpu_smoke.sh [--dry-run] [--gpus N] [--steps 50] [--micro-batch 64] [--config configs/mini.yaml]
#                      [--data SHARD_DIR] [--work-dir /tmp/gpu_smoke]
#
# --dry-run prints the commands without running them (needs no GPU); tests/test_bench.py loads every
# config and override they use, the Python checks' included, on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEEPSPEED=${DEEPSPEED:-$(dirname "$PY")/deepspeed}
command -v "$DEEPSPEED" >/dev/null 2>&1 || DEEPSPEED=deepspeed

DRY_RUN=0 GPUS="" STEPS=50 MICRO=64 CONFIG=configs/mini.yaml DATA="" WORK=/tmp/gpu_smoke
usage() { grep -A1 '^#   bench/gpu_smoke.sh \[' "$0" | sed 's/^# \{0,3\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --gpus) GPUS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --micro-batch) MICRO=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --work-dir) WORK=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_smoke: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for pair in "--steps:$STEPS" "--micro-batch:$MICRO" ${GPUS:+"--gpus:$GPUS"}; do
  case "${pair#*:}" in ''|*[!0-9]*|0) echo "gpu_smoke: ${pair%%:*} must be a positive integer, got '${pair#*:}'" >&2; exit 2 ;; esac
done
[ -f "$CONFIG" ] || { echo "gpu_smoke: --config $CONFIG: no such file" >&2; exit 2; }
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
  if [ -z "$DATA" ]; then
    DATA=$("$PY" -c "import sys; sys.path.insert(0, '.'); from bench.common import ensure_sample_shards; print(ensure_sample_shards(sys.argv[1]))" "$WORK")
  fi
  PEAK_LINE=$("$PY" bench/gpu_smoke_checks.py peak)
  PEAK=${PEAK_LINE%%$'\t'*}
  echo "peak: $PEAK TFLOP/s (${PEAK_LINE#*$'\t'})"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}   # the deepspeed launcher leaves it unset

COMMON=(data.dir="$DATA" train.max_steps="$STEPS" train.log_every=10 train.eval_every=0 train.checkpoint_every=0
        train.resume=none train.keep_checkpoints=1 tracking.backend=none impl.precision=bf16 impl.attention=auto
        impl.dist_backend=nccl impl.micro_batch_size="$MICRO" impl.num_workers=2 impl.peak_tflops="$PEAK")
RUN_DIRS=()
FAILED=()
START=$SECONDS

run() {  # run NAME NUM_GPUS OVERRIDES...   (a fresh run folder; CONTINUE=1 keeps it, to resume)
  local name=$1 ngpu=$2; shift 2
  local out="$WORK/runs/$name"
  local cmd=("$DEEPSPEED" --num_gpus "$ngpu" --master_port $((29500 + RANDOM % 1000)) --module pretrain.train
             --config "${RUN_CONFIG:-$CONFIG}" "${COMMON[@]}" train.out_dir="$out" train.global_batch_size=$((MICRO * ngpu)) "$@")
  echo "+ ${cmd[*]}"
  [ "$DRY_RUN" = 1 ] && return 0
  [ "${CONTINUE:-0}" = 1 ] || rm -rf "$out"
  mkdir -p "$out"
  local t0=$SECONDS
  if timeout 300 "${cmd[@]}" >"$out/stdout.log" 2>&1; then
    echo "  $name: done in $((SECONDS - t0)) s"
  else
    echo "  $name: FAILED (exit $?) after $((SECONDS - t0)) s; last lines of $out/stdout.log:"
    tail -n 15 "$out/stdout.log" | sed 's/^/    /'
    FAILED+=("$name")
  fi
  [ "${CONTINUE:-0}" = 1 ] || RUN_DIRS+=("$out")
}

check() {  # check NAME ARGS... : one of bench/gpu_smoke_checks.py's checks, its lines, FAILED on error
  local name=$1; shift
  echo "+ $PY bench/gpu_smoke_checks.py $*"
  [ "$DRY_RUN" = 1 ] && return 0
  "$PY" bench/gpu_smoke_checks.py "$@" || FAILED+=("$name")
}

if [ "$DRY_RUN" = 1 ]; then
  echo "+ $PY bench/gpu_smoke_checks.py paths $CONFIG $DATA"
else
  "$PY" bench/gpu_smoke_checks.py paths "$CONFIG" "$DATA" || FAILED+=("paths")
fi
# 128 x 512 tokens at 15%: a BERT-base phase-2 micro-batch's predicted tokens, at its hidden size.
MLM_LOSS=(bench/mlm_loss.py --device cuda --precision bf16 --tokens 9830 --hidden 768 --chunk-rows 1024 9830)
echo "+ $PY ${MLM_LOSS[*]}"
[ "$DRY_RUN" = 1 ] || "$PY" "${MLM_LOSS[@]}" || FAILED+=("mlm-loss")
run adamw 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=1
run lamb 1 optim.name=lamb impl.zero_stage=0
run compile-fixed 1 impl.compile=true masking.fixed_count=true impl.fused_optimizer=true impl.zero_stage=1
run dropout 1 model.hidden_dropout=0.1 model.attention_dropout=0.1 impl.zero_stage=1
run "nccl-$GPUS" "$GPUS" impl.zero_stage=2 impl.fused_optimizer=true
# A halt at mid-run and a resume at another ZeRO stage (the checkpoint converted on load): the losses
# of the uninterrupted adamw run above. And the lamb run's export (ZeRO 0, bf16: the fp32 masters).
HALF=$((STEPS / 2 / 10 * 10)); HALF=$((HALF > 0 ? HALF : 10))
run halted 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=1 train.halt_at_step=$HALF train.checkpoint_every=$HALF
CONTINUE=1 run halted 1 optim.name=adamw impl.fused_optimizer=true impl.zero_stage=2 train.resume=auto
check resume resumed "$WORK/runs/adamw" "$WORK/runs/halted"
# BERT-base at sequence 128 (configs/base.yaml, compiled, fused AdamW, ZeRO 1): its MFU is the figure to
# set beside the anchors' (NVIDIA's BERT phase 1: about 45% of an A100's bf16 peak).
RUN_CONFIG=configs/base.yaml run bert-base 1 impl.micro_batch_size="$MICRO"
check export export "$WORK/runs/lamb"

[ "$DRY_RUN" = 1 ] && exit 0
echo
"$PY" bench/gpu_smoke_checks.py report "${RUN_DIRS[@]}" || true
echo "total: $((SECONDS - START)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "gpu_smoke: FAILED: ${FAILED[*]}" >&2; exit 1; fi
echo "gpu_smoke: all GPU paths ran"
