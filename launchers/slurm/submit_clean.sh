#!/bin/bash
# Submit a cleaning run as three dependent jobs: the signatures array, the clusters job, the filter
# array; optionally chain sharding of the cleaned output (submit_data_prep.sh) after it.
#
#   launchers/slurm/submit_clean.sh --tasks K [--only I,J,...] [--from STAGE] [SBATCH_OPTION...] \
#       -- CLEAN_ARGS... [--then-shard -- SHARD_ARGS...]
#
#   launchers/slurm/submit_clean.sh --tasks 16 --partition=cpu -- --input 'raw/*.jsonl' --out corpus \
#       --decontaminate-against test.jsonl --then-shard -- --tokenizer tok/ --out data/wiki128 --seq-len 128
#
# CLEAN_ARGS go to `python -m data_prep clean` and must include --out; SHARD_ARGS to
# `data_prep shard` (its --input defaults to the cleaned folder; its array has as many tasks).
# SBATCH_OPTIONs go to every sbatch call. Prints the job ids on stdout: "SIGNATURES CLUSTERS FILTER"
# (and "ARRAY FINALIZE" of the shard jobs on a second line with --then-shard).
#
# The output does not depend on K. The clusters job waits with afterany: after a lost signatures task
# it runs, refuses and names the task indices; the filter array (afterok, cancelled when clusters
# fails) never starts. Re-submit the lost indices with the same arguments plus --only (the clusters
# job and the whole filter array follow; finished groups are skipped):
#
#   launchers/slurm/submit_clean.sh --tasks 16 --only 3,5 -- <same CLEAN_ARGS>
#
# --from clusters or --from filter starts later (a failed filter task: --from filter --only 7).
# CPUs per array task: --cpus-per-task=N, else min(4, the fewest CPUs of a node in the partition).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() { sed -n '2,30s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2; }
die() { echo "submit_clean.sh: $*" >&2; exit 2; }
source "$here/array_args.sh"

tasks="" only="" from=signatures cpus="" partition="" sbatch_opts=()
while [ $# -gt 0 ]; do
    case $1 in
        --tasks) [ $# -ge 2 ] || die "--tasks needs a value"; tasks=$2; shift 2 ;;
        --tasks=*) tasks=${1#*=}; shift ;;
        --only) [ $# -ge 2 ] || die "--only needs a value"; only=$2; shift 2 ;;
        --only=*) only=${1#*=}; shift ;;
        --from) [ $# -ge 2 ] || die "--from needs a value"; from=$2; shift 2 ;;
        --from=*) from=${1#*=}; shift ;;
        --cpus-per-task|-c) [ $# -ge 2 ] || die "$1 needs a value"; cpus=$2; shift 2 ;;
        --cpus-per-task=*) cpus=${1#*=}; shift ;;
        --partition|-p) [ $# -ge 2 ] || die "$1 needs a value"; partition=$2; sbatch_opts+=("--partition=$2"); shift 2 ;;
        --partition=*) partition=${1#*=}; sbatch_opts+=("$1"); shift ;;
        -h|--help) usage ;;
        --) shift; break ;;
        *) sbatch_opts+=("$1"); shift ;;
    esac
done
clean_args=() shard_args=() then_shard=0
while [ $# -gt 0 ]; do
    if [ "$1" = --then-shard ]; then
        then_shard=1; shift
        [ "${1:-}" = -- ] || die "--then-shard wants -- and the data_prep shard arguments after it"
        shift; shard_args=("$@"); break
    fi
    clean_args+=("$1"); shift
done
[[ $tasks =~ ^[1-9][0-9]*$ ]] || die "--tasks K (a positive integer) is required; got '${tasks}'"
[ ${#clean_args[@]} -gt 0 ] || die "no data_prep clean arguments after --"
case $from in signatures|clusters|filter) ;; *) die "--from wants signatures, clusters or filter; got '$from'" ;; esac

out=""
for ((i = 0; i < ${#clean_args[@]}; i++)); do
    case ${clean_args[i]} in
        --out) out=${clean_args[i + 1]:-} ;;
        --out=*) out=${clean_args[i]#*=} ;;
        --num-tasks|--num-tasks=*|--task-index|--task-index=*|--stage|--stage=*)
            die "${clean_args[i]%%=*} is set by this script (--tasks, the array index, the stages); leave it out" ;;
    esac
done
[ -n "$out" ] || die "the data_prep clean arguments must include --out DIR"

[ -z "$only" ] || [ "$from" != clusters ] || die "--only names array tasks: it goes with --from signatures or filter"
array=$(array_spec "$tasks" "$only")
cpus=$(cpus_per_task "$cpus" "$partition")

submit() { local id; id=$(sbatch --parsable "$@"); echo "${id%%;*}"; }
stage_args=(--num-tasks "$tasks" "${clean_args[@]}")
sig_job="" clusters_job="" filter_job=""
after=()
if [ "$from" = signatures ]; then
    sig_job=$(submit --array="$array" --cpus-per-task="$cpus" --job-name=mlm-clean-signatures "${sbatch_opts[@]}" \
        "$here/clean.sbatch" signatures "${stage_args[@]}")
    # afterany: the clusters job runs after a lost task too, and names it
    after=(--dependency="afterany:$sig_job")
fi
if [ "$from" != filter ]; then
    clusters_job=$(submit "${after[@]}" --cpus-per-task=1 --job-name=mlm-clean-clusters "${sbatch_opts[@]}" \
        "$here/clean.sbatch" clusters "${stage_args[@]}")
    after=(--dependency="afterok:$clusters_job" --kill-on-invalid-dep=yes)
    [ "$from" = signatures ] && [ -n "$only" ] && array=0-$((tasks - 1))    # every group needs its filter
fi
filter_job=$(submit "${after[@]}" --array="$array" --cpus-per-task="$cpus" --job-name=mlm-clean-filter \
    "${sbatch_opts[@]}" "$here/clean.sbatch" filter "${stage_args[@]}")
echo "signatures ${sig_job:-skipped}, clusters ${clusters_job:-skipped}, filter $filter_job ($tasks tasks, $cpus CPU(s) each) -> $out" >&2
echo "${sig_job:--} ${clusters_job:--} $filter_job"
if [ $then_shard = 1 ]; then
    has_input=0
    for a in "${shard_args[@]}"; do case $a in --input|--input=*) has_input=1 ;; esac; done
    [ $has_input = 1 ] || shard_args=(--input "$out" "${shard_args[@]}")
    "$here/submit_data_prep.sh" --tasks "$tasks" --cpus-per-task="$cpus" "${sbatch_opts[@]}" \
        --dependency="afterok:$filter_job" --kill-on-invalid-dep=yes -- "${shard_args[@]}"
fi
