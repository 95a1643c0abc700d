#!/bin/bash
# Train on this one machine with DeepSpeed's launcher: N ranks (GPUs, or CPU processes).
#
#   launchers/local.sh [N] [--config] CONFIG [dotted.key=value ...]
#   launchers/local.sh 2 --config configs/tiny.yaml data.dir=data/tiny train.out_dir=runs/tiny
#
# N defaults to the number of visible GPUs, else 1. MASTER_PORT defaults to a free port. On the CPU
# each rank gets nproc/N OpenMP threads unless OMP_NUM_THREADS is set (the deepspeed launcher sets
# none, and oversubscribed ranks ran 9x slower). Python: $PYTHON if set, else the repository's .venv
# (launchers/setup_env.sh; no need to activate it), else python3. Hyperparameters live in CONFIG and the overrides, never here.
set -euo pipefail

usage() { echo "usage: $0 [N] [--config] CONFIG [dotted.key=value ...]" >&2; exit 2; }
nproc_arg=""
case ${1:-} in
    -h|--help) sed -n '2,10s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -n|--nproc) [ $# -ge 2 ] || usage; nproc_arg=$2; shift 2 ;;
    [0-9]*) nproc_arg=$1; shift ;;
esac
case ${1:-} in
    --config) [ $# -ge 2 ] || usage; config=$2; shift 2 ;;
    --config=*) config=${1#*=}; shift ;;
    ""|-*) usage ;;
    *) config=$1; shift ;;
esac
[ -f "$config" ] || { echo "local.sh: config file '$config' not found (run from the repository root?)" >&2; exit 2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then PY=$root/.venv/bin/python
else PY=python3; fi

if [ -z "$nproc_arg" ]; then
    nproc_arg=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)')
fi
[[ $nproc_arg =~ ^[1-9][0-9]*$ ]] || { echo "local.sh: -n wants a positive integer, got '$nproc_arg'" >&2; exit 2; }

threads=$(( $(nproc) / nproc_arg ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
port=${MASTER_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# pretrain.launch: deepspeed with signals passed on to the ranks and their exit code kept.
exec "$PY" -m pretrain.launch --num_gpus "$nproc_arg" --master_port "$port" --module pretrain.train --config "$config" "$@"
