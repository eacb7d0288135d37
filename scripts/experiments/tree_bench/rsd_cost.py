"""The cost of `accept_rsd` alone: compile time and run time (median of 5) of one round's
recursive rejection over sampled trees of 8–64 nodes, batch 1, SmolLM2's vocabulary,
random target logits and draft q. `python scripts/experiments/tree_bench/rsd_cost.py [V]`
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.decode.tree import TreeProposal
from jax_specdec.decode.tree_accept import accept_rsd, static_shape
from jax_specdec.sampling import RowSampling, SamplingConfig

V = int(sys.argv[1]) if len(sys.argv) > 1 else 49152
for nodes, depth, branch in [(8, 8, 3), (16, 6, 3), (32, 8, 4), (64, 8, 4)]:
    parent = jnp.asarray(static_shape(nodes, depth, branch), jnp.int32)[None]
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (1, nodes), 0, V)
    q = jax.nn.softmax(jax.random.normal(key, (1, nodes + 1, V)), -1)
    logits = jax.random.normal(jax.random.key(1), (1, nodes + 1, V))
    draws = jax.random.uniform(jax.random.key(2), (1, nodes + 1, 2))
    proposal = TreeProposal(tokens, parent, jnp.ones((1, nodes), bool), jnp.zeros((1,), bool), q)
    sampling = RowSampling.of([SamplingConfig(temperature=1.0)])
    rule = jax.jit(lambda lg, d, p, s, depth=depth: accept_rsd(lg, d, p, s, depth))
    start = time.perf_counter()
    compiled = rule.lower(logits, draws, proposal, sampling).compile()
    compile_s = time.perf_counter() - start
    compiled(logits, draws, proposal, sampling).accepted.block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        compiled(logits, draws, proposal, sampling).accepted.block_until_ready()
        times.append(time.perf_counter() - start)
    run_ms = np.median(times) * 1e3
    print(f"{nodes}:{depth}:{branch}: compile {compile_s:.2f} s, run {run_ms:.2f} ms")
