"""Teacher-forced first draft on the self-data build's held-out windows (their generated
part: greedy and T = 1 continuations of held-out chat requests and code openings): argmax
agreement and expected acceptance at T = 1, sum_v min(p(v), q(v)), p the target's
full-vocabulary distribution, q the head's over its kept tokens; the shipped head and the
head built on the target's own text (argument: its directory)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.io.draft import load_pair
from jax_specdec.io.heads import load_head
from jax_specdec.nn.feature_head import previous_features
from jax_specdec.training.head_data import load_features
from jax_specdec.training.head_train import output_rows


def batch(data, rows):
    """(tokens, features, greedy, head input, counted [B, T] bool) of `rows`: what the
    head's training reads (its own copy, as the training's helper is private)."""
    tokens, features, greedy = (jnp.asarray(a[rows]) for a in data[:3])
    inputs = features if data.aux is None else jnp.asarray(data.aux[rows])
    start = np.zeros(len(rows), np.int32) if data.start is None else data.start[rows]
    counted = np.arange(tokens.shape[1])[None] >= np.maximum(start - 1, 0)[:, None]
    return tokens, features, greedy, inputs, counted


valid = load_features(os.path.expanduser(
    "~/.cache/jax_specdec/head_self/valid-self-p64-T1.0-c0.5-t192-n491520"))
target = load_pair("smollm2-135m", "ngram")[0]
rows = output_rows(target)
embed = target.embed[...]
heads = {"shipped": load_head("models/smollm2-135m-eagle"), "self": load_head(sys.argv[1])}
for name, head in heads.items():
    agree = acc = acc_kept = n = 0.0
    for i in range(len(valid) // 8):
        tokens, features, greedy, inputs, counted = batch(valid, np.arange(i * 8, i * 8 + 8))
        prev = previous_features(inputs.astype(jnp.float32))
        logits, _ = next(iter(head.unrolled(prev, tokens, embed, 1)))
        vm = head.vocab_map[...]
        q = jax.nn.softmax(logits.astype(jnp.float32), -1)
        p = jax.nn.softmax(jnp.einsum("btd,vd->btv", features.astype(jnp.float32), rows), -1)
        pk = p[..., vm]
        mask = np.asarray(counted).copy()
        mask[:, 0] = False
        a = np.asarray(jnp.sum(jnp.minimum(pk, q), -1))
        ak = np.asarray(jnp.sum(jnp.minimum(pk / pk.sum(-1, keepdims=True), q), -1))
        g = np.asarray(vm[jnp.argmax(logits, -1)] == greedy)
        agree += (g * mask).sum()
        acc += (a * mask).sum()
        acc_kept += (ak * mask).sum()
        n += mask.sum()
    print(name, "agreement", round(agree / n, 4), "E[min(p,q)] T=1", round(acc / n, 4),
          "vs p renormalised on kept", round(acc_kept / n, 4), flush=True)
