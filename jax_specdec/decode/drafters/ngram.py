"""Model-free proposers: draft tokens computed from the row's own history, on device.

`NGram` is prompt lookup decoding (Saxena 2023; `prompt_lookup_num_tokens` in Hugging
Face, the `ngram` method in vLLM): find the most recent earlier occurrence of the row's
last n tokens in its own prompt + generated text and propose the tokens that followed
it. The proposal is deterministic given the history (q is one-hot on the proposed
token), so the acceptance step stays exact: a proposed token is kept with probability
p(x), and a rejection draws from p with x removed.

`NGram` is a drafter of the generation loop (see `jax_specdec.decode.drafters.base`): it keeps
no cache and decides itself how far it can propose, before the round's width is chosen.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_specdec.decode.drafters.base import DraftInputs, Proposal
from jax_specdec.decode.tree import TreeProposal

__all__ = ["NGram", "trie"]


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

    def propose_tree(self, model, cache, inputs: DraftInputs, prepared, tree, config):
        """A trie of the continuations of the row's `tree.nodes` best earlier matches
        (longest n-gram first, then most recent), each up to `tree.depth` tokens."""
        found, count = self.matches(inputs.tokens, inputs.lengths, tree.nodes, tree.depth)
        tokens, parent, valid = trie(found, count, tree.nodes)
        return TreeProposal(tokens, parent, valid, jnp.zeros(inputs.lengths.shape, bool))

    def check_tree(self, tree):
        """Refuses `Tree.lookup`: this drafter's tree is all prompt lookup."""
        if tree.lookup:
            raise ValueError(
                f"Tree.lookup ({tree.lookup}) grafts prompt lookup onto a feature head's "
                "tree; NGram's tree is prompt lookup already (give lookup=0)"
            )

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

    def matches(self, tokens: jax.Array, lengths: jax.Array, count: int, gamma: int):
        """The continuations of up to `count` earlier occurrences of the row's suffix.

        Each start s of a continuation is scored by the longest n-gram ending just
        before it that equals the row's last n tokens; starts rank by that n, then by
        recency (the first is what `lookup` proposes).

        Returns:
          (continuations [B, count, gamma] int32, lengths [B, count] int32: 0 where
          fewer occurrences exist; a continuation stops at the history's end).
        """
        batch, width = tokens.shape
        starts = jnp.arange(width, dtype=jnp.int32)
        score = jnp.zeros((batch, width), jnp.int32)  # longest n matched before start s
        for n in range(self.min_ngram, self.max_ngram + 1):
            suffix_at = lengths[:, None] - n + jnp.arange(n, dtype=jnp.int32)
            suffix = jnp.take_along_axis(tokens, jnp.maximum(suffix_at, 0), axis=1)
            match = (starts[None] >= n) & (starts[None] <= lengths[:, None] - 1)
            match &= lengths[:, None] > n
            for i in range(n):  # tokens[s - n + i] == suffix[i]
                before = jnp.pad(tokens, ((0, 0), (n - i, 0)))[:, :width]
                match &= before == suffix[:, i : i + 1]
            score = jnp.where(match, n, score)
        rank = jnp.where(score > 0, score * width + starts[None], -1)
        best, at = jax.lax.top_k(rank, min(count, width))
        at = jnp.where(best >= 0, at, width).astype(jnp.int32)
        if count > width:  # fewer starts than asked for: the rest are empty
            at = jnp.pad(at, ((0, 0), (0, count - width)), constant_values=width)
        idx = at[:, :, None] + jnp.arange(gamma, dtype=jnp.int32)  # [B, count, gamma]
        flat = jnp.take_along_axis(tokens, jnp.minimum(idx, width - 1).reshape(batch, -1), 1)
        found = jnp.clip(lengths[:, None] - at, 0, gamma).astype(jnp.int32)
        return flat.reshape(idx.shape).astype(jnp.int32), found


def trie(continuations: jax.Array, lengths: jax.Array, nodes: int):
    """The trie of token sequences as a tree of at most `nodes` nodes.

    Args:
      continuations: [B, M, D] int32, row b's M candidate sequences (best first).
      lengths: [B, M] int32, how many tokens of each are real.
      nodes: N, the tree's size.

    Returns:
      (tokens [B, N], parent [B, N], valid [B, N]) as `TreeProposal` holds them: the
      distinct prefixes, sequence by sequence in order (so a node's parent comes before
      it), cut at N.
    """
    batch, m, d = continuations.shape
    real = jnp.arange(d)[None, None] < lengths[:, :, None]  # [B, M, D]
    same = continuations[:, :, None, :] == continuations[:, None, :, :]  # [B, M, M', D]
    same = jnp.cumprod(same, axis=-1).astype(bool) & real[:, None, :, :]
    first = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B, M, D] the prefix's first owner
    owns = real & (first == jnp.arange(m, dtype=jnp.int32)[None, :, None])
    order = jnp.cumsum(owns.reshape(batch, -1), axis=1) - 1  # [B, M*D], sequence-major
    kept = owns.reshape(batch, -1) & (order < nodes)
    slot = jnp.where(kept, order, nodes).astype(jnp.int32)  # N: dropped
    # The parent of (i, j) is the owner of its prefix of length j: (first[i, j-1], j-1).
    owner = jnp.take_along_axis(order.reshape(batch, m, d), first, axis=1)  # [B, M, D]
    parent = jnp.pad(owner[:, :, :-1] + 1, ((0, 0), (0, 0), (1, 0)))  # 0: the root
    rows = jnp.arange(batch)[:, None]

    def place(values, fill):
        out = jnp.full((batch, nodes), fill, values.dtype)
        return out.at[rows, slot].set(values.reshape(batch, -1), mode="drop")

    tokens = place(continuations, 0)
    parents = place(parent.astype(jnp.int32), 0)
    valid = place(kept, False)
    return tokens, parents, valid
