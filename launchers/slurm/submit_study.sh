#!/bin/bash
# Submit a study: an array job with one variant per task (study.sbatch) and a summary job after it.
#
#   launchers/slurm/submit_study.sh [SBATCH_OPTION...] -- [--config] STUDY_YAML [key=value | key=v1,v2 ...]
#
#   launchers/slurm/submit_study.sh --partition=gpu --gpus-per-node=2 -- \
#       configs/study.yaml data.dir=data/wiki128 masking.dynamic=true,false
#
# First `python -m pretrain.study --prepare` checks every variant's config and data (exit 2 and
# nothing submitted if any is wrong), opens the study's MLflow parent run and counts the variants.
# SBATCH_OPTIONs (--partition, --account, --time, --gpus-per-node, ...) go to both sbatch calls.
# The summary job waits with afterany, so it also runs when some variants failed and shows which.
# Submitting the same study again skips finished variants and resumes interrupted ones.
# Prints "ARRAY_JOB_ID SUMMARY_JOB_ID" on stdout.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() { sed -n '2,15s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2; }
die() { echo "submit_study.sh: $*" >&2; exit 2; }

sbatch_opts=()
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage ;;
        --) shift; break ;;
        *) sbatch_opts+=("$1"); shift ;;
    esac
done
[ $# -gt 0 ] || usage
case $1 in
    --config) [ $# -ge 2 ] || usage; config=$2; shift 2 ;;
    --config=*) config=${1#*=}; shift ;;
    *) config=$1; shift ;;
esac
[ -f "$config" ] || die "study config '$config' not found (run from the repository root?)"

# Slurm fails a job whose --output/--error folder is missing (exit 0:53): make it. The summary job
# is no array: the array's pattern (%A_%a) would name its log ..._4294967294.out.
summary_output="--output=slurm-%x-%j.out"
for ((i = 0; i < ${#sbatch_opts[@]}; i++)); do
    opt=${sbatch_opts[i]} value=""
    case $opt in
        --output=*|--error=*) value=${opt#*=} ;;
        -o|--output|-e|--error) value=${sbatch_opts[i + 1]:-} ;;
        -o?*|-e?*) value=${opt:2} ;;
    esac
    [ -n "$value" ] || continue
    log_dir=$(dirname -- "$value")
    [[ $log_dir == *%* ]] || mkdir -p -- "$log_dir" || die "cannot create the log folder '$log_dir'"
    case $opt in -o*|--output*) summary_output="--output=$log_dir/%x-%j.out" ;; esac
done

variants=$(python -m pretrain.study --prepare --config "$config" "$@") || exit 2
[[ $variants =~ ^[1-9][0-9]*$ ]] || die "pretrain.study --prepare printed '$variants', not a variant count"

array_job=$(sbatch --parsable --array="0-$((variants - 1))" "${sbatch_opts[@]}" \
    "$here/study.sbatch" --config "$config" "$@")
array_job=${array_job%%;*}
summary_job=$(sbatch --parsable --dependency="afterany:$array_job" --job-name=mlm-study-summary \
    "${sbatch_opts[@]}" "$summary_output" "$here/study.sbatch" --summarize --config "$config" "$@")
summary_job=${summary_job%%;*}
echo "array job $array_job ($variants variants), summary job $summary_job" >&2
echo "$array_job $summary_job"
