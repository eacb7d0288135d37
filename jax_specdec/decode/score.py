"""Scoring: the log-likelihood of given continuations under the target, one forward pass.

`score(model, contexts, continuations)` runs each context + continuation through the
model once (rows right-padded into one batch; causal attention keeps a row's positions
blind to its padding) and returns, per row, the log-probability of each continuation
token under the model's raw distribution (log-softmax of its float32 logits, no
sampling transforms), their sum, and whether every continuation token is the argmax
(what evaluation harnesses call "is greedy"). This is what loglikelihood tasks ask of a
model; it needs no drafter: the continuation is given, not generated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["Scores", "score"]


class Scores(NamedTuple):
    """Per row: `logprobs` (a float array of each continuation token's log-probability),
    `total` (their sum) and `greedy` (every continuation token was the argmax)."""

    logprobs: list[np.ndarray]
    total: np.ndarray
    greedy: np.ndarray


def score(model, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]):
    """The log-likelihood of each continuation after its context (token ids).

    Args:
      model: the target `Transformer`.
      contexts: B token-id sequences, each at least one token.
      continuations: B token-id sequences, each at least one token.

    Returns:
      `Scores`.

    Raises:
      ValueError: B differs, an empty context or continuation, ids outside the
        vocabulary, or a row longer than the model's context (`max_len`), naming the row.
    """
    contexts, continuations = list(contexts), list(continuations)
    if len(contexts) != len(continuations):
        raise ValueError(
            f"score needs one continuation per context, got {len(contexts)} contexts and "
            f"{len(continuations)} continuations"
        )
    c = model.config
    rows = []
    for b, (ctx, cont) in enumerate(zip(contexts, continuations, strict=True)):
        ctx, cont = np.asarray(ctx, np.int64).ravel(), np.asarray(cont, np.int64).ravel()
        if ctx.size == 0 or cont.size == 0:
            raise ValueError(f"row {b}: the context and the continuation need a token each")
        both = np.concatenate([ctx, cont])
        if both.min() < 0 or both.max() >= c.vocab_size:
            raise ValueError(f"row {b}: token ids must lie in [0, {c.vocab_size})")
        if both.size > c.max_len:
            raise ValueError(
                f"row {b}: {both.size} tokens exceed the model's context of {c.max_len}"
            )
        rows.append((both, ctx.size, cont.size))
    width = _bucket(max(r[0].size for r in rows), c.max_len)
    tokens = np.zeros((len(rows), width), np.int32)
    start = np.zeros((len(rows),), np.int32)
    count = np.zeros((len(rows),), np.int32)
    for b, (both, n_ctx, n_cont) in enumerate(rows):
        tokens[b, : both.size] = both
        start[b], count[b] = n_ctx, n_cont
    graphdef, state = nnx.split(model)
    logprobs, greedy = _score(graphdef, state, tokens, start, count)
    logprobs, greedy = np.asarray(logprobs), np.asarray(greedy)
    per_row = [logprobs[b, : count[b]] for b in range(len(rows))]
    totals = np.array([float(np.sum(p, dtype=np.float64)) for p in per_row])
    return Scores(per_row, totals, greedy)


def _bucket(width: int, max_len: int) -> int:
    """Rows padded to a power of two (at least 16, at most the context): few programs."""
    return min(max(16, 1 << (width - 1).bit_length()), max_len)


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, tokens, start, count):
    """Per row, the log-probabilities [B, W] of tokens[start : start + count] (the
    position before each predicts it), and whether each was the argmax there."""
    model = nnx.merge(graphdef, state)
    logits = model(tokens).astype(jnp.float32)  # [B, W, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    width = tokens.shape[1]
    at = jnp.arange(width)[None] + start[:, None]  # the continuation's positions
    target = jnp.take_along_axis(tokens, jnp.minimum(at, width - 1), axis=1)
    before = jnp.maximum(at - 1, 0)
    per_token = jnp.take_along_axis(logp, before[..., None], axis=1)  # [B, W, V]
    chosen = jnp.take_along_axis(per_token, target[..., None], axis=-1)[..., 0]
    top = jnp.argmax(per_token, axis=-1)
    valid = jnp.arange(width)[None] < count[:, None]
    greedy = jnp.all((top == target) | ~valid, axis=1)
    return jnp.where(valid, chosen, 0.0), greedy
