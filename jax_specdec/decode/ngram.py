"""Model-free proposers: draft tokens computed from the row's own history, on device.

`NGram` is prompt lookup decoding (Saxena 2023; `prompt_lookup_num_tokens` in Hugging
Face, the `ngram` method in vLLM): find the most recent earlier occurrence of the row's
last n tokens in its own prompt + generated text and propose the tokens that followed
it. The proposal is deterministic given the history (q is one-hot on the proposed
token), so the acceptance step stays exact: a proposed token is kept with probability
p(x), and a rejection draws from p with x removed.

`NGram` is a drafter of the generation loop (see `jax_specdec.decode.drafter`): it keeps
no cache and decides itself how far it can propose, before the round's width is chosen.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_specdec.decode.drafter import DraftInputs, Proposal

__all__ = ["NGram"]


@dataclasses.dataclass(frozen=True)
class NGram:
    """Prompt lookup: match the last `max_ngram` … `min_ngram` tokens (longest first).

    A row with no match proposes nothing that round (a plain target step for it).
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"NGram.{name} must be an integer >= 1, got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"NGram.min_ngram ({self.min_ngram}) exceeds max_ngram ({self.max_ngram})"
            )

    # The drafter protocol: no cache, the lookup at the widest γ before the round.

    def init(self, model, prompts, prompt_lengths, config):
        return None

    def prepare(self, model, cache, inputs: DraftInputs, config):
        proposed, found = self.lookup(inputs.tokens, inputs.lengths, config.gamma_max)
        return None, proposed, found

    def propose(self, model, cache, inputs: DraftInputs, prepared, width: int, config):
        return Proposal(prepared[:, :width], None, jnp.zeros(inputs.lengths.shape, bool))

    def commit(self, cache, prepared, entries, before, after, width, config):
        return None

    def load(self, model, cache, slot, prompt, prompt_length, config):
        return None

    def lookup(self, tokens: jax.Array, lengths: jax.Array, gamma: int):
        """Proposals for every row.

        Args:
          tokens: [B, L] int32 history buffers; row b's history is tokens[b, :lengths[b]].
          lengths: [B] int32.
          gamma: static, tokens to propose at most.

        Returns:
          (proposed [B, gamma] int32, count [B] int32): row b proposes its first count[b]
          tokens; count is 0 where no n-gram matched.
        """
        batch, width = tokens.shape
        starts = jnp.arange(width, dtype=jnp.int32)  # candidate start j of an occurrence
        best = jnp.full((batch,), -1, jnp.int32)  # start of the following tokens
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer n overrides shorter
            suffix_at = lengths[:, None] - n + jnp.arange(n, dtype=jnp.int32)  # [B, n]
            suffix = jnp.take_along_axis(tokens, jnp.maximum(suffix_at, 0), axis=1)
            # windows[b, j, i] = tokens[b, j + i]; zero-padded past the buffer.
            padded = jnp.pad(tokens, ((0, 0), (0, n)))
            match = jnp.ones((batch, width), bool)
            for i in range(n):
                match &= padded[:, i : i + width] == suffix[:, i : i + 1]
            # An earlier occurrence: it ends before the last token, so at least one
            # token follows it inside the history (j + n <= lengths - 1).
            valid = (starts[None] + n <= lengths[:, None] - 1) & (lengths[:, None] > n)
            match &= valid
            last = jnp.max(jnp.where(match, starts[None], -1), axis=1)  # most recent
            best = jnp.where(last >= 0, last + n, best)
        count = jnp.where(best >= 0, jnp.minimum(gamma, lengths - best), 0).astype(jnp.int32)
        idx = jnp.maximum(best, 0)[:, None] + jnp.arange(gamma, dtype=jnp.int32)
        proposed = jnp.take_along_axis(tokens, jnp.minimum(idx, width - 1), axis=1)
        return proposed.astype(jnp.int32), count
