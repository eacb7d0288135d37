"""Verification: the target scores a round's proposal and the acceptance step decides.

One target call on [pending, x1 … xw] per row, on a read-only cache; row b's first
counts[b] drafts go through the acceptance step (Leviathan et al., Algorithm 1) and
the accepted run plus a correction or bonus token is appended. The rule is the
config's `acceptance` (the exact `acceptance.accept_with_noise` unless a test swaps it).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_specdec.acceptance import AcceptResult
from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters.base import Proposal, reads_features, target_features
from jax_specdec.decode.logprobs import token_logprobs
from jax_specdec.decode.noise import Noise, draw
from jax_specdec.decode.state import LoopState, emit, gather_last, pad_entries, record_round
from jax_specdec.decode.stats import nonfinite
from jax_specdec.penalties import adjust

__all__ = ["verify"]


def verify(
    target, cache, state: LoopState, proposal: Proposal, counts, noise: Noise, config: LoopConfig
):
    """Verifies a proposal of static width w = proposal.tokens.shape[1] (0: a plain
    decode step, what the acceptance step reduces to with no drafts).

    Args:
      target: the target model.
      cache: the target's cache, only read (valid below `state.lengths - 1`).
      state: the loop state before the round.
      proposal: the drafter's tokens [B, w] and q [B, w, V] (or None: one-hot).
      counts: [B] drafts row b asked to have tested (clipped to w).
      noise: the round's randomness.
      config: the loop's static config.

    Returns:
      The state after the round (caches untouched); the target's entries for
      positions lengths - 1 …, padded to γ_max + 1 per layer; and, for a drafter that
      reads features, the target's features there [B, γ_max + 1, D] (else None).
    """
    width = proposal.tokens.shape[1]
    pending = gather_last(state.tokens, state.lengths, 1)
    logits, keys, values, *hidden = target.decode_entries(
        jnp.concatenate([pending, proposal.tokens], axis=1),
        cache.replace(lengths=state.lengths - 1),
        features=target_features(config.drafter),
    )
    logits = logits[..., : config.vocab_size]
    counts = jnp.minimum(counts, width)
    bad = nonfinite(logits) | proposal.bad
    # Position t follows the pending token and drafts 0 … t - 1: they count as seen.
    before = jnp.tril(jnp.ones((width + 1, width), bool), -1)
    adjusted = adjust(logits, state.sampling, state.seen, proposal.tokens, before)
    result = _decide(adjusted, state.sampling, proposal, counts, noise, config)
    accepted = result.num_accepted
    new_tokens = jnp.concatenate([proposal.tokens, result.next_token[:, None]], axis=1)
    idx = jnp.arange(width + 1, dtype=jnp.int32)
    new_tokens = jnp.where(idx[None] < accepted[:, None], new_tokens, result.next_token[:, None])
    active = ~state.done
    scores = token_logprobs(logits, adjusted, new_tokens, state.sampling, config.logprobs)
    state = emit(state, new_tokens, accepted + 1, config, scores)
    state = record_round(
        state,
        active=active,
        width=width,
        counts=counts,
        accepted=accepted,
        bad=bad,
    )
    size = config.gamma_max + 1
    features = None
    if reads_features(config.drafter):
        features = jnp.pad(hidden[0], ((0, 0), (0, size - width - 1), (0, 0)))
    return state, pad_entries((keys, values), size), features


def _decide(adjusted, sampling, proposal: Proposal, counts, noise: Noise, config: LoopConfig):
    """The acceptance step on the target's adjusted logits [B, w + 1, V] (w = 0: the
    plain step's draw)."""
    width = proposal.tokens.shape[1]
    if width == 0:
        first = adjusted[:, 0]
        token = draw(noise.draws, first, sampling.probs(first), sampling)
        return AcceptResult(jnp.zeros_like(counts), token)
    p = sampling.probs(adjusted)  # [B, w + 1, V]
    return config.acceptance(
        noise.uniforms[:, :width], noise.draws, proposal.tokens, proposal.probs, p, counts
    )
