"""Penalties and logit bias: the logit transforms that depend on the tokens before a
position, exact under speculation.

A row's logits at a position are changed, before the sampling transforms of
`jax_specdec.sampling` (temperature, top-k, top-p, min-p) and before a greedy row's
argmax, in this order (as vLLM's sampler):

1. logit bias: `bias[id]` added to the logit of each listed id;
2. repetition penalty r (`transformers`' RepetitionPenaltyLogitsProcessor): the logit
   of every token in the prompt or generated so far becomes l / r if l > 0, else l * r;
3. frequency and presence penalties f and p (the OpenAI API's): the logit of a token
   generated c times so far loses f * c + p * (c > 0). The prompt does not count.

"So far" is every token before the position: at a drafted position that includes the
drafts before it (each node's own path in a tree), for the target's p and the drafter's
q alike. Then the verifier accepts exactly what autoregressive sampling with the same
penalties would emit: p at each position is the penalised distribution of that prefix.

`Seen` holds each row's counts of generated tokens [B, V] and its prompt's tokens
[B, V]; it lives in the loop state only when some row uses a penalty (a static plan),
and grows as tokens are emitted.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["Seen", "adjust", "bias_pairs"]


@struct.dataclass
class Seen:
    """The tokens before each row's next position.

    Attributes:
      counts: [B, V] int32, how often each token was generated (the prefill's first token
        on); the prompt is not counted.
      prompt: [B, V] bool, the tokens of the row's prompt.
    """

    counts: jax.Array
    prompt: jax.Array

    @classmethod
    def empty(cls, batch: int, vocab: int) -> Seen:
        """No prompt and nothing generated (slots before their first prompt)."""
        return cls(jnp.zeros((batch, vocab), jnp.int32), jnp.zeros((batch, vocab), bool))

    @classmethod
    def of(cls, prompts: jax.Array, lengths: jax.Array, vocab: int) -> Seen:
        """Nothing generated yet, after prompts [B, P] of lengths [B]."""
        batch, width = prompts.shape
        valid = jnp.arange(width)[None] < lengths[:, None]
        rows = jnp.arange(batch)[:, None]
        empty = cls.empty(batch, vocab)
        return empty.replace(prompt=empty.prompt.at[rows, prompts].max(valid, mode="drop"))

    def emit(self, tokens: jax.Array, count: jax.Array) -> Seen:
        """After the first count[b] of tokens [B, W] were emitted in row b."""
        rows = jnp.arange(tokens.shape[0])[:, None]
        taken = (jnp.arange(tokens.shape[1])[None] < count[:, None]).astype(jnp.int32)
        return self.replace(counts=self.counts.at[rows, tokens].add(taken, mode="drop"))

    def reset(self, slot: jax.Array, prompt: jax.Array, length: jax.Array) -> Seen:
        """Row `slot` after only the prompt [1, P] of `length` tokens."""
        one = Seen.of(prompt, length[None], self.counts.shape[1])
        return Seen(
            counts=self.counts.at[slot].set(0),
            prompt=self.prompt.at[slot].set(one.prompt[0]),
        )


def adjust(logits: jax.Array, sampling, seen: Seen | None, drafted=None, before=None):
    """Logits [B, V] or [B, T, V] with each row's logit bias and penalties applied.

    Args:
      logits: float32 logits; [B, T, V] for T positions of a round.
      sampling: the rows' `RowSampling` (its plan says statically what any row uses).
      seen: the rows' `Seen` before the round (None: no row uses a penalty).
      drafted: [B, S] int32, the round's drafted tokens, whose counts add to `seen` at
        the positions after them; None: none do.
      before: [T, S] or [B, T, S], 1 where drafted token s precedes position t.
    """
    plan = sampling.plan
    if plan.bias:
        logits = _bias(logits, sampling.bias_ids, sampling.bias_values)
    if not plan.penalties:
        return logits
    counts, prompt = seen.counts, seen.prompt
    if logits.ndim == 3:
        counts, prompt = counts[:, None], prompt[:, None]
        if drafted is not None:
            one_hot = jax.nn.one_hot(drafted, logits.shape[-1], dtype=jnp.int32)  # [B, S, V]
            order = before if before.ndim == 3 else before[None]
            order = jnp.broadcast_to(order, (drafted.shape[0],) + order.shape[1:])
            counts = counts + jnp.einsum("bts,bsv->btv", order.astype(jnp.int32), one_hot)
    shape = (-1,) + (1,) * (logits.ndim - 1)
    r = sampling.repetition_penalty.reshape(shape)
    f = sampling.frequency_penalty.reshape(shape)
    p = sampling.presence_penalty.reshape(shape)
    seen_any = prompt | (counts > 0)
    logits = jnp.where(seen_any, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - f * counts - p * (counts > 0)


def _bias(logits, ids, values):
    """logits + values at ids (ids [B, K], -1 for none) per row."""
    vocab = logits.shape[-1]
    rows = jnp.arange(ids.shape[0])[:, None]
    dense = jnp.zeros((ids.shape[0], vocab), jnp.float32)
    dense = dense.at[rows, jnp.where(ids < 0, vocab, ids)].add(values, mode="drop")
    return logits + (dense[:, None] if logits.ndim == 3 else dense)


def bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """Sorted (id, bias) pairs of a dict or a sequence of pairs; ValueError naming the
    bad entry."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [tuple(pair) for pair in items]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        token, value = pair
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)  # JSON object keys are strings
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
        if not _finite(value) or not (-100.0 <= value <= 100.0):
            raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {value!r}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
