# Sourced by the submit_*.sh helpers: what their array jobs' arguments share. Each function prints
# its answer or calls the helper's own die (message, exit 2).

# array_spec TASKS ONLY: the --array value: 0-(TASKS-1), or ONLY's indices (comma-separated, checked)
array_spec() {
    local tasks=$1 only=$2 i
    if [ -z "$only" ]; then echo "0-$((tasks - 1))"; return; fi
    [[ $only =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--only wants comma-separated task indices, got '$only'"
    for i in ${only//,/ }; do
        [ "$i" -lt "$tasks" ] || die "--only: task $i is out of range for --tasks $tasks (0..$((tasks - 1)))"
    done
    echo "$only"
}

# cpus_per_task CPUS PARTITION: CPUS (checked), else min(4, the fewest CPUs of a node in PARTITION):
# the node with the fewest CPUs must still be able to run a task
cpus_per_task() {
    local cpus=$1 partition=$2 node_cpus
    if [ -z "$cpus" ]; then
        node_cpus=$(sinfo -h -N -o %c ${partition:+--partition="$partition"} 2>/dev/null | tr -dc '0-9\n' | sort -n | head -n1)
        cpus=4
        if [[ $node_cpus =~ ^[1-9][0-9]*$ ]] && [ "$node_cpus" -lt "$cpus" ]; then cpus=$node_cpus; fi
    fi
    [[ $cpus =~ ^[1-9][0-9]*$ ]] || die "--cpus-per-task wants a positive integer, got '$cpus'"
    echo "$cpus"
}
