#!/usr/bin/env bash
# The feature head's baseline: a standalone draft for SmolLM2-135M built with the project's own
# pipeline in the CPU time the first feature head (1M tokens) took (about 93 minutes on 2 cores:
# 2,134 s of feature extraction + 3,453 s of training). The draft is the `draft` preset
# (2 layers, d 128) on SmolLM2's tokenizer: trained on the standard-library corpus with
# cross-entropy, then distilled towards SmolLM2 (DistillSpec, TVD). Every step resumes
# from its checkpoints if interrupted; rerun the script to continue. Measured with
# `scripts/drafter_bench.py --draft` (scripts/experiments/README.md, draft_baseline).
set -euo pipefail
cd "$(dirname "$0")/../../.."
work=${WORK:-$HOME/.cache/jax_specdec/baseline}
TRAIN_STEPS=${TRAIN_STEPS:-800}      # 2,924 s here: 16 x 256 tokens a step
DISTILL_STEPS=${DISTILL_STEPS:-380}  # 3,551 s here: 8 x 256 tokens a step
mkdir -p "$work"

python - "$work/tokenizer.json" <<'PY'
import sys
from jax_specdec.io import zoo
from jax_specdec.io.hf import load_tokenizer
load_tokenizer(zoo.resolve("smollm2-135m")).save(sys.argv[1])
PY
jax-specdec train --preset draft --tokenizer "$work/tokenizer.json" --out "$work/draft" \
  --steps "$TRAIN_STEPS" --warmup-steps 50 --batch-size 16 --seq-len 256 \
  --learning-rate 5e-3 --eval-every 200 --checkpoint-every 100
jax-specdec distill --target smollm2-135m --draft "$work/draft" --out "$work/draft-distilled" \
  --steps "$DISTILL_STEPS" --warmup-steps 20 --batch-size 8 --seq-len 256 \
  --learning-rate 1e-3 --divergence tvd --eval-every 190 --checkpoint-every 50
