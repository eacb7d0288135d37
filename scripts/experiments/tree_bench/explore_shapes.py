"""Tokens per round of chains and trees on SmolLM2 + the shipped head, batch 1, the first
six code prompts of scripts/drafter_bench.py, 64 new tokens (no timing): the probe that chose
the benchmarked shapes.

  python scripts/experiments/tree_bench/explore_shapes.py 0 chain:4 chain:8 8:6:2 8:4:4
  python scripts/experiments/tree_bench/explore_shapes.py 1 8:8:3 8:6:2:walk
"""

import sys

import jax

sys.path.insert(0, "scripts")
from drafter_bench import CODE_PROMPTS  # noqa: E402

from jax_specdec import Generator, SamplingConfig  # noqa: E402
from jax_specdec.decode.tree import Tree  # noqa: E402
from jax_specdec.io.draft import load_pair  # noqa: E402

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
prompts = [loaded.tokenizer.encode(t).ids for t in CODE_PROMPTS[:6]]
sampling = SamplingConfig(float(sys.argv[1]))
for spec in sys.argv[2:]:
    if spec.startswith("chain:"):
        rounds = dict(schedule=int(spec[6:]))
    else:
        n, d, k, *walk = spec.split(":")
        tree = Tree(int(n), int(d), int(k), sampled=False if walk else None)
        rounds = dict(schedule=tree.depth, tree=tree)
    gen = Generator(loaded.target, loaded.draft, sampling=sampling, **rounds)
    made = rounds_run = 0
    for i, p in enumerate(prompts):
        out = gen([p], key=jax.random.key(i), max_new_tokens=64)
        made += int(out.lengths[0]) - 1
        rounds_run += int(out.stats.rounds[0])
    print(f"T={sampling.temperature} {spec} tokens_per_round={made / rounds_run:.3f}", flush=True)
