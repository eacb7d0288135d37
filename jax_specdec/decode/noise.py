"""A round's randomness, and how a token is picked from it.

Row b's round r draws from fold_in(keys[b], r) only, split into draft keys and the
acceptance noise, always at the widest γ of the program, so a row's noise does not
depend on how wide its batch's round is.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_specdec.sampling import RowSampling, sample, sample_with_uniforms

__all__ = ["Noise", "choose", "draw", "round_keys", "round_noise"]


class Noise(NamedTuple):
    """One round's randomness for each row.

    Under greedy decoding (temperature 0) nothing is drawn: p and q are one-hot, so
    zero uniforms accept exactly the drafts equal to the target's argmax, and a zero
    draw picks the first token with mass of the one-hot residual or bonus, its argmax.
    The same shapes, all zeros, keep one code path. In a program mixing greedy and
    sampled rows every row gets noise; a greedy row's one-hot p and q make its tests and
    draws come out the same for any noise.
    """

    draft_keys: jax.Array  # [B, γ_max] one key per draft step (int32 zeros if greedy)
    uniforms: jax.Array  # [B, γ_max] float32 acceptance tests
    draws: jax.Array  # [B] float32 the correction / bonus draw (inverse CDF)


def round_keys(keys: jax.Array, round_index) -> jax.Array:
    """[B] keys of round `round_index` ([] or one per row [B]): fold_in(keys[b], r[b])."""
    rounds = jnp.broadcast_to(jnp.asarray(round_index, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, rounds)


def round_noise(keys, round_index, gamma_max: int, sampling: RowSampling) -> Noise:
    """The noise of round `round_index` ([] or [B]) for rows with `keys` [B]."""
    batch = keys.shape[0]
    if sampling.greedy:
        return Noise(
            jnp.zeros((batch, gamma_max), jnp.int32),
            jnp.zeros((batch, gamma_max), jnp.float32),
            jnp.zeros((batch,), jnp.float32),
        )
    split = jax.vmap(jax.random.split)(round_keys(keys, round_index))  # [B, 2]: draft, accept

    def accept_noise(key):  # as `acceptance.accept` draws it
        accept_key, residual_key = jax.random.split(key)
        return (
            jax.random.uniform(accept_key, (gamma_max,), jnp.float32),
            jax.random.uniform(residual_key, (), jnp.float32),
        )

    uniforms, draws = jax.vmap(accept_noise)(split[:, 1])
    draft_keys = jax.vmap(lambda k: jax.random.split(k, gamma_max))(split[:, 0])
    return Noise(draft_keys, uniforms, draws)


def choose(keys, logits, probs, sampling: RowSampling) -> jax.Array:
    """A token per row [B]: the argmax when every row is greedy (keys unused), else a draw
    from probs [B, V] with keys [B] (a greedy row's probs are one-hot on its argmax, and
    the draw never takes a token of zero probability)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample(keys, probs)


def draw(draws, logits, probs, sampling: RowSampling) -> jax.Array:
    """The token of a width-0 round from its draws [B]: the argmax when every row is
    greedy, else inverse CDF on probs (what the acceptance step does with no drafts)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_with_uniforms(draws, probs)
