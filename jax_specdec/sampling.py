"""Sampling transforms: logits -> the float32 distribution that tokens are drawn from.

Speculative decoding is exact only when the target's p and the draft's q come out
of the *same* transforms, so every sampling path in the library goes through
`probs_from_logits`. The transforms are applied in this order:

1. temperature: logits / temperature (temperature 0 means greedy, see below);
2. top-k: keep the tokens whose logit is >= the k-th largest logit (ties at the
   boundary are all kept, so the result never depends on sort order);
3. top-p (nucleus): on the softmax of what top-k kept, keep the smallest set of
   most probable tokens whose mass reaches top_p; every token tied with the
   least probable kept token is kept too;
4. softmax of the kept logits, renormalised, in float32.

Greedy (temperature 0) is one-hot on the argmax of the raw logits, the lowest
index winning ties; top-k and top-p do not change an argmax.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["SamplingConfig", "probs_from_logits", "sample", "sample_with_uniforms"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are sampled; hashable, so it can be a static argument of `jax.jit`.

    Attributes:
      temperature: >= 0; 0 means greedy (argmax, lowest index on ties).
      top_k: >= 0; 0 means off.
      top_p: in (0, 1]; 1.0 means off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if math.isinf(t):
            raise ValueError(f"temperature must be finite, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: jax.Array, config: SamplingConfig = SamplingConfig()) -> jax.Array:
    """Maps logits [..., V] (any float dtype, e.g. bfloat16) to float32 probabilities [..., V].

    Args:
      logits: raw model outputs, [..., V].
      config: the sampling transforms; a static Python value.

    Returns:
      float32 probabilities [..., V] summing to 1 over the last axis.
    """
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    logits = jnp.asarray(logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if config.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)

    logits = logits / config.temperature
    if 0 < config.top_k < vocab:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]  # [..., 1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if config.top_p < 1.0:
        sorted_probs = -jnp.sort(-probs, axis=-1)  # descending
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # The least probable kept token: the last one whose preceding mass is < top_p.
        num_kept = jnp.sum(mass_before < config.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_probs, num_kept - 1, axis=-1)
        probs = jnp.where(probs >= threshold, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row from probs [B, V] with keys [B], by inverse CDF: int32 [B].

    One uniform per row (cheaper than Gumbel-max's V draws, which matters in the
    draft's inner loop). See `sample_with_uniforms`.
    """
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # [B]
    return sample_with_uniforms(u, probs)


def sample_with_uniforms(uniforms: jax.Array, weights: jax.Array) -> jax.Array:
    """Inverse CDF with the randomness given: for each row the first index with weight
    whose cumulative weight exceeds u * total, int32 [B]. uniforms [B] in [0, 1); weights
    [B, V] >= 0, not necessarily normalised (a residual max(0, p - q) is drawn from as
    it is).

    A token with zero weight is never drawn, whatever order XLA sums the cumulative
    weights in; if u * total is not below the total, the last index with weight is
    taken. u = 0 gives the first index with weight (the argmax of a one-hot). The
    uniforms are float32, so a token's probability is resolved to about 6e-8 of the
    total (as `sample` draws).
    """
    weights = weights.astype(jnp.float32)
    cdf = jnp.cumsum(weights, axis=-1)  # [B, V]
    threshold = (uniforms.astype(jnp.float32) * cdf[:, -1])[:, None]
    hit = (cdf > threshold) & (weights > 0)
    index = jnp.arange(weights.shape[-1], dtype=jnp.int32)
    last = jnp.maximum(jnp.max(jnp.where(weights > 0, index, -1), axis=-1), 0)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last).astype(jnp.int32)
