"""Token trees: their shape, their attention mask, and the exact acceptance walk.

A round's tree hangs under the root (node 0, the row's pending token); nodes 1 … N are
drafted tokens, each with a parent among the nodes before it (`parent[b, v] < v`), so
a node's depth is one more than its parent's. The structure is data ([B, N] arrays);
N and the largest depth D are static. A drafter may leave nodes unused (`valid`
false): they are never a parent of a valid node and are never walked to.

Acceptance with deterministic candidates (`walk`): the target's token y_v is drawn at
every node v from p at v's prefix with noise of the node's own; starting at the root,
the walk moves to the child whose token equals y_v while there is one. The emitted
tokens are the y's along the walk, so each is a draw of p at its prefix given the
tokens before it: the output is distributed exactly as autoregressive sampling from
the target (under greedy decoding y_v is the argmax, and the output is the
autoregressive one), whatever the tree holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_specdec.sampling import RowSampling, sample_with_uniforms

__all__ = [
    "Tree",
    "as_tree",
    "TreeProposal",
    "TreeWalk",
    "ancestors",
    "depths",
    "gather_nodes",
    "graft",
    "rank_counts",
    "target_tokens",
    "tree_draws",
    "walk",
]


@dataclasses.dataclass(frozen=True)
class Tree:
    """The static shape of a round's tree.

    Attributes:
      nodes: N, drafted tokens per round (the verify call scores N + 1 tokens).
      depth: D, the longest path below the root (tokens accepted per round at most).
      branch: k, children a feature head expands per node (its best k tokens, or k
        drawn from its q); the n-gram proposer ignores it.
      sampled: a feature head draws the children from its q and the round accepts them
        by recursive rejection (`decode.tree_accept`); False: its best k tokens, accepted
        by the walk; None (the default): sampled when the sampling is not greedy and
        `lookup` is 0.
      lookup: with a feature head, nodes given to prompt lookup: the trie of the
        continuations of the row's best earlier matches of its suffix (`NGram`), each
        up to `depth` tokens, grafted onto the head's tree of `nodes - lookup` nodes
        where it leaves it (`graft`). Its candidates are not drawn from the head's q, so
        such a tree is walked at every temperature (0: the head's tree alone).
    """

    nodes: int
    depth: int
    branch: int = 4
    sampled: bool | None = None
    lookup: int = 0

    @property
    def label(self) -> str:
        """NODES:DEPTH:BRANCH[:LOOKUP], as `--trees` takes it."""
        return f"{self.nodes}:{self.depth}:{self.branch}" + (
            f":{self.lookup}" if self.lookup else ""
        )

    def __post_init__(self):
        for name in ("nodes", "depth", "branch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Tree.{name} must be an integer >= 1, got {v!r}")
        if self.sampled not in (None, True, False):
            raise ValueError(f"Tree.sampled must be True, False or None, got {self.sampled!r}")
        if isinstance(self.lookup, bool) or not isinstance(self.lookup, int) or self.lookup < 0:
            raise ValueError(f"Tree.lookup must be an integer >= 0, got {self.lookup!r}")
        if self.lookup and self.sampled:
            raise ValueError(
                "Tree.lookup needs a walked tree (sampled False or None): prompt lookup's "
                "candidates are not draws from the head's q"
            )
        if self.lookup and self.nodes - self.lookup < self.depth:
            raise ValueError(
                f"Tree.lookup ({self.lookup}) leaves the head {self.nodes - self.lookup} of "
                f"Tree.nodes ({self.nodes}): fewer than Tree.depth ({self.depth})"
            )
        if self.depth > self.nodes:
            raise ValueError(
                f"Tree.depth ({self.depth}) exceeds Tree.nodes ({self.nodes}): a path of "
                "depth D needs D nodes"
            )


class TreeProposal(NamedTuple):
    """A round's tree.

    Attributes:
      tokens: [B, N] int32, node v + 1's token (node 0, the root, is the pending token).
      parent: [B, N] int32, node v + 1's parent in [0, v] (0: the root).
      valid: [B, N] bool, nodes the drafter filled (a valid node's parent is valid).
      bad: [B] bool, the drafter met NaN/inf logits.
      probs: [B, N + 1, V] float32, the q each node's children were drawn from (a
        sampled tree, `decode.tree_accept`), or None: deterministic candidates.
    """

    tokens: jax.Array
    parent: jax.Array
    valid: jax.Array
    bad: jax.Array
    probs: jax.Array | None = None


class TreeWalk(NamedTuple):
    """The outcome of the walk for each row.

    Attributes:
      path: [B, D + 1] int32, the nodes walked (root first); entries after
        `accepted` repeat the last node.
      accepted: [B] int32, drafted tokens kept (the walk's length below the root).
      emitted: [B, D + 1] int32, the tokens to append: the first accepted + 1.
    """

    path: jax.Array
    accepted: jax.Array
    emitted: jax.Array


def ancestors(parent: jax.Array, depth: int) -> jax.Array:
    """[B, N + 1, N + 1] bool: mask[b, v, u] is true where u is v or an ancestor of v
    (the root is every node's ancestor), for a tree of depth <= `depth`."""
    full = _with_root(parent)
    n = full.shape[1]
    rows = jnp.arange(parent.shape[0])[:, None]
    mask = jnp.broadcast_to(jnp.eye(n, dtype=bool), (parent.shape[0], n, n))
    at = full
    for _ in range(depth):
        mask = mask | jax.nn.one_hot(at, n, dtype=bool)
        at = full[rows, at]
    return mask


def depths(mask: jax.Array) -> jax.Array:
    """[B, N + 1] int32 depth of every node (root 0) from its `ancestors` mask."""
    return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1


def _with_root(parent: jax.Array) -> jax.Array:
    """[B, N] parents of nodes 1 … N -> [B, N + 1] with the root its own parent."""
    root = jnp.zeros((parent.shape[0], 1), jnp.int32)
    return jnp.concatenate([root, parent.astype(jnp.int32)], axis=1)


def tree_draws(keys, nodes: int, sampling: RowSampling, batch: int) -> jax.Array:
    """[B, N + 1, 2] float32 uniforms, two per node (its draw of the target's token, and
    its test as a sampled child), from each row's acceptance key [B] (zeros under greedy
    decoding, where nothing is drawn and `keys` may be None)."""
    if sampling.greedy:
        return jnp.zeros((batch, nodes + 1, 2), jnp.float32)
    return jax.vmap(lambda k: jax.random.uniform(k, (nodes + 1, 2), jnp.float32))(keys)


def target_tokens(logits: jax.Array, draws: jax.Array, sampling: RowSampling):
    """The target's token at nodes at [B] as a function (what `walk` takes), from its
    logits [B, N + 1, V] and the nodes' draws [B, N + 1]: the argmax under greedy
    decoding, else inverse CDF of p with the node's draw; p is made at the nodes asked
    for only (the walked ones), not at every node."""
    rows = jnp.arange(logits.shape[0])

    def token_at(at):
        if sampling.greedy:
            return jnp.argmax(logits[rows, at], axis=-1).astype(jnp.int32)
        return sample_with_uniforms(draws[rows, at], sampling.probs(logits[rows, at]))

    return token_at


def walk(proposal: TreeProposal, y, depth: int) -> TreeWalk:
    """The walk from the root (see the module docstring) given the target's token at
    every node: y [B, N + 1], or a function of nodes at [B] -> the tokens there [B] (so
    that only the nodes walked to are drawn); at most `depth` steps."""
    rows = jnp.arange(proposal.tokens.shape[0])
    token_at = y if callable(y) else (lambda at: y[rows, at])
    parent = proposal.parent.astype(jnp.int32)
    at = jnp.zeros(rows.shape, jnp.int32)
    alive = jnp.ones(rows.shape, bool)
    path, emitted = [at], []
    for _ in range(depth):
        wanted = token_at(at)
        emitted.append(wanted)
        match = (parent == at[:, None]) & proposal.valid & (proposal.tokens == wanted[:, None])
        found = alive & jnp.any(match, axis=1)
        at = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32) + 1, at)
        alive = found
        path.append(at)
    emitted.append(token_at(at))
    path = jnp.stack(path, axis=1)
    accepted = jnp.sum((path[:, 1:] != path[:, :-1]).astype(jnp.int32), axis=1)
    return TreeWalk(path, accepted, jnp.stack(emitted, axis=1).astype(jnp.int32))


def rank_counts(proposal: TreeProposal, found: TreeWalk, ranks: int):
    """Which children the walk tested and kept, by their rank among their siblings (a
    parent's children in node order; for a sampled tree, their drawing order): (tested,
    kept) [B, D, ranks] int32, D the walk's steps. At step d the walk tested children
    0 … j of its node and kept j, or tested all of them and kept none (its last step);
    a row with no valid node counts nothing, and ranks past `ranks` are not counted."""
    parent, valid = proposal.parent.astype(jnp.int32), proposal.valid
    n = parent.shape[1]
    before = jnp.tril(jnp.ones((n, n), bool), -1)[None]  # u < v
    siblings = (parent[:, :, None] == parent[:, None, :]) & valid[:, None, :] & before
    rank = jnp.pad(jnp.sum(siblings, axis=-1, dtype=jnp.int32), ((0, 0), (1, 0)))
    nodes = jnp.arange(n + 1, dtype=jnp.int32)
    children = jnp.sum((parent[:, None, :] == nodes[None, :, None]) & valid[:, None, :], -1)
    step = jnp.arange(found.path.shape[1] - 1)[None, :, None]  # [1, D, 1]
    j = jnp.arange(ranks)[None, None, :]
    moved = step < found.accepted[:, None, None]
    stopped = step == found.accepted[:, None, None]
    at = lambda a, idx: jnp.take_along_axis(a, idx, axis=1)[:, :, None]  # noqa: E731
    kept_rank = at(rank, found.path[:, 1:])
    count = at(children, found.path[:, :-1])
    tested = (moved & (j <= kept_rank)) | (stopped & (j < count))
    kept = moved & (j == kept_rank)
    return tested.astype(jnp.int32), kept.astype(jnp.int32)


def graft(base: TreeProposal, tokens, parent, valid) -> TreeProposal:
    """`base` with the tree (tokens, parent, valid) [B, M] (nodes numbered as in a
    `TreeProposal`, 0 the same root) merged in: a node whose path is already in `base`
    is dropped (left invalid), the others are appended as nodes N + 1 … N + M under
    their path's last node, in `base` or appended. Returns a `TreeProposal` of N + M
    nodes with `base`'s `bad` (and no q: its candidates are walked)."""
    rows = jnp.arange(base.tokens.shape[0])
    n, m = base.tokens.shape[1], tokens.shape[1]
    # image[:, v]: node v's node in the merged tree (an appended parent, past N, has no
    # child in base); shared[:, v - 1]: whether node v is one of base's.
    image = jnp.zeros((rows.shape[0], m + 1), jnp.int32)
    shared = jnp.zeros((rows.shape[0], m), bool)
    for v in range(1, m + 1):
        at = image[rows, parent[:, v - 1]]
        match = (base.parent == at[:, None]) & base.valid & (base.tokens == tokens[:, v - 1, None])
        found = valid[:, v - 1] & jnp.any(match, axis=1)
        here = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32) + 1, n + v)
        image = image.at[:, v].set(here)
        shared = shared.at[:, v - 1].set(found)
    up = jnp.take_along_axis(image, parent.astype(jnp.int32), axis=1)
    return TreeProposal(
        jnp.concatenate([base.tokens, tokens.astype(jnp.int32)], axis=1),
        jnp.concatenate([base.parent.astype(jnp.int32), up], axis=1),
        jnp.concatenate([base.valid, valid & ~shared], axis=1),
        base.bad,
    )


def gather_nodes(x: Any, path: jax.Array) -> Any:
    """Every [B, N + 1, ...] array of the pytree `x` taken along `path` [B, D + 1]."""

    def take(a):
        idx = path.reshape(path.shape + (1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, idx, axis=1)

    return jax.tree.map(take, x)


def as_tree(tree, schedule, drafter) -> Tree:
    """The `Tree` a `Generator`'s `tree` argument asks for: an int N (nodes; the depth
    is the schedule's γ) or a `Tree`, checked against the schedule and the drafter.
    Raises ValueError naming `tree` when they cannot go together."""
    gamma = schedule.max_gamma
    if schedule.min_gamma != gamma:
        raise ValueError(
            f"tree rounds have one shape: the schedule must be an int γ (the tree's depth), "
            f"got {type(schedule).__name__} with γ from {schedule.min_gamma} to {gamma}"
        )
    if isinstance(tree, Tree):
        if tree.depth != gamma:
            raise ValueError(f"tree.depth ({tree.depth}) must equal the schedule's γ ({gamma})")
    elif isinstance(tree, bool) or not isinstance(tree, int) or tree < 1:
        raise ValueError(f"tree must be a positive int (nodes) or a Tree, got {tree!r}")
    elif tree < gamma:
        raise ValueError(
            f"tree ({tree} nodes) cannot reach the schedule's γ ({gamma}), its depth: "
            "give at least γ nodes or a smaller γ"
        )
    else:
        tree = Tree(tree, gamma)
    check = getattr(drafter, "check_tree", None)
    if not hasattr(drafter, "propose_tree"):
        raise ValueError(
            f"tree needs a drafter that builds trees (NGram or a feature head), not "
            f"{type(drafter).__name__}"
        )
    if check is not None:
        check(tree)
    return tree
