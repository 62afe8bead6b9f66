#!/usr/bin/env bash
# The README's main command: set up, prepare data, train configs/tiny.yaml, report perplexity.
#
#   bash launch/quickstart.sh [key=value ...]        # extra args override configs/tiny.yaml
#
# Data: MEGAFLEX_WT103=1 (and a network) -> WikiText-103 through `datasets`; otherwise the local
# corpus under $MEGAFLEX_DATA (default ../shared/data): english-docs JSONL if present, else
# WikiText-2 raw. Tokenizer (sentencepiece BPE, 8000) and .bin/.idx go to work_data/quickstart/
# (reused when present; delete the folder to rebuild). NPROC=2 trains on 2 gloo ranks via the
# deepspeed launcher. Re-running resumes from the newest checkpoint (runs/tiny/checkpoints).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/launch/setup_env.sh"
cd "$repo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
data="${MEGAFLEX_DATA:-$repo/../shared/data}"
out="work_data/quickstart"
mkdir -p "$out"

if [ "${MEGAFLEX_WT103:-0}" = "1" ]; then
  train_in="hf:wikitext:wikitext-103-raw-v1:train"; valid_in="hf:wikitext:wikitext-103-raw-v1:validation"
elif [ -f "$data/english-docs/train-00.jsonl" ]; then
  train_in="$data/english-docs/train-00.jsonl"; valid_in="$data/english-docs/valid.jsonl"
elif [ -f "$data/wikitext-2-raw/wiki.valid.raw" ]; then
  # Offline fallback: WikiText-2 has no local train split here; train on test, validate on valid.
  train_in="$data/wikitext-2-raw/wiki.test.raw"; valid_in="$data/wikitext-2-raw/wiki.valid.raw"
else
  echo "quickstart: no data: set MEGAFLEX_WT103=1 (online) or MEGAFLEX_DATA to a folder with english-docs/ or wikitext-2-raw/" >&2
  exit 1
fi
echo "[quickstart] data: train=$train_in valid=$valid_in"

if [ ! -f "$out/tokenizer.model" ]; then
  echo "[quickstart] training the tokenizer (sentencepiece BPE, vocab 8000)"
  python -m data_prep.train_tokenizer --input "$train_in" --vocab-size 8000 \
    --output-prefix "$out/tokenizer" --max-sentences 200000
fi
for split in train valid; do
  if [ ! -f "$out/$split.idx" ]; then
    input="$train_in"; [ "$split" = valid ] && input="$valid_in"
    echo "[quickstart] tokenizing $split"
    python -m data_prep.preprocess --input "$input" --tokenizer "$out/tokenizer.model" \
      --output-prefix "$out/$split" --num-proc "${NUM_PROC:-2}" --no-progress
  fi
done

echo "[quickstart] training configs/tiny.yaml"
nproc="${NPROC:-1}"
if [ "$nproc" -gt 1 ]; then
  NPROC="$nproc" bash launch/train.sh --config configs/tiny.yaml "$@"
else
  python -m megaflex.train --config configs/tiny.yaml "$@"
fi

run_dir="$(python - "$@" <<'PY'
import sys
from megaflex.training.config import load_config
print(load_config(["configs/tiny.yaml"], sys.argv[1:]).logging.run_dir)
PY
)"
echo "[quickstart] evaluating perplexity (megaflex-eval, 256-token windows as in training, held-out split)"
megaflex-eval --checkpoint "$run_dir" --data "$out/valid" --mode windows --context 256 \
  --max-tokens "${EVAL_TOKENS:-200000}" --json "$run_dir/eval_valid.json"
python - "$run_dir" <<'PY'
import json, math, sys
from megaflex.training.metrics import read_metrics
run = sys.argv[1]
valid = read_metrics(f"{run}/metrics.jsonl", kind="valid")
train = read_metrics(f"{run}/metrics.jsonl")
last = max(valid)
print(f"[quickstart] step {last}: validation loss {valid[last]['loss']:.4f}, perplexity {valid[last]['ppl']:.2f} "
      f"(first logged training loss {train[min(train)]['loss']:.4f}, ppl {math.exp(train[min(train)]['loss']):.1f})")
ev = json.load(open(f"{run}/eval_valid.json"))
print(f"[quickstart] megaflex-eval (windows of 256): ppl {ev['ppl']:.2f}, "
      f"bits/byte {ev['bits_per_byte']:.4f} over {ev['tokens']} tokens -> {run}/eval_valid.json")
print(f"[quickstart] metrics:     {run}/metrics.jsonl")
print(f"[quickstart] TensorBoard: tensorboard --logdir {run}/tensorboard")
print(f"[quickstart] checkpoints: {run}/checkpoints (resume: re-run; megaflex-train --config configs/tiny.yaml --resume auto)")
PY
