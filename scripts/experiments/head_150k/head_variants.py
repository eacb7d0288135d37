"""Short training runs of feature-head variants on features already extracted by
`jax-specdec train-drafter` (or `jax_specdec.training.head_recipe.prepare_data`):
held-out agreement with the target's greedy token per draft step, and training time.
One JSON line per run.

  python scripts/experiments/head_150k/head_variants.py --target smollm2-135m --work-dir DIR \
      --data text-t128-n150000 --steps 300 --name ce --feature-weight 0
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from flax import nnx

from jax_specdec.io import zoo
from jax_specdec.io.hf import load_model
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.training.head_data import kept_vocabulary, load_features
from jax_specdec.training.head_train import HeadTrainConfig, agreement, init_from_target, train_head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--data", required=True, help="feature folder under --work-dir")
    p.add_argument("--valid", default="valid-t128")
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--feature-weight", type=float, default=0.1)
    p.add_argument("--unroll", type=int, default=1)
    p.add_argument("--kept", type=int, default=8192)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--windows", type=int, help="train on the first N windows only")
    p.add_argument("--out", default="variants.jsonl")
    args = p.parse_args()
    zoo.enable_compilation_cache(True)
    target = load_model(zoo.resolve(args.target))
    work = pathlib.Path(args.work_dir)
    train, valid = load_features(work / args.data), load_features(work / args.valid)
    train = type(train)(*(None if a is None else a[: args.windows] for a in train))
    config = FeatureHeadConfig.for_target(target.config, args.kept, num_layers=args.layers)
    head = FeatureHead(config, rngs=nnx.Rngs(0))
    init_from_target(head, target, kept_vocabulary(train, args.kept, target.config.vocab_size))
    train_config = HeadTrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        feature_weight=args.feature_weight,
        unroll=args.unroll,
        checkpoint_every=args.steps,
        eval_every=args.steps,
    )
    start = time.perf_counter()
    run_dir = work / "variants" / args.name
    log = train_head(head, target, train, valid, train_config, checkpoint_dir=run_dir)
    row = {
        "name": args.name,
        "data": args.data,
        "train_tokens": int(train.tokens.size),
        "steps": args.steps,
        "batch": [args.batch_size, int(train.tokens.shape[1])],
        "learning_rate": args.learning_rate,
        "feature_weight": args.feature_weight,
        "unroll": args.unroll,
        "kept": args.kept,
        "layers": args.layers,
        "train_seconds": round(log["seconds"], 1),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "agreement_per_step": agreement(head, valid, target.embed[...], steps=3),
    }
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
