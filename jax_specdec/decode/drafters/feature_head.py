"""Drafting with a feature head (`nn.feature_head`): the drafter reads the target's
top-layer features, which the verify call returns.

Pending-token convention. Let L be a row's length: the target has run positions
0 … L-2 (features f_0 … f_{L-2} known) and token x_{L-1} is pending. The head's entry
i is (f_{i-1}, x_i) and predicts f_i, whose logits give token i + 1. At the start of
a round the head's cache is valid below A and the features of positions A-1 …
L-2 (count c = L - A, at most γ_max + 1) are kept aside: the round's first head call
feeds the chunk of entries A … A + γ_max (static width, the first c valid) and its
entry L-1 gives the first draft. Later draft steps feed (predicted feature, drafted
token). After the round the chunk's entries are written, the cache is valid below L,
and the verify call's features (positions L-1 … L+n, n drafts accepted) are the next
round's chunk. A plain target step (batch-wide γ = 0) adds its one feature to the
chunk (`absorb`), running the chunk through the head first when it is full.

q is the softmax over the K kept tokens after the target's sampling transforms,
scattered into the full vocabulary (zero elsewhere); drafts are drawn from it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jax_specdec.decode import prefill
from jax_specdec.decode.drafters import head_tree
from jax_specdec.decode.drafters.base import DraftInputs, Proposal
from jax_specdec.decode.drafters.ngram import NGram, trie
from jax_specdec.decode.noise import choose
from jax_specdec.decode.state import load_row, new_cache, written_after
from jax_specdec.decode.stats import nonfinite
from jax_specdec.decode.tree import graft
from jax_specdec.io.heads import check_tokenizer, load_head
from jax_specdec.nn import KVCache, Transformer, init_cache, write_entries
from jax_specdec.nn.feature_head import FeatureHead, previous_features
from jax_specdec.nn.transformer import ordered_after

__all__ = ["AttachedHead", "FeatureCache", "HeadDrafter", "attach_head", "check_vocab_map"]


class AttachedHead(nnx.Module):
    """A feature head (or an EAGLE-3 head, `decode.drafters.eagle3`) attached to its
    target: the head with the token embedding it reads (the target's, shared, not
    copied). `attach_head` makes one; `Generator` drafts with it."""

    def __init__(self, head, embed: jax.Array):
        self.head = head
        self.embed = nnx.Param(embed)

    @property
    def config(self):
        """The head's layer config (cache shapes, max_len)."""
        return self.head.config.layer


def attach_head(head: FeatureHead | str | os.PathLike, target: Transformer, tokenizer=None):
    """`head` (a `FeatureHead`, or a head directory to load) paired with `target`'s token
    embedding as an `AttachedHead`, after checking that it drafts for `target` (and for
    its tokenizer, if given). Raises ValueError naming both models on any mismatch."""
    if not isinstance(head, FeatureHead):
        head = load_head(head)
    hc, tc = head.config, target.config
    name = f"the feature head (trained for {hc.target or 'an unnamed target'})"
    if hc.d_model != tc.d_model:
        raise ValueError(
            f"{name} reads features of size {hc.d_model}; the target's is {tc.d_model}"
        )
    if hc.vocab_size != tc.vocab_size:
        raise ValueError(f"{name} has vocabulary {hc.vocab_size}; the target's is {tc.vocab_size}")
    check_vocab_map(head, tc.vocab_size, name)
    check_tokenizer(head, tokenizer)
    return AttachedHead(head, target.embed.get_value())


def check_vocab_map(head, vocab_size: int, name: str) -> None:
    """Refuses a head whose kept tokens' ids (`vocab_map`) fall outside the target's
    vocabulary."""
    ids = jax.device_get(head.vocab_map[...])
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"{name} has vocab_map ids in [{ids.min()}, {ids.max()}], outside the target's "
            f"vocabulary [0, {vocab_size})"
        )


@struct.dataclass
class FeatureCache:
    """The drafter's state between rounds.

    Attributes:
      kv: the head's `KVCache`, valid below `kv.lengths` (A).
      features: [B, γ_max + 1, D] the target's features of positions A-1 …, not yet
        fed to the head.
      count: [B] int32, how many of them are valid (L - A).
    """

    kv: KVCache
    features: jax.Array
    count: jax.Array


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    """The drafter protocol for an `AttachedHead` (see the module docstring)."""

    reads_features: ClassVar[bool] = True

    def init(self, model: AttachedHead, prompts, prompt_lengths, config, *, features):
        kv, pending = _prefill(
            model,
            new_cache(model.config, prompts.shape[0], config),
            prompts,
            prompt_lengths,
            config,
            features,
        )
        return FeatureCache(kv, pending, jnp.ones_like(prompt_lengths))

    def load(self, model: AttachedHead, cache, slot, prompt, prompt_length, config, *, features):
        """Row `slot` holding only `prompt` [1, P] (length [1]), as `init` makes it."""
        row = init_cache(model.config, batch=1, max_len=prompt.shape[1])
        row, pending = _prefill(model, row, prompt, prompt_length, config, features)
        return FeatureCache(
            load_row(cache.kv, row, slot, prompt_length[0]),
            jax.lax.dynamic_update_slice_in_dim(cache.features, pending, slot, axis=0),
            cache.count.at[slot].set(1),
        )

    def prepare(self, model: AttachedHead, cache: FeatureCache, inputs: DraftInputs, config):
        """The round's first head call: the chunk of verified entries and the first draft."""
        predicted, keys, values = _chunk(model, cache, inputs.tokens)
        last = jnp.maximum(cache.count - 1, 0)[:, None, None]
        predicted = jnp.take_along_axis(predicted, last, axis=1)
        logits = model.head.logits(predicted)[:, 0]  # of entry L - 1 only
        x, q, bad = _draft(model, logits, inputs.keys[:, 0], config, inputs.sampling)
        return cache, _Prepared(keys, values, x, q, predicted, bad, logits), None

    def propose_tree(
        self, model: AttachedHead, cache: FeatureCache, inputs, prepared, tree, config
    ):
        """The round's tree (`decode.drafters.head_tree`), on a read-only cache; with
        `tree.lookup`, prompt lookup's trie grafted onto it (`decode.tree.graft`)."""
        keys = None if inputs.sampling.greedy else inputs.keys[:, 0]
        if not tree.lookup:
            return head_tree.propose_tree(
                model, cache, prepared, tree, keys, config, inputs.sampling
            )
        own = dataclasses.replace(tree, nodes=tree.nodes - tree.lookup, lookup=0, sampled=False)
        base = head_tree.propose_tree(model, cache, prepared, own, keys, config, inputs.sampling)
        found, count = NGram().matches(inputs.tokens, inputs.lengths, tree.lookup, tree.depth)
        return graft(base, *trie(found, count, tree.lookup))

    def check_tree(self, tree):
        """Refuses a tree of more nodes than the head drafts candidates for it."""
        own = tree.nodes - tree.lookup
        if own > head_tree.capacity(tree):
            raise ValueError(
                f"tree ({own} nodes{' from the head' if tree.lookup else ''}) is larger than a "
                f"feature head builds at depth {tree.depth} with branch {tree.branch} "
                f"({head_tree.capacity(tree)} candidates)"
            )

    def propose(self, model: AttachedHead, cache: FeatureCache, inputs, prepared, width, config):
        batch = inputs.lengths.shape[0]
        if width == 0:
            return Proposal(jnp.zeros((batch, 0), jnp.int32), None, jnp.zeros((batch,), bool))
        p = prepared
        chunk_valid = jnp.arange(config.gamma_max + 1)[None] < cache.count[:, None]
        recent = [(p.keys, p.values, chunk_valid)]
        xs, qs, bad, predicted = [p.x], [p.q], p.bad, p.predicted
        start = cache.kv.lengths + cache.count  # position L of the second draft's entry
        # Unrolled: γ is small.
        for i in range(1, width):
            predicted, keys, values = model.head.decode_entries(
                predicted, xs[-1][:, None], model.embed[...], cache.kv, start + i - 1, recent
            )
            recent.append((keys, values, jnp.ones((batch, 1), bool)))
            logits = model.head.logits(predicted)[:, 0]
            x, q, step_bad = _draft(model, logits, inputs.keys[:, i], config, inputs.sampling)
            xs.append(x)
            qs.append(q)
            bad = bad | step_bad
        return Proposal(jnp.stack(xs, axis=1), jnp.stack(qs, axis=1), bad)

    def commit(
        self, cache: FeatureCache, prepared, entries, before, after, width, config, *, features
    ):
        start = written_after(cache.kv.lengths, after)
        kv = write_entries(cache.kv, prepared.keys, prepared.values, start)
        return FeatureCache(kv.replace(lengths=before), features, after - before)

    def absorb(self, model: AttachedHead, cache: FeatureCache, tokens, before, after, features):
        """The cache after a plain target step (a γ = 0 round for the whole batch):
        `features` [B, 1, D] of position before - 1, where the rows' lengths went from
        `before` to `after` [B] (after - before = 0 for a finished row). The feature
        joins the waiting chunk; when some row's chunk is full, every row's chunk is
        first run through the head's layer (not its LM head) and written to its cache."""
        width = cache.features.shape[1]
        full = jnp.any(cache.count >= width)

        def entries():
            return _chunk(model, cache, tokens)[1:]

        def nothing():
            return jax.tree.map(jnp.zeros_like, jax.eval_shape(entries))

        keys, values = jax.lax.cond(full, entries, nothing)
        start = cache.kv.lengths
        # Not full: every write lands past the cache's end and is dropped.
        kv = write_entries(cache.kv, keys, values, jnp.where(full, start, cache.kv.max_len))
        kv = kv.replace(lengths=jnp.where(full, start + cache.count, start))
        count = jnp.where(full, 0, cache.count)
        rows = jnp.arange(count.shape[0], dtype=jnp.int32)
        slot = jnp.where(after > before, count, width)  # a finished row keeps its chunk
        waiting = cache.features.at[rows, slot].set(
            features[:, 0].astype(cache.features.dtype), mode="drop"
        )
        return FeatureCache(kv, waiting, count + (after - before))


def _chunk(model: AttachedHead, cache: FeatureCache, tokens):
    """The head on the chunk of waiting entries A … A + γ_max (the first `count`
    valid): (predicted features, keys, values), nothing written."""
    start, width = cache.kv.lengths, cache.features.shape[1]
    idx = start[:, None] + jnp.arange(width, dtype=jnp.int32)
    chunk = jnp.take_along_axis(tokens, jnp.minimum(idx, tokens.shape[1] - 1), 1)
    return model.head.decode_entries(cache.features, chunk, model.embed[...], cache.kv, start)


def _prefill(model: AttachedHead, kv, prompts, prompt_lengths, config, features):
    """The head's entries for the prompts [B, P] written into the empty cache `kv` (valid
    below the prompt lengths; past `BATCH_CHUNK` positions in chunks, as the
    target's), and the chunk of waiting features: the prompt's last."""
    batch, width = prompts.shape
    prev = previous_features(features)

    def call(kv, start, pieces):
        at = jnp.full((batch,), start, jnp.int32)
        out, keys, values = model.head.decode_entries(*pieces, model.embed[...], kv, at)
        # Written after the attention that read the cache, so XLA writes it in place.
        kv = write_entries(kv, keys, values, ordered_after(at, out))
        return kv.replace(lengths=at + pieces[1].shape[1])

    chunk = prefill.batch_chunk(width)  # as the target's
    if chunk == width:
        kv = call(kv, 0, (prev, prompts))
    else:
        inputs = (prefill.padded(prev, chunk), prefill.padded(prompts, chunk))
        kv = prefill.in_chunks(call, kv, inputs, prompt_lengths, chunk)
    kv = kv.replace(lengths=prompt_lengths)
    last = jnp.take_along_axis(features, (prompt_lengths - 1)[:, None, None], axis=1)
    pending = jnp.zeros((batch, config.gamma_max + 1, features.shape[-1]), features.dtype)
    return kv, pending.at[:, :1].set(last)


class _Prepared(struct.PyTreeNode):
    keys: tuple  # per layer [B, γ_max + 1, K, hd], the chunk's entries
    values: tuple
    x: jax.Array  # [B] the first draft
    q: jax.Array  # [B, V] its q
    predicted: jax.Array  # [B, 1, D] the head's feature at L - 1
    bad: jax.Array  # [B] NaN/inf met
    logits: jax.Array  # [B, K] the kept tokens' logits at L - 1


def _draft(model: AttachedHead, logits, key, config, sampling):
    """Kept-token logits [B, K] -> (token [B], q [B, V], NaN flag [B]): q is the softmax
    over the kept tokens after each row's sampling transforms, zero elsewhere."""
    full, q = head_tree.kept_probs(model, logits, config, sampling)
    return choose(key, full, q, sampling), q, nonfinite(logits)
