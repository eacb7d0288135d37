"""Prompts into caches: the whole batch's prompts at the start of a call, a slot's
prompt when a row is refilled.

A prefill's attention scores grow with the square of the prompt ([rows, heads, prompt,
prompt] float32 in one layer): for 8 rows of 4,096 tokens and 32 heads, 16 GiB. So a
whole batch's prompts longer than `BATCH_CHUNK` positions run in calls of at most
`BATCH_CHUNK` (scores [rows, heads, chunk, cache]; `batch_chunk`), the drafter's too, and a
slot's prompt in calls of `PREFILL_CHUNK` into a cache of its own (a short prompt costs
its own chunks, not the longest prompt's). Prompts up to `BATCH_CHUNK` run in one call.
Only the positions up to the longest prompt run; the LM head runs on each row's last
prompt token only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_specdec.nn import KVCache, init_cache
from jax_specdec.nn.transformer import feature_size

__all__ = [
    "BATCH_CHUNK",
    "PREFILL_CHUNK",
    "batch_chunk",
    "in_chunks",
    "padded",
    "prefill_batch",
    "prefill_row",
]

BATCH_CHUNK = 512  # prompt positions per call of a whole batch's prefill, past which it chunks
PREFILL_CHUNK = 32  # tokens per call of a slot's prefill (`prefill_row`)


def batch_chunk(width: int) -> int:
    """Positions per call of a whole batch's prefill of prompts `width` wide: all of them
    up to `BATCH_CHUNK`, else the widest even split into calls of at most `BATCH_CHUNK`
    (768 positions: two calls of 384, not 512 + 512 with half the second padding)."""
    calls = -(-width // BATCH_CHUNK)
    return -(-width // calls)


def in_chunks(call, carry, inputs, lengths: jax.Array, chunk: int):
    """carry = call(carry, start, pieces) for start = 0, chunk, 2·chunk, … while start is
    below the longest of `lengths` [B]; `pieces` are `inputs`' (a pytree of [B, W, …]
    arrays, W a multiple of `chunk`) positions start … start + chunk - 1. A
    `lax.while_loop`: the chunks past the longest prompt do not run."""
    end = jnp.max(lengths)

    def body(state):
        start, carry = state
        pieces = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk, 1), inputs)
        return start + chunk, call(carry, start, pieces)

    return jax.lax.while_loop(lambda s: s[0] < end, body, (jnp.int32(0), carry))[1]


def padded(array: jax.Array, chunk: int) -> jax.Array:
    """[B, W, …] zero-padded along W to a multiple of `chunk`."""
    width = array.shape[1]
    pad = [(0, 0)] * array.ndim
    pad[1] = (0, -(-width // chunk) * chunk - width)
    return jnp.pad(array, pad)


def _chunked_decode(model, tokens, lengths, cache: KVCache, chunk: int, features, logits):
    """`model.decode` of tokens [B, W] (W a multiple of `chunk`) into the empty `cache`,
    chunk by chunk up to the longest row: (the logits [B, V] at lengths - 1, or None
    without `logits`; the cache; the features [B, W, F] of the positions run, or None)."""
    c, (batch, width) = model.config, tokens.shape
    last = jnp.zeros((batch, c.vocab_size), jnp.float32) if logits else None
    feats = None
    if features:
        feats = jnp.zeros((batch, width, feature_size(c, features)), c.jnp_dtype)

    def call(carry, start, piece):
        cache, last, feats = carry
        at = lengths - 1 - start  # where each row's last prompt position falls in the chunk
        inside = jnp.clip(at, 0, chunk - 1) if logits else None
        here, cache, *hidden = model.decode(piece, cache, features=features, logits_at=inside)
        if logits:
            last = jnp.where(((at >= 0) & (at < chunk))[:, None], here[:, 0], last)
        if features:
            feats = jax.lax.dynamic_update_slice_in_dim(feats, hidden[0], start, axis=1)
        return cache, last, feats

    cache, last, feats = in_chunks(call, (cache, last, feats), tokens, lengths, chunk)
    return last, cache, feats


def prefill_batch(model, prompts, prompt_lengths, cache: KVCache, *, features=False, logits=True):
    """The prompts [B, P] run through the transformer `model` into the empty `cache`: in
    one call up to `BATCH_CHUNK` positions, else in calls of `batch_chunk(P)`.

    Returns the logits [B, V] at each row's last prompt position (None without
    `logits`), the cache with lengths `prompt_lengths`, and with `features` (as
    `Transformer.decode`'s) the features [B, P, F] (else None).
    """
    width = prompts.shape[1]
    chunk = batch_chunk(width)
    if chunk == width:
        at = prompt_lengths - 1 if logits else None  # the LM head on the last token only
        out, cache, *hidden = model.decode(prompts, cache, features=features, logits_at=at)
        last, feats = (out[:, 0] if logits else None), (hidden[0] if features else None)
    else:
        tokens = padded(prompts, chunk)
        last, cache, feats = _chunked_decode(
            model, tokens, prompt_lengths, cache, chunk, features, logits
        )
        feats = None if feats is None else feats[:, :width]
    return last, cache.replace(lengths=prompt_lengths), feats


def prefill_row(model, prompt: jax.Array, length: jax.Array, *, features=False, logits=True):
    """The first `length` ([] int32) tokens of one prompt [1, P] run through `model` in
    chunks of `PREFILL_CHUNK` into a fresh cache (for `state.load_row`).

    Returns the logits [1, V] at position length - 1 (None without `logits`), the cache
    (P rounded up to the chunk), and with `features` (as `Transformer.decode`'s) the
    features [1, P', D'] of the positions run.
    """
    c, width = model.config, prompt.shape[1]
    chunk = min(PREFILL_CHUNK, width)
    if -(-width // chunk) * chunk > c.max_len:  # no room to round up: one chunk
        chunk = width
    tokens = padded(prompt, chunk)
    cache = init_cache(c, batch=1, max_len=tokens.shape[1])
    return _chunked_decode(model, tokens, length[None], cache, chunk, features, logits)
