#!/bin/bash
# Submit the data-prep array job (one `data_prep shard` task per index) and a finalize job after it.
#
#   launchers/slurm/submit_data_prep.sh --tasks K [--only I,J,...] [--finalize-output PATTERN] \
#       [SBATCH_OPTION...] -- SHARD_ARGS...
#
#   launchers/slurm/submit_data_prep.sh --tasks 16 --partition=cpu -- \
#       --input 'corpus/*.txt' --tokenizer tok/ --out data/wiki128 --seq-len 128
#
# SHARD_ARGS go to `python -m data_prep shard` unchanged and must include --out DIR. SBATCH_OPTIONs
# (--partition, --account, --time, ...) go to both sbatch calls; SBATCH_* environment variables work
# too. Prints "ARRAY_JOB_ID FINALIZE_JOB_ID" on stdout. The shards do not depend on K.
#
# CPUs per task: --cpus-per-task=N if given, else min(4, the fewest CPUs of a node in the partition),
# so that every node can run a task. Logs: --output/--error name the array tasks' logs only; the
# finalize log goes to the same folder as %x-%j.out (job name mlm-data-finalize), or to
# --finalize-output PATTERN.
#
# Finalize waits with afterany, so it runs even when tasks failed and then refuses, naming the missing
# task indices. Re-submit just those with the same arguments plus --only:
#
#   launchers/slurm/submit_data_prep.sh --tasks 16 --only 3,5 -- <same SHARD_ARGS>
#
# The finished tasks' outputs stay in place, so the new finalize completes the set.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() { sed -n '2,27s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2; }
die() { echo "submit_data_prep.sh: $*" >&2; exit 2; }
source "$here/array_args.sh"

# sbatch_opts go to both jobs; array_opts (logs, CPUs) to the array only
tasks="" only="" finalize_output="" output="" cpus="" partition="" sbatch_opts=() array_opts=()
while [ $# -gt 0 ]; do
    case $1 in
        --tasks) [ $# -ge 2 ] || die "--tasks needs a value"; tasks=$2; shift 2 ;;
        --tasks=*) tasks=${1#*=}; shift ;;
        --only) [ $# -ge 2 ] || die "--only needs a value"; only=$2; shift 2 ;;
        --only=*) only=${1#*=}; shift ;;
        --finalize-output) [ $# -ge 2 ] || die "--finalize-output needs a value"; finalize_output=$2; shift 2 ;;
        --finalize-output=*) finalize_output=${1#*=}; shift ;;
        --output|-o) [ $# -ge 2 ] || die "$1 needs a value"; output=$2; array_opts+=("--output=$2"); shift 2 ;;
        --output=*) output=${1#*=}; array_opts+=("$1"); shift ;;
        -o?*) output=${1#-o}; array_opts+=("--output=$output"); shift ;;
        --error|-e) [ $# -ge 2 ] || die "$1 needs a value"; array_opts+=("--error=$2"); shift 2 ;;
        --error=*) array_opts+=("$1"); shift ;;
        -e?*) array_opts+=("--error=${1#-e}"); shift ;;
        --cpus-per-task|-c) [ $# -ge 2 ] || die "$1 needs a value"; cpus=$2; shift 2 ;;
        --cpus-per-task=*) cpus=${1#*=}; shift ;;
        -c?*) cpus=${1#-c}; shift ;;
        --partition|-p) [ $# -ge 2 ] || die "$1 needs a value"; partition=$2; sbatch_opts+=("--partition=$2"); shift 2 ;;
        --partition=*) partition=${1#*=}; sbatch_opts+=("$1"); shift ;;
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

array=$(array_spec "$tasks" "$only")
cpus=$(cpus_per_task "$cpus" "$partition")
array_opts+=("--cpus-per-task=$cpus")
finalize_opts=()
if [ -n "$finalize_output" ]; then
    finalize_opts+=("--output=$finalize_output")
elif [ -n "$output" ]; then
    # the array's pattern (%A_%a) would name finalize's log after a task that does not exist
    log_dir=$(dirname -- "$output")
    finalize_opts+=("--output=$log_dir/%x-%j.out")
fi

# Slurm fails a job whose --output/--error folder is missing (exit 0:53): make them.
for opt in "${array_opts[@]}" "${finalize_opts[@]}"; do
    case $opt in
        --output=*|--error=*)
            log_dir=$(dirname -- "${opt#*=}")
            [[ $log_dir == *%* ]] || mkdir -p -- "$log_dir" || die "cannot create the log folder '$log_dir'" ;;
    esac
done

array_job=$(sbatch --parsable --array="$array" "${sbatch_opts[@]}" "${array_opts[@]}" \
    "$here/data_prep.sbatch" --num-tasks "$tasks" "${shard_args[@]}")
array_job=${array_job%%;*}
# afterany rather than afterok: with afterok a failed task leaves finalize pending forever (or, with
# --kill-on-invalid-dep, silently cancelled); finalize itself names the missing tasks.
# Its own dependency last: sbatch takes the last --dependency, and SBATCH_OPTIONs may hold one for the
# array (submit_clean.sh --then-shard: after the cleaning).
finalize_job=$(sbatch --parsable "${sbatch_opts[@]}" --dependency="afterany:$array_job" "${finalize_opts[@]}" \
    "$here/finalize.sbatch" "$out")
finalize_job=${finalize_job%%;*}
echo "array job $array_job (tasks $array of $tasks, $cpus CPU(s) each), finalize job $finalize_job -> $out" >&2
echo "$array_job $finalize_job"
