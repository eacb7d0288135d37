"""The same generation programs compiled with and without XLA:CPU's YNNPACK fusions
(`xla_cpu_experimental_ynn_fusion_type=""`), timed interleaved in one process: γ 2, γ 4
and autoregressive decoding, 32-token random prompts, 64 new tokens.

    python scripts/experiments/ynn_off/ynn_off_probe.py BATCH [bench|smollm] [TEMPERATURE]

"bench": the benchmark pair of docs/performance.md; "smollm": SmolLM2-135M and the shipped head.
"""

import sys

import jax
import numpy as np
from flax import nnx

from jax_specdec.bench.timing import time_interleaved
from jax_specdec.decode import Generator
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.sampling import SamplingConfig

NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def pair(which: str):
    """(target, drafter, vocabulary size)."""
    if which == "bench":
        target = Transformer(TransformerConfig.bench_target(), rngs=nnx.Rngs(0), init_scale=0.02)
        draft = Transformer(TransformerConfig.bench_draft(), rngs=nnx.Rngs(1), init_scale=0.02)
        return target, draft, 4096
    from jax_specdec.io.draft import load_pair

    target, head = load_pair("smollm2-135m", "models/smollm2-135m-eagle")[:2]
    return target, head, target.config.vocab_size


def main():
    batch = int(sys.argv[1])
    target, draft, vocab = pair(sys.argv[2] if len(sys.argv) > 2 else "bench")
    sampling = SamplingConfig(float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)
    prompts = [list(np.random.default_rng(i).integers(0, vocab, 32)) for i in range(batch)]
    generators = {
        "γ2": Generator(target, draft, num_draft_tokens=2, sampling=sampling),
        "γ4": Generator(target, draft, num_draft_tokens=4, sampling=sampling),
        "AR": Generator(target, sampling=sampling),
    }
    calls, names = [], []
    for name, generator in generators.items():
        run = generator.bind(prompts, key=jax.random.key(0), max_new_tokens=64)
        lowered = run.lower()
        for tag, options in (("ynn", None), ("no ynn", NO_YNN)):
            compiled = lowered.compile(compiler_options=options)
            calls.append(lambda c=compiled, args=run.args: jax.block_until_ready(c(*args)))
            names.append(f"{name}, {tag}")
    for name, timing in zip(names, time_interleaved(calls, repeats=9), strict=True):
        print(f"{name}: {timing.median * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
