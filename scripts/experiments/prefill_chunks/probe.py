"""A whole batch's prefill of long prompts in one call against in chunks of at most
`prefill.BATCH_CHUNK` (512) positions (`prefill.batch_chunk`): time (interleaved) and
XLA's temporary buffers, SmolLM2-135M shapes, random weights, float32.

    python scripts/experiments/prefill_chunks/probe.py [rows] [prompt] [repeats]
"""

import pathlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from step_cost import smollm_config  # noqa: E402

from jax_specdec.bench import time_interleaved  # noqa: E402
from jax_specdec.decode import prefill  # noqa: E402
from jax_specdec.nn import Transformer, init_cache  # noqa: E402


def main():
    rows, width, repeats = (
        int(a) for a in (sys.argv[1:] + ["2", "1536", "3"][len(sys.argv) - 1 :])
    )
    model = Transformer(smollm_config(), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, 49152, (rows, width)), jnp.int32)
    lengths = jnp.full((rows,), width, jnp.int32)
    cache = init_cache(model.config, batch=rows, max_len=width + 64)

    fns, temps, lasts = {}, {}, {}
    for name, chunk in (("one call", 1 << 30), ("chunks", 512)):

        def run(state, prompts, cache):  # a function of its own: traced afresh
            model = nnx.merge(graphdef, state)
            return prefill.prefill_batch(model, prompts, lengths, cache)[:2]

        with mock.patch.object(prefill, "BATCH_CHUNK", chunk):
            compiled = jax.jit(run).lower(state, prompts, cache).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        fns[name] = lambda c=compiled: c(state, prompts, cache)
        lasts[name] = np.asarray(fns[name]()[0])
    timings = time_interleaved(list(fns.values()), repeats)
    diff = np.abs(lasts["one call"] - lasts["chunks"]).max()
    print(f"{jax.devices()[0].device_kind}; {rows} rows x {width} tokens; {repeats} passes")
    print("| prefill | s (median) | temporaries MiB |")
    print("|---|---|---|")
    for name, t in zip(fns, timings, strict=True):
        label = f"chunks of {prefill.batch_chunk(width)}" if name == "chunks" else name
        print(f"| {label} | {t.median:.2f} | {temps[name] / 2**20:.0f} |")
    print(f"last logits max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
