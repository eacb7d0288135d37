"""Cost of one feature-head draft step (its layer, its kept-token logits, the scatter into
the full vocabulary and the sampling transforms) against one target decode step, and of
a 5-position verify and head chunk call, at batch 1, interleaved, medians of 15. The head
runs with its weights as stored (`head_*`) and widened to float32 (`head32_*`).

  python scripts/head_step_cost.py --head <head dir>
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec.io import zoo
from jax_specdec.io.heads import load_head
from jax_specdec.io.hf import load_model
from jax_specdec.nn import init_cache
from jax_specdec.sampling import SamplingConfig, probs_from_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", required=True)
    p.add_argument("--context", type=int, default=128)
    args = p.parse_args()
    target, head = load_model(zoo.resolve(args.target)), load_head(args.head)
    wide = load_head(args.head, param_dtype="float32")
    size, length = 2 * args.context, jnp.array([args.context], jnp.int32)
    tc = init_cache(target.config, batch=1, max_len=size).replace(lengths=length)
    hc = init_cache(head.config.layer, batch=1, max_len=size).replace(lengths=length)
    (tg, ts), (hg, hs), (wg, ws) = nnx.split(target), nnx.split(head), nnx.split(wide)
    vocab, dim = target.config.vocab_size, target.config.d_model

    @jax.jit
    def target_call(ts, tokens, cache):
        return nnx.merge(tg, ts).decode_entries(tokens, cache)[0]

    def head_call(graphdef):
        @jax.jit
        def call(hs, features, tokens, cache, embed):
            h = nnx.merge(graphdef, hs)
            predicted, _, _ = h.decode_entries(features, tokens, embed, cache, cache.lengths)
            logits = h.logits(predicted[:, -1:])[:, 0]  # the loop drafts from one entry
            full = jnp.full((1, vocab), -jnp.inf).at[:, h.vocab_map[...]].set(logits)
            return probs_from_logits(full, SamplingConfig(1.0)), predicted

        return call

    embed = target.embed[...]
    heads = {"head": (head_call(hg), hs), "head32": (head_call(wg), ws)}
    calls = {}
    for n in (1, 5):
        tokens, features = jnp.zeros((1, n), jnp.int32), jnp.zeros((1, n, dim))
        calls[f"target_{n}"] = lambda t=tokens: target_call(ts, t, tc)
        for name, (c, s) in heads.items():
            calls[f"{name}_{n}"] = lambda t=tokens, f=features, c=c, s=s: c(s, f, t, hc, embed)
    for call in calls.values():
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(15):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    ms = {name: round(float(np.median(t)) * 1e3, 2) for name, t in times.items()}
    ratios = {
        f"{h}_step_over_target_step": round(ms[f"{h}_1"] / ms["target_1"], 3)
        for h in ("head", "head32")
    }
    print({**ms, **ratios})


if __name__ == "__main__":
    main()
