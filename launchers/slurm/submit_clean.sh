#!/bin/bash
# Submit a cleaning run as five dependent jobs: the signatures array, the exact-duplicates array, the
# near-duplicate pairs array, the clusters job (the join) and the filter array; optionally chain
# sharding of the cleaned output (submit_data_prep.sh) after it.
#
#   launchers/slurm/submit_clean.sh --tasks K [--only I,J,...] [--from STAGE] [SBATCH_OPTION...] \
#       -- CLEAN_ARGS... [--then-shard -- SHARD_ARGS...]
#
#   launchers/slurm/submit_clean.sh --tasks 16 --partition=cpu -- --input 'raw/*.jsonl' --out corpus \
#       --decontaminate-against test.jsonl --then-shard -- --tokenizer tok/ --out data/wiki128 --seq-len 128
#
# CLEAN_ARGS go to `python -m data_prep clean` and must include --out; SHARD_ARGS to
# `data_prep shard` (its --input defaults to the cleaned folder; its array has as many tasks).
# SBATCH_OPTIONs go to every sbatch call. Prints the job ids on stdout:
# "SIGNATURES EXACT PAIRS CLUSTERS FILTER" ("-" for a stage not submitted), and "ARRAY FINALIZE" of
# the shard jobs on a second line with --then-shard.
#
# The output does not depend on K. Each array waits for the one before with afterok (cancelled when
# a task before it is lost); the clusters job waits with afterany: it runs after a lost task too,
# refuses and names the task indices and the stage; the filter array (afterok) never starts.
# Re-submit the lost indices with the same arguments plus --only (and --from the stage the clusters
# job names; the later stages follow; finished groups and tasks are skipped):
#
#   launchers/slurm/submit_clean.sh --tasks 16 --only 3,5 -- <same CLEAN_ARGS>
#   launchers/slurm/submit_clean.sh --tasks 16 --from pairs --only 7 -- <same CLEAN_ARGS>
#
# --from exact, pairs, clusters or filter starts later (a failed filter task: --from filter --only 7).
# CPUs per array task: --cpus-per-task=N, else min(4, the fewest CPUs of a node in the partition).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() { sed -n '2,31s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2; }
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
case $from in signatures|exact|pairs|clusters|filter) ;; *) die "--from wants signatures, exact, pairs, clusters or filter; got '$from'" ;; esac

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

[ -z "$only" ] || [ "$from" != clusters ] || die "--only names array tasks: it goes with --from signatures, exact, pairs or filter"
array=$(array_spec "$tasks" "$only")
cpus=$(cpus_per_task "$cpus" "$partition")

submit() { local id; id=$(sbatch --parsable "$@"); echo "${id%%;*}"; }
stage_args=(--num-tasks "$tasks" "${clean_args[@]}")
stages=(signatures exact pairs clusters filter)
declare -A job=()
after=() started=0
for stage in "${stages[@]}"; do
    [ "$stage" = "$from" ] && started=1
    [ $started = 1 ] || continue
    if [ "$stage" = clusters ]; then
        job[$stage]=$(submit "${after[@]}" --cpus-per-task=1 --job-name=mlm-clean-clusters "${sbatch_opts[@]}" \
            "$here/clean.sbatch" clusters "${stage_args[@]}")
        after=(--dependency="afterok:${job[$stage]}" --kill-on-invalid-dep=yes)
        continue
    fi
    job[$stage]=$(submit "${after[@]}" --array="$array" --cpus-per-task="$cpus" --job-name="mlm-clean-$stage" \
        "${sbatch_opts[@]}" "$here/clean.sbatch" "$stage" "${stage_args[@]}")
    array=0-$((tasks - 1))    # --only names the first stage's tasks: every later one reads all of them
    if [ "$stage" = pairs ]; then
        # afterany: the clusters job runs after a lost task too, and names it
        after=(--dependency="afterany:${job[$stage]}")
    else
        after=(--dependency="afterok:${job[$stage]}" --kill-on-invalid-dep=yes)
    fi
done
ids=() summary=""
for stage in "${stages[@]}"; do
    ids+=("${job[$stage]:--}")
    summary+="${summary:+, }$stage ${job[$stage]:-skipped}"
done
filter_job=${job[filter]}
echo "$summary ($tasks tasks, $cpus CPU(s) each) -> $out" >&2
echo "${ids[*]}"
if [ $then_shard = 1 ]; then
    has_input=0
    for a in "${shard_args[@]}"; do case $a in --input|--input=*) has_input=1 ;; esac; done
    [ $has_input = 1 ] || shard_args=(--input "$out" "${shard_args[@]}")
    "$here/submit_data_prep.sh" --tasks "$tasks" --cpus-per-task="$cpus" "${sbatch_opts[@]}" \
        --dependency="afterok:$filter_job" --kill-on-invalid-dep=yes -- "${shard_args[@]}"
fi
