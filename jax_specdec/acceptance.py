"""The pure acceptance step of one speculative round (Leviathan et al. 2023, Algorithm 1).

For each row: drafted tokens x_1..x_γ came from q_1..q_γ; the target gave p_1..p_{γ+1}
for the same prefixes after the same sampling transforms. The row accepts the
leading run of x_i with u_i < p_i(x_i) / q_i(x_i), u_i ~ U[0, 1). At the first
rejection i it emits a correction drawn from norm(max(0, p_i - q_i)); if all γ
pass it emits a bonus token from p_{γ+1}. The emitted tokens are then distributed
exactly as p (see `exact.py` for the closed form).

The comparison is strict (`u * q < p`): it accepts with probability exactly
min(1, p/q) for u in [0, 1), and never accepts a token with p(x) = 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_specdec.sampling import sample_with_uniforms

__all__ = [
    "AcceptResult",
    "accept",
    "accept_block_with_noise",
    "accept_with_noise",
    "RESIDUAL_FLOOR",
]

# A residual max(0, p - q) with less mass than this is numerical noise (p == q up to
# rounding); the correction then falls back to p. Rejection happens with probability
# equal to the residual mass, so the distribution error this allows is below the floor.
RESIDUAL_FLOOR = 1e-6


class AcceptResult(NamedTuple):
    """Result of one round for each row.

    Attributes:
      num_accepted: [B] int32 in [0, γ]; the leading drafted tokens that were kept.
      next_token: [B] int32; the correction (num_accepted < γ) or the bonus token.
    """

    num_accepted: jax.Array
    next_token: jax.Array


def _check_shapes(draft_tokens, draft_probs, target_probs) -> tuple[int, int, int]:
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be [B, γ], got shape {draft_tokens.shape}")
    batch, gamma = draft_tokens.shape
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise TypeError(f"draft_tokens must be integer token ids, got dtype {draft_tokens.dtype}")
    if target_probs.ndim != 3 or target_probs.shape[:2] != (batch, gamma + 1):
        raise ValueError(
            f"target_probs must be [B, γ+1, V] = [{batch}, {gamma + 1}, V] to match "
            f"draft_tokens {draft_tokens.shape}, got {target_probs.shape}"
        )
    vocab = target_probs.shape[2]
    if draft_probs is not None and draft_probs.shape != (batch, gamma, vocab):
        raise ValueError(
            f"draft_probs must be [B, γ, V] = [{batch}, {gamma}, {vocab}] to match "
            f"draft_tokens and target_probs (same vocabulary), got {draft_probs.shape}"
        )
    return batch, gamma, vocab


def accept_with_noise(
    uniforms: jax.Array,
    draws: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    num_drafted: jax.Array | None = None,
) -> AcceptResult:
    """The acceptance step with its randomness given explicitly (for testing and reuse).

    Args:
      uniforms: [B, γ] float32 in [0, 1), one per drafted token.
      draws: [B] float32 in [0, 1), the one categorical draw of the correction or
        bonus token (inverse CDF, `sampling.sample_with_uniforms`).
      draft_tokens: [B, γ] int32.
      draft_probs: [B, γ, V] float32 q, or None for a deterministic proposer (q one-hot).
      target_probs: [B, γ+1, V] float32 p.
      num_drafted: optional [B] int32 in [0, γ]: row b drafted only its first
        num_drafted[b] tokens (the rest are ignored; its bonus token comes from
        p_{num_drafted[b]+1}). None: all γ.

    Returns:
      AcceptResult(num_accepted [B], next_token [B]).
    """
    batch, gamma, vocab = _check_shapes(draft_tokens, draft_probs, target_probs)
    if uniforms.shape != (batch, gamma) or draws.shape != (batch,):
        raise ValueError(
            f"uniforms must be [B, γ] = [{batch}, {gamma}] and draws [B] = [{batch}], got "
            f"{uniforms.shape} and {draws.shape}"
        )
    target_probs = target_probs.astype(jnp.float32)
    draft_tokens = draft_tokens.astype(jnp.int32)
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.float32)
    draft_probs = draft_probs.astype(jnp.float32)

    p_x = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    passed = uniforms.astype(jnp.float32) * q_x < p_x  # [B, γ]
    if num_drafted is None:
        num_drafted = jnp.full((batch,), gamma, jnp.int32)
    passed &= jnp.arange(gamma)[None] < num_drafted[:, None]
    num_accepted = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)  # [B]

    # Position num_accepted: a correction from max(0, p - q), or (all drafts accepted)
    # the bonus from p, which is the same formula with q = 0.
    rows = jnp.arange(batch)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    if gamma == 0:
        residual = p_next
    else:
        q_next = draft_probs[rows, jnp.minimum(num_accepted, gamma - 1)]  # [B, V]
        bonus = (num_accepted >= num_drafted)[:, None]
        residual = jnp.maximum(p_next - jnp.where(bonus, 0.0, q_next), 0.0)
    degenerate = jnp.sum(residual, axis=-1, keepdims=True) < RESIDUAL_FLOOR
    residual = jnp.where(degenerate, p_next, residual)
    # Inverse CDF on the unnormalised residual: one uniform per row, never a token
    # with zero residual.
    next_token = sample_with_uniforms(draws, residual)
    return AcceptResult(num_accepted.astype(jnp.int32), next_token)


def _as_key_array(keys: jax.Array, batch: int) -> jax.Array:
    keys = jnp.asarray(keys) if not isinstance(keys, jax.Array) else keys
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        if keys.shape != (batch,):
            raise ValueError(f"keys must be one key per row, shape [{batch}], got {keys.shape}")
        return keys
    if keys.dtype == jnp.uint32 and keys.ndim == 2 and keys.shape[0] == batch:
        return jax.random.wrap_key_data(keys)
    raise ValueError(
        f"keys must be a typed key array of shape [{batch}] (jax.random.key / split), "
        f"got dtype {keys.dtype} shape {keys.shape}"
    )


def accept(
    keys: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    num_drafted: jax.Array | None = None,
) -> AcceptResult:
    """One speculative round for a batch of rows, with one PRNG key per row.

    Pure and `jit`/`vmap`-able. A row's result depends only on its own key and inputs.

    Args:
      keys: [B] typed PRNG keys (or legacy uint32 [B, 2]).
      draft_tokens: [B, γ] int32 drafted tokens (γ may be 0: plain sampling from p_1).
      draft_probs: [B, γ, V] the draft's q after the sampling transforms, or None for a
        deterministic proposer (q one-hot on the drafted token).
      target_probs: [B, γ+1, V] the target's p after the same transforms.
      num_drafted: optional [B] ints in [0, γ], drafts per row when rows drafted
        different numbers of tokens (see `accept_with_noise`).

    Returns:
      AcceptResult(num_accepted [B] in [0, γ], next_token [B]).
    """
    draft_tokens = jnp.asarray(draft_tokens)
    target_probs = jnp.asarray(target_probs)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    batch, gamma, _ = _check_shapes(draft_tokens, draft_probs, target_probs)
    keys = _as_key_array(keys, batch)

    def noise(key):
        accept_key, residual_key = jax.random.split(key)
        return (
            jax.random.uniform(accept_key, (gamma,), jnp.float32),
            jax.random.uniform(residual_key, (), jnp.float32),
        )

    uniforms, draws = jax.vmap(noise)(keys)
    if num_drafted is not None:
        num_drafted = jnp.asarray(num_drafted)
        if num_drafted.shape != (batch,) or not jnp.issubdtype(num_drafted.dtype, jnp.integer):
            raise ValueError(
                f"num_drafted must be [B] = [{batch}] integers, got "
                f"{num_drafted.dtype} {num_drafted.shape}"
            )
        num_drafted = jnp.clip(num_drafted, 0, gamma).astype(jnp.int32)
    return accept_with_noise(uniforms, draws, draft_tokens, draft_probs, target_probs, num_drafted)


def accept_block_with_noise(
    uniforms: jax.Array,
    draws: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    num_drafted: jax.Array | None = None,
) -> AcceptResult:
    """Block verification (Sun et al. 2024, arXiv 2403.10444): the drafts are judged as a
    block, so a prefix may be kept although a token-by-token test would have stopped
    earlier. Same arguments, noise and result as `accept_with_noise`; exact, and never
    fewer tokens kept on average.

    With w_0 = 1 and w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)), the residual after i
    drafts is r_i = max(0, w_i p_{i+1} - q_{i+1}) with mass R_i. Test i passes when
    u_i < h_i, h_i = R_i / (R_i + 1 - w_i) for i < n and h_n = w_n (n drafts); the row
    keeps the longest passing prefix τ (0 if none) and draws the next token from
    norm(r_τ), or from p_{n+1} when τ = n.
    """
    batch, gamma, vocab = _check_shapes(draft_tokens, draft_probs, target_probs)
    p = target_probs.astype(jnp.float32)
    x = draft_tokens.astype(jnp.int32)
    q = jax.nn.one_hot(x, vocab, dtype=jnp.float32) if draft_probs is None else draft_probs
    q = q.astype(jnp.float32)
    n = jnp.full((batch,), gamma, jnp.int32) if num_drafted is None else num_drafted
    p_x = jnp.take_along_axis(p[:, :gamma], x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
    ratio = jnp.where(q_x > 0, p_x / jnp.where(q_x > 0, q_x, 1.0), 0.0)
    weights, w = [jnp.ones((batch,), jnp.float32)], jnp.ones((batch,), jnp.float32)
    for i in range(gamma):  # γ is small: unrolled
        w = jnp.minimum(w * ratio[:, i], 1.0)
        weights.append(w)
    weights = jnp.stack(weights, axis=1)  # [B, γ + 1], w_0 … w_γ
    # r_i for i = 0 … γ - 1 (the residual after i drafts, against q_{i+1}).
    residuals = jnp.maximum(weights[:, :gamma, None] * p[:, :gamma] - q, 0.0)
    mass = jnp.sum(residuals[:, 1:], axis=-1)  # R_1 … R_{γ-1}
    denominator = mass + 1.0 - weights[:, 1:gamma]
    h = jnp.where(denominator > 0, mass / jnp.where(denominator > 0, denominator, 1.0), 0.0)
    h = jnp.concatenate([h, jnp.zeros((batch, 1), jnp.float32)], axis=1)  # [B, γ]: h_1 … h_γ
    at = jnp.arange(1, gamma + 1, dtype=jnp.int32)[None]
    h = jnp.where(at == n[:, None], weights[:, 1:], h)  # h_n = w_n
    passed = (uniforms.astype(jnp.float32) < h) & (at <= n[:, None])
    kept = jnp.max(jnp.where(passed, at, 0), axis=1).astype(jnp.int32)
    rows = jnp.arange(batch)
    bonus = kept >= n
    residual = jnp.where(
        bonus[:, None],
        p[rows, kept],
        residuals[rows, jnp.minimum(kept, max(gamma - 1, 0))] if gamma else p[rows, kept],
    )
    degenerate = jnp.sum(residual, axis=-1, keepdims=True) < RESIDUAL_FLOOR
    residual = jnp.where(degenerate, p[rows, kept], residual)
    return AcceptResult(kept, sample_with_uniforms(draws, residual))
