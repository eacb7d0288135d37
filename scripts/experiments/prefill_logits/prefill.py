"""A prefill's LM head on every prompt position against on each row's last one only
(`Transformer.decode(..., logits_at=...)`), random weights at SmolLM2-135M's shape and
at a small draft model's (2 layers, d 256, the same vocabulary of 49,152, its logits
unused: what a draft model's prefill and catch-up need is its cache). Medians of 5
calls after compiling; `temp` is XLA's temporary buffers of the compiled call.

    python scripts/experiments/prefill_logits/prefill.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec.nn import Transformer, TransformerConfig, init_cache

SHAPES = {
    "smollm2": dict(d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, mlp_dim=1536),
    "draft": dict(d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=512),
}


def programs(config):
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))

    def prefill(state, tokens, lengths, last_only):
        model = nnx.merge(graphdef, state)
        cache = init_cache(config, batch=tokens.shape[0], max_len=tokens.shape[1] + 8)
        at = lengths - 1 if last_only else None
        logits, cache = model.decode(tokens, cache, logits_at=at)
        if not last_only:
            logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)
        return logits[:, 0], cache

    every = jax.jit(lambda s, t, n: prefill(s, t, n, False))
    last = jax.jit(lambda s, t, n: prefill(s, t, n, True))
    return state, {"every position": every, "last only": last}


def main():
    for name, shape in SHAPES.items():
        config = TransformerConfig.llama(
            vocab_size=49152, head_dim=64, max_len=2048, tie_embeddings=True, **shape
        )
        state, fns = programs(config)
        for batch, width in ((1, 64), (1, 512), (8, 256)):
            rng = np.random.default_rng(0)
            tokens = jnp.asarray(rng.integers(0, 49152, (batch, width)), jnp.int32)
            lengths = jnp.full((batch,), width, jnp.int32)
            got = {}
            for label, fn in fns.items():
                got[label] = np.asarray(fn(state, tokens, lengths)[0])
                memory = fn.lower(state, tokens, lengths).compile().memory_analysis()
                temp = memory.temp_size_in_bytes / 2**20
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(state, tokens, lengths))
                    times.append(time.perf_counter() - start)
                print(
                    f"{name} batch {batch} prompt {width} {label}: "
                    f"{np.median(times) * 1e3:.1f} ms, temp {temp:.0f} MiB",
                    flush=True,
                )
            diff = np.max(np.abs(got["every position"] - got["last only"]))
            print(f"  max |difference| of the last logits: {diff:.2g}")


if __name__ == "__main__":
    main()
