#!/usr/bin/env bash
# The oldest torch that pyproject.toml admits (`torch>=X`), installed the way the README installs,
# in a scratch venv, runs this project's own tests of training, resuming, resharding and exporting.
# It is what makes the floor a fact rather than a guess (issue 33: torch 2.5 crashed at the first log
# step on a call added in 2.6, while pyproject said 2.4).
#
#   bash bench/torch_floor.sh [pytest args]     (default: the tests listed in FLOOR_TESTS below)
#   FLOOR_VENV=DIR   where the scratch venv goes (default ${TMPDIR:-/tmp}/mlm-torch-floor-X, or named after
#                    the versions asked for below); kept between runs, set up again only when
#                    pyproject.toml or setup_env.sh changes
#   TORCH_SPEC=...   how to get that torch (default torch==X, i.e. X.0: PyPI's build, CUDA libraries
#                    included, about 3 GB; it runs on the CPU too). On a GPU cluster pass your
#                    CUDA's index, e.g. "torch==2.7.0 --index-url https://download.pytorch.org/whl/cu126".
#   TORCH_VERSION=V  another release than the floor, e.g. the GPU lease's before a lease (docs/gpus.md:
#                    torch 2.11.0 with transformers 5.17.0 there), so that the code a lease will run
#                    has passed its tests on that torch first; TRANSFORMERS_VERSION=V pins transformers too
#   PYTHON=...       the venv's Python (default python3), e.g. the lease's python3.12
#
# Not in the test suite: the download alone is minutes. Its result goes into BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^ *"torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$floor" ] || { echo "torch_floor: no \"torch>=X\" line in pyproject.toml" >&2; exit 2; }
want=${TORCH_VERSION:-$floor}
tf=${TRANSFORMERS_VERSION:-}
# PYTHON (setup_env.sh's) picks the venv's Python: its own venv, since an existing one keeps its own
py=$([ -z "${PYTHON:-}" ] || "$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
name=$([ "$want" = "$floor" ] && echo "floor-$floor" || echo "$want")${tf:+-transformers-$tf}${py:+-python$py}
VENV=${FLOOR_VENV:-${TMPDIR:-/tmp}/mlm-torch-$name}
FLOOR_TESTS=(
  tests/pretrain/test_train.py          # 1 and 2 ranks, ZeRO 0-3, halt and exact resume, export, fill-mask
  tests/pretrain/test_checkpoint_conversion.py        # every checkpoint layout read back, bf16 masters exported
  tests/pretrain/test_resume_with_dropout.py  # dropout runs resumed on another layout
  tests/pretrain/test_bf16_accumulation.py  # bf16 ZeRO 1 with fp32 accumulation: resumed, exported
  tests/pretrain/test_model.py          # the encoder against Hugging Face's BERT, SDPA and eager attention
)
[ $# -gt 0 ] && FLOOR_TESTS=("$@")

echo "== torch_floor: pyproject.toml says torch>=$floor; torch $want${tf:+, transformers $tf}; scratch venv $VENV"
VENV=$VENV TORCH_SPEC=${TORCH_SPEC:-torch==$want} bash launchers/setup_env.sh
# After the project's install, which takes the newest transformers pyproject.toml admits.
[ -z "$tf" ] || "$VENV/bin/python" -m pip install -q --disable-pip-version-check "transformers==$tf"
read -r got_torch got_tf got_py < <("$VENV/bin/python" -c \
  "import sys, torch, transformers; print(torch.__version__, transformers.__version__, '%d.%d' % sys.version_info[:2])")
case "$got_torch" in
  "$want"|"$want".*|"$want"+*) ;;
  *) echo "torch_floor: FAILED: the venv has torch $got_torch, not $want" >&2; exit 1 ;;
esac
[ -z "$tf" ] || [ "$got_tf" = "$tf" ] || { echo "torch_floor: FAILED: the venv has transformers $got_tf, not $tf" >&2; exit 1; }
[ -z "$py" ] || [ "$got_py" = "$py" ] || { echo "torch_floor: FAILED: $VENV has Python $got_py, not $py" >&2; exit 1; }
got="Python $got_py, torch $got_torch, transformers $got_tf"
start=$(date +%s)
if "$VENV/bin/python" -m pytest -q -p no:cacheprovider -ra "${FLOOR_TESTS[@]}"; then
  echo "torch_floor: PASSED: $got ran ${FLOOR_TESTS[*]} in $(( $(date +%s) - start )) s"
else
  echo "torch_floor: FAILED: $got (above: which test, and why)"; exit 1
fi
