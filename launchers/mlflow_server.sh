#!/bin/bash
# Start the MLflow tracking server + UI that training runs report to.
#
#   launchers/mlflow_server.sh [--dir DIR] [--host HOST] [--port PORT]
#
# DIR (default ./mlflow, or $MLFLOW_DIR) holds the SQLite store (DIR/mlflow.db) and the artifacts
# (DIR/artifacts). Clients upload artifacts through the server (--serve-artifacts), so training
# nodes need no access to DIR. HOST defaults to 127.0.0.1 ($MLFLOW_HOST), PORT to 5000 ($MLFLOW_PORT).
# On a cluster, where compute nodes must reach this server, use --host 0.0.0.0 only on a trusted
# network: the server has no authentication. An SSH tunnel to 127.0.0.1 is the safer way to the UI.
set -euo pipefail

dir=${MLFLOW_DIR:-./mlflow}
host=${MLFLOW_HOST:-127.0.0.1}
port=${MLFLOW_PORT:-5000}
while [ $# -gt 0 ]; do
    case $1 in
        --dir) dir=$2; shift 2 ;;
        --host) host=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        -h|--help) sed -n '2,10s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "mlflow_server.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
# The project's interpreter, whatever PATH holds: $PYTHON, else the .venv beside this script (what
# launchers/setup_env.sh makes), else python3 on PATH; it must import mlflow before anything is printed.
src=${BASH_SOURCE[0]}
[[ "$src" == */* ]] || src=./$src
here=$(cd "${src%/*}" && pwd)
py=${PYTHON:-$here/../.venv/bin/python}
[ -x "$py" ] || py=$(command -v python3 || command -v python || true)
if [ -z "$py" ] || ! "$py" -c "import mlflow" 2>/dev/null; then
    echo "mlflow_server.sh: no Python with mlflow (tried \$PYTHON, $here/../.venv/bin/python, python3 on PATH):" \
         "run launchers/setup_env.sh first, or set PYTHON to an interpreter that has it" >&2
    exit 2
fi
mkdir -p "$dir/artifacts"
dir=$(cd "$dir" && pwd)
# The job runner serves MLflow's GenAI features (a dozen worker processes); training needs none of it.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}

shown=$host
if [ "$host" != 127.0.0.1 ] && [ "$host" != localhost ]; then
    [ "$host" = 0.0.0.0 ] && shown=$(hostname -f 2>/dev/null || hostname)
    # MLflow answers 403 to a Host header outside its allow-list (localhost and private IPs by
    # default), which would include this node's name as compute nodes address it.
    if [ -z "${MLFLOW_SERVER_ALLOWED_HOSTS:-}" ]; then
        names="localhost 127.0.0.1 $(hostname) $(hostname -f 2>/dev/null || true) $host"
        allowed="10.*,192.168.*,172.1[6-9].*,172.2[0-9].*,172.3[01].*"
        for n in $names; do allowed="$allowed,$n,$n:*"; done
        export MLFLOW_SERVER_ALLOWED_HOSTS=$allowed
    fi
fi
cat <<EOF
MLflow UI:        http://$shown:$port
Store:            $dir/mlflow.db (artifacts in $dir/artifacts)
Point training at it with:
    export MLFLOW_TRACKING_URI=http://$shown:$port
EOF
exec "$py" -m mlflow server --backend-store-uri "sqlite:///$dir/mlflow.db" \
    --artifacts-destination "$dir/artifacts" --serve-artifacts \
    --host "$host" --port "$port" --workers "${MLFLOW_WORKERS:-2}"
