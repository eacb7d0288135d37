"""Probe (not part of the package): a float16 head draft step cut at its parts (the layer
alone, + its logits, + the scatter into the vocabulary, + the sampling transforms; and q
as the softmax over the kept tokens scattered), from cache (hot) and after reading 200 MB
(cold), medians of 20. From the repository root:

  python scripts/experiments/head_float16/head_step_parts_probe.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec.io.heads import load_head
from jax_specdec.nn import init_cache
from jax_specdec.sampling import SamplingConfig, probs_from_logits

head = load_head("models/smollm2-135m-eagle")
hc = init_cache(head.config.layer, batch=1, max_len=256).replace(
    lengths=jnp.array([128], jnp.int32)
)
g, s = nnx.split(head)
embed = jnp.asarray(np.random.default_rng(0).standard_normal((49152, 576)), jnp.float32)
big = [jnp.ones((200_000_000 // 4,), jnp.float32) * i for i in range(1)]
flush = jax.jit(lambda a: a.sum())


def layer_only(s, f, t, c, e):
    h = nnx.merge(g, s)
    p, _, _ = h.decode_entries(f, t, e, c, c.lengths)
    return p


def logits(s, f, t, c, e):
    h = nnx.merge(g, s)
    p, _, _ = h.decode_entries(f, t, e, c, c.lengths)
    return h.logits(p[:, -1:])[:, 0]


def scatter(s, f, t, c, e):
    h = nnx.merge(g, s)
    p, _, _ = h.decode_entries(f, t, e, c, c.lengths)
    l = h.logits(p[:, -1:])[:, 0]
    return jnp.full((1, 49152), -jnp.inf).at[:, h.vocab_map[...]].set(l)


def probs(s, f, t, c, e):
    return probs_from_logits(scatter(s, f, t, c, e), SamplingConfig(1.0))


def probs_kept(s, f, t, c, e):
    h = nnx.merge(g, s)
    p, _, _ = h.decode_entries(f, t, e, c, c.lengths)
    l = h.logits(p[:, -1:])[:, 0]
    q = jax.nn.softmax(l)
    return jnp.zeros((1, 49152)).at[:, h.vocab_map[...]].set(q)


args = (s, jnp.zeros((1, 1, 576)), jnp.zeros((1, 1), jnp.int32), hc, embed)
fns = {
    n: jax.jit(f)
    for n, f in dict(
        layer_only=layer_only, logits=logits, scatter=scatter, probs=probs, probs_kept=probs_kept
    ).items()
}
for f in fns.values():
    jax.block_until_ready(f(*args))
t = {n: {"hot": [], "cold": []} for n in fns}
for _r in range(20):
    for n, f in fns.items():
        for mode in ("hot", "cold"):
            if mode == "cold":
                flush(big[0]).block_until_ready()
            st = time.perf_counter()
            jax.block_until_ready(f(*args))
            t[n][mode].append(time.perf_counter() - st)
for n in fns:
    print(n, {m: round(np.median(v) * 1e3, 3) for m, v in t[n].items()})
