#!/bin/bash
# Submit the data-prep array job (one `data_prep shard` task per index) and a finalize job after it.
#
#   launchers/slurm/submit_data_prep.sh --tasks K [--only I,J,...] [SBATCH_OPTION...] -- SHARD_ARGS...
#
#   launchers/slurm/submit_data_prep.sh --tasks 16 --partition=cpu -- \
#       --input 'corpus/*.txt' --tokenizer tok/ --out data/wiki128 --seq-len 128
#
# SHARD_ARGS go to `python -m data_prep shard` unchanged and must include --out DIR. SBATCH_OPTIONs
# (--partition, --account, --time, --output, ...) go to both sbatch calls; SBATCH_* environment
# variables work too. Prints "ARRAY_JOB_ID FINALIZE_JOB_ID" on stdout.
#
# Finalize waits with afterany, so it runs even when tasks failed and then refuses, naming the missing
# task indices. Re-submit just those with the same arguments plus --only:
#
#   launchers/slurm/submit_data_prep.sh --tasks 16 --only 3,5 -- <same SHARD_ARGS>
#
# The finished tasks' outputs stay in place, so the new finalize completes the set.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() { sed -n '2,20s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2; }
die() { echo "submit_data_prep.sh: $*" >&2; exit 2; }

tasks="" only="" sbatch_opts=()
while [ $# -gt 0 ]; do
    case $1 in
        --tasks) [ $# -ge 2 ] || die "--tasks needs a value"; tasks=$2; shift 2 ;;
        --tasks=*) tasks=${1#*=}; shift ;;
        --only) [ $# -ge 2 ] || die "--only needs a value"; only=$2; shift 2 ;;
        --only=*) only=${1#*=}; shift ;;
        -h|--help) usage ;;
        --) shift; break ;;
        *) sbatch_opts+=("$1"); shift ;;
    esac
done
shard_args=("$@")
[[ $tasks =~ ^[1-9][0-9]*$ ]] || die "--tasks K (a positive integer) is required; got '${tasks}'"
[ ${#shard_args[@]} -gt 0 ] || die "no data_prep shard arguments after --"

out=""
for ((i = 0; i < ${#shard_args[@]}; i++)); do
    case ${shard_args[i]} in
        --out) out=${shard_args[i + 1]:-} ;;
        --out=*) out=${shard_args[i]#*=} ;;
        --num-tasks|--num-tasks=*|--task-index|--task-index=*)
            die "${shard_args[i]%%=*} is set by this script (--tasks, the array index); leave it out" ;;
    esac
done
[ -n "$out" ] || die "the data_prep shard arguments must include --out DIR (finalize needs it)"

if [ -n "$only" ]; then
    [[ $only =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--only wants comma-separated task indices, got '$only'"
    for i in ${only//,/ }; do
        [ "$i" -lt "$tasks" ] || die "--only: task $i is out of range for --tasks $tasks (0..$((tasks - 1)))"
    done
    array=$only
else
    array=0-$((tasks - 1))
fi

array_job=$(sbatch --parsable --array="$array" "${sbatch_opts[@]}" \
    "$here/data_prep.sbatch" --num-tasks "$tasks" "${shard_args[@]}")
array_job=${array_job%%;*}
# afterany rather than afterok: with afterok a failed task leaves finalize pending forever (or, with
# --kill-on-invalid-dep, silently cancelled); finalize itself names the missing tasks.
finalize_job=$(sbatch --parsable --dependency="afterany:$array_job" "${sbatch_opts[@]}" \
    "$here/finalize.sbatch" "$out")
finalize_job=${finalize_job%%;*}
echo "array job $array_job (tasks $array of $tasks), finalize job $finalize_job -> $out" >&2
echo "$array_job $finalize_job"
