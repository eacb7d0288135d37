"""A feature head's token tree (EAGLE-2's dynamic tree, Li et al. 2024, arXiv 2406.16858).

Level 1 holds the head's k most probable first tokens. Each further level expands the
k most probable nodes of the level before (the frontier) by their k most probable
children, in one head call over the k frontier entries; a node's score is the log
probability of its path (the head's softmax over its kept tokens, untransformed, so
greedy decoding ranks as sampling does). The tree keeps the N best-scored of all
candidates: a child never scores above its parent and comes after it, so the kept set
is closed under parents. The walk (`decode.tree.walk`) needs no q, so ranking by the
head's own probabilities leaves the output exact.

A frontier entry sits at the position of its depth and attends to the head's cache,
the round's chunk of verified entries, the entries of its ancestors in the tree and
itself. Nothing of the tree is written to the head's cache: after the round the
verify call's features of the walked path arrive as a chain round's would
(`HeadDrafter.commit`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_specdec.decode.stats import nonfinite
from jax_specdec.decode.tree import Tree, TreeProposal
from jax_specdec.decode.tree_accept import draw_children, static_shape

__all__ = ["best_nodes", "candidates", "capacity", "kept_probs", "propose_tree", "sampled_tree"]


def capacity(tree: Tree) -> int:
    """Candidates a head drafts for `tree`: k on level 1, k * k on each further level."""
    return tree.branch + (tree.depth - 1) * tree.branch**2


def _top(logits, k: int):
    """(log probabilities, kept-token indices) of the k best of [..., K] logits."""
    return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)


def propose_tree(model, cache, prepared, tree: Tree, keys, config, sampling) -> TreeProposal:
    """The head's tree of `tree.nodes` nodes for every row: EAGLE-2's (see the module
    docstring), or with sampling and unless `tree.sampled` is False a sampled tree of
    static shape (`sampled_tree`).

    `cache` is the drafter's `FeatureCache`, `prepared` its `prepare` output (the
    round's chunk of entries, the head's prediction at the pending position and its
    kept-token logits), `keys` [B] one drafting key per row and `sampling` the rows'
    `RowSampling`."""
    if tree.sampled or (tree.sampled is None and not sampling.greedy):
        return sampled_tree(model, cache, prepared, tree, keys, config, sampling)
    scores, tokens, parents, bad = candidates(model, cache, prepared, tree)
    return TreeProposal(*best_nodes(scores, tokens, parents, tree), bad)


def kept_probs(model, logits, config, sampling):
    """Kept-token logits [B, ..., K] -> (full logits [B, ..., V], q [B, ..., V]): the
    kept tokens' logits after the rows' bias and penalties (`RowSampling.adjust`), -inf
    elsewhere, and their softmax after each row's sampling transforms."""
    ids = model.head.vocab_map[...]
    full = jnp.full((*logits.shape[:-1], config.vocab_size), -jnp.inf, jnp.float32)
    full = full.at[..., ids].set(logits.astype(jnp.float32), unique_indices=True)
    full = sampling.adjust(full)
    return full, sampling.probs(full)


def sampled_tree(model, cache, prepared, tree: Tree, keys, config, sampling) -> TreeProposal:
    """A tree of `tree_accept.static_shape` (grown from the head's measured acceptance,
    `FeatureHeadConfig.tree_acceptance`, if it has one): each node's children drawn without
    replacement from the head's q there (its kept tokens after the sampling transforms),
    level by level, each level's inner nodes in one head call; q at every node is
    returned for the acceptance (`tree_accept.accept_rsd`). A child past q's support
    (fewer tokens left by top-k or top-p than the node has children), and every node
    below it, is invalid: never tested."""
    # the head's measured acceptance (a feature head's; an EAGLE-3 head carries none)
    rates = getattr(model.head.config, "tree_acceptance", ()) or None
    parent = static_shape(tree.nodes, tree.depth, tree.branch, rates)
    level = [0]
    for u in parent:
        level.append(level[u] + 1)
    kids = [[v for v in range(1, tree.nodes + 1) if parent[v - 1] == u] for u in range(len(level))]
    p, batch = prepared, prepared.logits.shape[0]
    tokens = [None] * (tree.nodes + 1)
    probs = [None] * (tree.nodes + 1)
    # a child past q's support (top-k, top-p below the branch) is no draw: left invalid
    valid = [jnp.ones((batch,), bool)] + [None] * tree.nodes
    predicted = {0: p.predicted}  # each inner node's predicted feature [B, 1, D]
    bad = p.bad

    def expand(u, q):
        probs[u] = q
        if kids[u]:
            key = jax.vmap(jax.random.fold_in)(keys, jnp.full((batch,), u, jnp.int32))
            drawn, drawable = draw_children(key, q, len(kids[u]))
            for j, v in enumerate(kids[u]):
                tokens[v], valid[v] = drawn[:, j], valid[u] & drawable[:, j]

    expand(0, kept_probs(model, p.logits, config, sampling)[1])
    chunk_valid = jnp.arange(cache.features.shape[1])[None] < cache.count[:, None]
    recent = [(p.keys, p.values, chunk_valid)]
    earlier = []  # (keys, values, nodes) of each level's inner nodes
    start = cache.kv.lengths + cache.count  # L, level 1's position
    for depth in range(1, tree.depth):
        inner = [v for v in range(1, tree.nodes + 1) if level[v] == depth and kids[v]]
        if not inner:
            break
        parts = [
            (k, v, jnp.asarray([[_is_ancestor(parent, w, x) for w in nodes] for x in inner])[None])
            for k, v, nodes in earlier
        ]
        feats, keys_, values = model.head.decode_entries(
            jnp.concatenate([predicted[parent[v - 1]] for v in inner], axis=1),
            jnp.stack([tokens[v] for v in inner], axis=1),
            model.embed[...],
            cache.kv,
            jnp.broadcast_to((start + depth - 1)[:, None], (batch, len(inner))),
            recent + parts,
            own=jnp.eye(len(inner), dtype=bool)[None],
        )
        logits = model.head.logits(feats)  # [B, inner, K]
        bad = bad | nonfinite(logits.reshape(batch, -1))
        q = kept_probs(model, logits, config, sampling)[1]
        for i, v in enumerate(inner):
            predicted[v] = feats[:, i : i + 1]
            expand(v, q[:, i])
        earlier.append((keys_, values, inner))
    zeros = jnp.zeros_like(probs[0])
    return TreeProposal(
        jnp.stack(tokens[1:], axis=1),
        jnp.broadcast_to(jnp.asarray(parent, jnp.int32), (batch, tree.nodes)),
        jnp.stack(valid[1:], axis=1),
        bad,
        jnp.stack([zeros if q is None else q for q in probs], axis=1),
    )


def _is_ancestor(parent, w: int, v: int) -> bool:
    """Whether node w is an ancestor of node v (nodes numbered from 1, 0 the root)."""
    while v:
        v = parent[v - 1]
        if v == w:
            return True
    return False


def candidates(model, cache, prepared, tree: Tree):
    """Every candidate of the expansion, level by level: (path log probabilities [B, C],
    token ids [B, C], parent candidate indices [B, C] (-1: the root), NaN flags [B]),
    C = `capacity(tree)`; level l + 1's candidates are the frontier's children, k per
    frontier node in the frontier's order (best first)."""
    k, p = tree.branch, prepared
    batch = p.logits.shape[0]
    ids = model.head.vocab_map[...]
    score, kept = _top(p.logits, k)  # level 1: [B, k]
    scores, tokens, parents = [score], [ids[kept]], [jnp.full((batch, k), -1, jnp.int32)]
    chunk_valid = jnp.arange(cache.features.shape[1])[None] < cache.count[:, None]
    recent = [(p.keys, p.values, chunk_valid)]
    position = cache.kv.lengths + cache.count  # L, the first level's position
    front_prev = jnp.broadcast_to(p.predicted, (batch, k, p.predicted.shape[-1]))
    front, front_ids = score, jnp.arange(k, dtype=jnp.int32)[None].repeat(batch, 0)
    front_tokens, anc = tokens[0], jnp.zeros((batch, k, 0), bool)
    bad, entries = p.bad, []  # entries: per level, the frontier's keys and values
    offset = k  # candidate index of the next level's first
    for level in range(1, tree.depth):
        predicted, keys, values = model.head.decode_entries(
            front_prev,
            front_tokens,
            model.embed[...],
            cache.kv,
            jnp.broadcast_to((position + level - 1)[:, None], (batch, k)),
            recent + _ancestor_parts(entries, anc),
            own=jnp.eye(k, dtype=bool)[None],
        )
        logits = model.head.logits(predicted)  # [B, k, K]
        bad = bad | nonfinite(logits.reshape(batch, -1))
        step, kept = _top(logits, k)  # [B, k, k]
        child = (front[:, :, None] + step).reshape(batch, k * k)
        scores.append(child)
        tokens.append(ids[kept].reshape(batch, k * k))
        parents.append(jnp.repeat(front_ids, k, axis=1))
        entries = [*entries, (keys, values)]
        front, pick = jax.lax.top_k(child, k)  # the next frontier, [B, k]
        owner = pick // k  # which frontier node each is a child of
        front_ids = offset + pick.astype(jnp.int32)
        front_tokens = jnp.take_along_axis(tokens[-1], pick, axis=1)
        front_prev = jnp.take_along_axis(predicted, owner[:, :, None], axis=1)
        here = jax.nn.one_hot(owner, k, dtype=bool)  # the parent's entry, this level
        anc = jnp.concatenate([jnp.take_along_axis(anc, owner[:, :, None], axis=1), here], -1)
        offset += k * k
    cat = lambda parts: jnp.concatenate(parts, axis=1)  # noqa: E731
    return cat(scores), cat(tokens), cat(parents), bad


def _ancestor_parts(entries, anc):
    """The earlier levels' entries as `recent` parts, each frontier node seeing only its
    ancestors' (`anc` [B, k, k * levels] over them, level by level)."""
    k = anc.shape[1]
    return [
        (keys, values, anc[:, :, i * k : (i + 1) * k]) for i, (keys, values) in enumerate(entries)
    ]


def best_nodes(scores, tokens, parents, tree: Tree):
    """The `tree.nodes` best candidates as a tree.

    Args:
      scores: [B, C] path log probabilities, a child's at most its parent's.
      tokens: [B, C] int32 token ids.
      parents: [B, C] int32 candidate index of each parent (before it; -1: the root).
      tree: the shape.

    Returns:
      (tokens, parent, valid) [B, N] as `TreeProposal` holds them, in candidate order.
    """
    batch = scores.shape[0]
    _, chosen = jax.lax.top_k(scores, tree.nodes)  # ties: the earlier candidate first
    chosen = jnp.sort(chosen, axis=1).astype(jnp.int32)  # a parent before its children
    rows = jnp.arange(batch)[:, None]
    node_of = (
        jnp.zeros(scores.shape, jnp.int32)
        .at[rows, chosen]
        .set(jnp.arange(1, tree.nodes + 1, dtype=jnp.int32)[None])
    )
    parent_cand = jnp.take_along_axis(parents, chosen, axis=1)
    parent = jnp.where(parent_cand < 0, 0, node_of[rows, jnp.maximum(parent_cand, 0)])
    chosen_tokens = jnp.take_along_axis(tokens, chosen, axis=1)
    return chosen_tokens.astype(jnp.int32), parent, jnp.ones(chosen.shape, bool)
