#!/usr/bin/env bash
# The recipe that built models/: tokenizer + target, draft, distilled draft.
# Each step resumes from its checkpoints if interrupted. About 100 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-build}
TARGET_STEPS=${TARGET_STEPS:-2000}
DRAFT_STEPS=${DRAFT_STEPS:-1500}
DISTILL_STEPS=${DISTILL_STEPS:-500}

jax-specdec train --preset target --out "$work/target" --steps "$TARGET_STEPS" \
  --batch-size 16 --seq-len 256 --learning-rate 3e-3
jax-specdec train --preset draft --out "$work/draft" --steps "$DRAFT_STEPS" \
  --batch-size 16 --seq-len 256 --learning-rate 5e-3 --tokenizer "$work/target/tokenizer.json"
jax-specdec distill --target "$work/target" --draft "$work/draft" --out "$work/draft-distilled" \
  --steps "$DISTILL_STEPS" --batch-size 16 --seq-len 256 --learning-rate 1e-3 --divergence tvd

mkdir -p models
rm -rf models/stdlib-target models/stdlib-draft
for pair in "target:stdlib-target" "draft-distilled:stdlib-draft"; do
  src=${pair%%:*}; dst=${pair##*:}
  mkdir -p "models/$dst"
  cp "$work/$src"/{config.json,model.safetensors,tokenizer.json,training.json} "models/$dst/"
done
cp "$work/target/corpus_files.txt" models/stdlib-target/
cp "$work/draft/training.json" models/stdlib-draft/pretraining.json
python scripts/model_cards.py
