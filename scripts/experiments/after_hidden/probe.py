"""Step cost of `Transformer.decode` with its cache writes keyed on the logits (before)
against keyed on the final hidden state (after), interleaved in one process, SmolLM2-135M
shapes, random weights. Also: a cache-only call (a draft model's prefill) in both.

    python scripts/experiments/after_hidden/probe.py
"""

import pathlib
import statistics
import sys
from contextlib import nullcontext
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from step_cost import captured, smollm_config  # noqa: E402

from jax_specdec.bench import decode_step_time, time_interleaved  # noqa: E402
from jax_specdec.nn import Transformer, init_cache, transformer, write_entries  # noqa: E402

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 7


def logits_keyed(self, tokens, cache, features=False, logits_at=None):
    """The code before: the cache writes wait on the logits."""
    lengths = cache.lengths.astype(jnp.int32)
    logits, keys, values, *hidden = self.decode_entries(
        tokens, cache, features=features, logits_at=logits_at
    )
    cache = write_entries(cache, keys, values, transformer.ordered_after(lengths, logits))
    return (logits, cache.replace(lengths=lengths + tokens.shape[1]), *hidden)


def cache_only(model, batch, prompt):
    tokens = jnp.ones((batch, prompt), jnp.int32)
    cache = init_cache(model.config, batch=batch, max_len=prompt + 16)
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c)[1])
    return lambda: fn(state, tokens, cache)


def main():
    model = Transformer(smollm_config(), rngs=nnx.Rngs(0))
    cases = [(1, 1), (1, 5), (8, 1), (8, 5)]
    fns = {}
    for variant in ("before", "after"):
        before = variant == "before"
        with mock.patch.object(Transformer, "_decode", logits_keyed) if before else nullcontext():
            for b, t in cases:
                fn = captured(
                    decode_step_time, model, batch=b, tokens_per_call=t, context=64,
                    cache_len=96, steps=8,
                )  # fmt: skip
                jax.block_until_ready(fn())
                fns[(variant, "step", b, t)] = fn
            fn = cache_only(model, 4, 128)
            jax.block_until_ready(fn())
            fns[(variant, "cache-only prefill", 4, 128)] = fn
    timings = time_interleaved(list(fns.values()), repeats=REPEATS)
    print(f"{jax.devices()[0].device_kind}; medians of {REPEATS} interleaved passes")
    print("| variant | call | batch | tokens | ms | after / before |")
    print("|---|---|---|---|---|---|")
    per = dict(zip(fns, timings, strict=True))
    for key, timing in per.items():
        steps = 8 if key[1] == "step" else 1
        ratio = ""
        if key[0] == "after":
            before = per[("before", *key[1:])]
            pairs = zip(timing.runs, before.runs, strict=True)
            ratio = f"{statistics.median(a / b for a, b in pairs):.3f}"
        ms = 1e3 * timing.median / steps
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {ms:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
