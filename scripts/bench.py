"""Speculative vs autoregressive decoding, side by side in one run.

    python scripts/bench.py                      # the benchmark shapes: 37.8M target, 1.05M draft
    python scripts/bench.py --preset tiny        # seconds, for a smoke test
    python scripts/bench.py --target models/x --draft models/y   # any HF model directories

Writes <out>/bench.json and <out>/bench.md (default out: bench_out/bench, git-ignored; run
from the repository root). docs/performance.md reads the figures.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["design", "tiny"], default="design")
    parser.add_argument("--target", type=pathlib.Path, help="HF model directory of the target")
    parser.add_argument("--draft", type=pathlib.Path, help="HF model directory of the draft")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--gammas", default="1,2,4,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    out = pathlib.Path("bench_out/bench")
    parser.add_argument("--out", type=pathlib.Path, default=out)
    args = parser.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")

    from flax import nnx

    from jax_specdec.bench import markdown_report, run_benchmark
    from jax_specdec.nn import Transformer, TransformerConfig
    from jax_specdec.sampling import SamplingConfig

    try:
        sampling = SamplingConfig(temperature=args.temperature)
        batches = [int(x) for x in args.batches.split(",")]
        gammas = [int(x) for x in args.gammas.split(",")]
    except ValueError as e:
        parser.error(str(e))
    if args.target is not None:
        from jax_specdec.io.hf import load_model

        target, draft = load_model(args.target), load_model(args.draft)
    elif args.preset == "design":
        # Random at scale 0.02: near-uniform, similar distributions, so α is high.
        target = Transformer(TransformerConfig.bench_target(), rngs=nnx.Rngs(0), init_scale=0.02)
        draft = Transformer(TransformerConfig.bench_draft(), rngs=nnx.Rngs(1), init_scale=0.02)
    else:
        target = Transformer(TransformerConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
        draft = Transformer(TransformerConfig.tiny(vocab_size=64, num_layers=1), rngs=nnx.Rngs(1))
    results = run_benchmark(
        target,
        draft,
        batches=batches,
        gammas=gammas,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        repeats=args.repeats,
    )
    results["command"] = " ".join(["python", "scripts/bench.py", *(argv or sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown_report(results)
    (args.out / "bench.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
