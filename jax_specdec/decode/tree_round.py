"""One tree round of the loop: the drafter builds a token tree, the target scores all its
nodes in one call, the walk (`decode.tree.walk`) accepts exactly, and the accepted
path's cache entries are written to consecutive positions.

The verify call runs on a read-only cache: node v sits at position L - 1 + depth(v) of
its row (L the row's length) and attends to the live prefix and to its ancestors
only. After the walk, the entries of the walked nodes (root first) are taken from the
call's output and written at L - 1 …, one update per layer, as a chain round writes
its entries; a drafter that reads features gets the walked nodes' features in the
same order, so it sees the round as a chain round that accepted the walk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters.base import DraftInputs, reads_features, target_features
from jax_specdec.decode.logprobs import token_logprobs
from jax_specdec.decode.noise import round_keys
from jax_specdec.decode.state import (
    LoopState,
    drafter_sampling,
    emit,
    gather_last,
    record_round,
    written_after,
)
from jax_specdec.decode.stats import nonfinite
from jax_specdec.decode.tree import (
    TreeProposal,
    ancestors,
    depths,
    gather_nodes,
    rank_counts,
    tree_draws,
)
from jax_specdec.nn import write_entries
from jax_specdec.penalties import adjust

__all__ = ["tree_noise", "tree_round", "walked_tree"]


def tree_noise(state: LoopState, config: LoopConfig):
    """(draft keys [B, D], node draws [B, N + 1, 2]) of the rows' round: fold_in(keys[b],
    round) split into a drafting and an acceptance key, as a chain round splits it."""
    tree, batch = config.tree, state.keys.shape[0]
    if state.sampling.greedy:
        return jnp.zeros((batch, tree.depth), jnp.int32), tree_draws(
            None, tree.nodes, state.sampling, batch
        )
    split = jax.vmap(jax.random.split)(round_keys(state.keys, state.round + 1))
    draft_keys = jax.vmap(lambda k: jax.random.split(k, tree.depth))(split[:, 0])
    return draft_keys, tree_draws(split[:, 1], tree.nodes, state.sampling, batch)


def verify_tree(target, cache, state: LoopState, proposal: TreeProposal, mask, draws, config):
    """The target's call over [pending, nodes] (`mask`: the nodes' `ancestors`) and the
    config's acceptance rule (`tree_accept.accept_tree`): (walk, the emitted tokens'
    `Logprobs` or None, whether a row's logits held NaN/inf, the call's entries per layer
    [B, N + 1, K, hd], features [B, N + 1, D] or None)."""
    pending = gather_last(state.tokens, state.lengths, 1)
    logits, keys, values, *hidden = target.decode_entries(
        jnp.concatenate([pending, proposal.tokens], axis=1),
        cache.replace(lengths=state.lengths - 1),
        features=target_features(config.drafter),
        tree=(depths(mask), mask),
    )
    logits = logits[..., : config.vocab_size]
    # Node v follows the pending token and its path's drafts (itself included): seen.
    adjusted = adjust(logits, state.sampling, state.seen, proposal.tokens, mask[:, :, 1:])
    found = config.acceptance(adjusted, draws, proposal, state.sampling, config.tree.depth)
    on_path = lambda a: jnp.take_along_axis(a, found.path[..., None], axis=1)  # noqa: E731
    scores = token_logprobs(
        on_path(logits), on_path(adjusted), found.emitted, state.sampling, config.logprobs
    )
    return (
        found,
        scores,
        nonfinite(logits),
        (keys, values),
        (hidden[0] if hidden else None),
    )


def tree_round(target, draft, state: LoopState, config: LoopConfig) -> LoopState:
    """One round: draft a tree, verify it in one call, walk it, write the walked entries."""
    drafter, depth = config.drafter, config.tree.depth
    noise = tree_noise(state, config)
    inputs = DraftInputs(
        state.tokens,
        state.lengths,
        state.done,
        noise[0],
        jnp.int32(depth),
        drafter_sampling(state),
    )
    draft_cache, prepared, _ = drafter.prepare(draft, state.draft_cache, inputs, config)
    light = state.replace(target_cache=None, draft_cache=None)
    light, walked, features = walked_tree(
        target, draft, state.target_cache, draft_cache, light, prepared, noise, config
    )
    before, after = state.lengths, light.lengths
    target_cache = write_entries(state.target_cache, *walked, written_after(before - 1, after))
    extra = {"features": features} if reads_features(drafter) else {}
    draft_cache = drafter.commit(draft_cache, prepared, None, before, after, depth, config, **extra)
    return light.replace(
        target_cache=target_cache.replace(lengths=after - 1), draft_cache=draft_cache
    )


def walked_tree(
    target, draft, target_cache, draft_cache, light, prepared, noise, config, menu=False
):
    """A tree round up to its cache writes, both caches only read: the drafter's tree
    (`config.tree`; `prepared`: its `prepare` output for the round; `noise`: the round's
    `tree_noise`), the verify call,
    the walk, the emitted tokens and the round's counts (`menu`: as a tree round of
    `Auto`'s menu, `record_round`). Returns (the state after, the walked nodes' entries
    per layer [B, D + 1, K, hd] root first, their features [B, D + 1, D'] or None)."""
    drafter, depth = config.drafter, config.tree.depth
    draft_keys, draws = noise
    active = ~light.done
    inputs = DraftInputs(
        light.tokens,
        light.lengths,
        light.done,
        draft_keys,
        jnp.int32(depth),
        drafter_sampling(light),
    )
    proposal = drafter.propose_tree(draft, draft_cache, inputs, prepared, config.tree, config)
    proposal = proposal._replace(valid=proposal.valid & active[:, None])
    mask = ancestors(proposal.parent, depth)
    found, scores, bad, entries, features = verify_tree(
        target, target_cache, light, proposal, mask, draws, config
    )
    light = emit(light, found.emitted, found.accepted + 1, config, scores)
    node_depth = depths(mask)[:, 1:]
    counts = jnp.max(jnp.where(proposal.valid, node_depth, 0), axis=1)  # longest path drafted
    light = record_round(
        light,
        active=active,
        width=depth,
        counts=counts,
        accepted=found.accepted,
        bad=bad | proposal.bad,
        menu_tree=menu,
        ranks=rank_counts(proposal, found, config.tree.branch),
    )
    walked = gather_nodes(entries, found.path)
    if reads_features(drafter):
        features = gather_nodes(features, found.path)
    return light, walked, features
