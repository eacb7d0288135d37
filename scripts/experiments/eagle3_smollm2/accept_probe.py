"""Teacher-forced first draft on the EAGLE-3 build's held-out windows (their generated
part): argmax agreement and expected acceptance at T = 1, sum_v min(p(v), q(v)), p the
target's full-vocabulary distribution, q the head's over its kept tokens; both heads."""

import os

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
    "~/.cache/jax_specdec/eagle3/valid-self-p64-T0.7-c0.5-t192-n786432-aux2.15.27"))
target = load_pair("smollm2-135m", "ngram")[0]
rows = output_rows(target)
embed = target.embed[...]
heads = {"eagle3": load_head(os.path.expanduser("~/.cache/jax_specdec/eagle3/head")),
         "feature": load_head("models/smollm2-135m-eagle")}
kept_mass = []
for name, head in heads.items():
    agree = acc = acc_kept = n = 0.0
    for i in range(len(valid) // 8):
        tokens, features, greedy, inputs, counted = batch(valid, np.arange(i * 8, i * 8 + 8))
        if name == "feature":
            inputs = features
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
        if name == "eagle3":
            kept_mass.append((np.asarray(pk.sum(-1)) * mask).sum())
    print(name, "agreement", round(agree / n, 4), "E[min(p,q)] T=1", round(acc / n, 4),
          "vs p renormalised on kept", round(acc_kept / n, 4), flush=True)
print("target mass on eagle3's kept tokens", round(sum(kept_mass) / n, 4))
