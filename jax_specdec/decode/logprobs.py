"""Log-probabilities of the emitted tokens, taken from the logits the round's target call
already computed (no extra pass), and kept beside the tokens in the loop state.

Two kinds (`LoopConfig.logprobs`, a `LogprobSpec`):
- "processed" (the default): under the distribution the row samples from, its logit
  bias and penalties, temperature, top-k, top-p and min-p applied (tokens these remove:
  -inf). A greedy row's distribution is a point mass, which says nothing, so its
  log-probabilities are those of the biased and penalised logits at temperature 1.
- "raw": under the model's own distribution, log_softmax of its logits.

A token emitted at a round's position t has the log-probability the target gives it
there: for an accepted draft and for the round's last token alike, whatever rule chose
it, so speculative and autoregressive decoding report the same values for the same
tokens. With `top` > 0 the `top` most likely tokens of that distribution come too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_specdec.sampling import RowSampling

__all__ = ["KINDS", "MAX_TOP", "LogprobSpec", "Logprobs", "entries", "token_logprobs"]

KINDS = ("processed", "raw")
MAX_TOP = 20


@dataclasses.dataclass(frozen=True)
class LogprobSpec:
    """What the program records (static): the `top` alternatives per token (0: the
    emitted token's own log-probability only) and the `kind` of distribution."""

    top: int = 0
    kind: str = "processed"

    def __post_init__(self):
        top = self.top
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP}], got {top!r}")
        if self.kind not in KINDS:
            raise ValueError(f"logprob_kind must be one of {KINDS}, got {self.kind!r}")


@struct.dataclass
class Logprobs:
    """Log-probabilities of a token buffer [B, L] (float32) and, per position, the top
    alternatives [B, L, top] (ids and log-probabilities, most likely first)."""

    chosen: jax.Array
    top_ids: jax.Array
    top_values: jax.Array

    @classmethod
    def empty(cls, batch: int, length: int, top: int) -> Logprobs:
        return cls(
            chosen=jnp.zeros((batch, length), jnp.float32),
            top_ids=jnp.zeros((batch, length, top), jnp.int32),
            top_values=jnp.full((batch, length, top), -jnp.inf, jnp.float32),
        )

    def put(self, rows, positions, new: Logprobs) -> Logprobs:
        """`new` [B, W(, top)] written at [rows, positions] (out of range: dropped)."""
        at = lambda old, x: old.at[rows, positions].set(x, mode="drop")  # noqa: E731
        return jax.tree.map(at, self, new)

    def take(self, positions) -> Logprobs:
        """The values at `positions` [B, W] of each row."""
        pick = lambda a: jnp.take_along_axis(  # noqa: E731
            a, positions.reshape(positions.shape + (1,) * (a.ndim - 2)), axis=1
        )
        return jax.tree.map(pick, self)


def _distribution(raw, adjusted, sampling: RowSampling, kind: str) -> jax.Array:
    """Log-probabilities [B, W, V] of the kind's distribution at each position."""
    if kind == "raw":
        return jax.nn.log_softmax(raw.astype(jnp.float32), axis=-1)
    at_one = jax.nn.log_softmax(adjusted.astype(jnp.float32), axis=-1)
    if sampling.plan.greedy:
        return at_one
    sampled = jnp.log(sampling.probs(adjusted))
    greedy = (sampling.temperature == 0.0).reshape((-1,) + (1,) * (raw.ndim - 1))
    return jnp.where(greedy, at_one, sampled)


def token_logprobs(
    raw, adjusted, tokens, sampling: RowSampling, spec: LogprobSpec | None
) -> Logprobs | None:
    """The log-probabilities of `tokens` [B, W] under the distributions at their
    positions, from the target's logits there: `raw` [B, W, V] and `adjusted` (the row's
    bias and penalties applied, `penalties.adjust`). None when `spec` is None."""
    if spec is None:
        return None
    logp = _distribution(raw, adjusted, sampling, spec.kind)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    if spec.top:
        values, ids = jax.lax.top_k(logp, spec.top)
    else:
        values = jnp.zeros(tokens.shape + (0,), jnp.float32)
        ids = jnp.zeros(tokens.shape + (0,), jnp.int32)
    return Logprobs(chosen=chosen, top_ids=ids.astype(jnp.int32), top_values=values)


def entries(logprobs: Logprobs, row: int, count: int, top: int) -> list[dict]:
    """Row `row`'s first `count` tokens' log-probabilities as JSON-ready entries (host
    side, from an output's `Logprobs`): [{"logprob", "top": [[id, logprob], ...]}] with
    its `top` most likely alternatives (those of probability 0 left out, so a row whose
    top-k or min-p keeps fewer has fewer); a non-finite value (NaN logits, which the
    callers refuse first) is written as null, never as invalid JSON."""
    chosen, ids, values = (
        np.asarray(a) for a in (logprobs.chosen, logprobs.top_ids, logprobs.top_values)
    )
    out = []
    for t in range(count):
        pairs = zip(ids[row, t, :top], values[row, t, :top], strict=True)
        alternatives = [[int(i), float(v)] for i, v in pairs if np.isfinite(v)]
        value = float(chosen[row, t])  # never -inf: the token was drawn from it
        out.append({"logprob": value if np.isfinite(value) else None, "top": alternatives})
    return out
