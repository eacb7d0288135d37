"""The exact acceptance of a tree round (`accept_tree`): the walk for deterministic
candidates (`decode.tree.walk`), recursive rejection over sampled siblings for sampled
trees (RSD, Jeon et al. 2024, arXiv 2402.14160).

A sampled tree's shape is static (`static_shape`): which nodes exist, and how many
children each has, never depends on the tokens drawn. A node's children are drawn
without replacement from the drafter's q at that node (Gumbel top-m), in order, and the
proposal carries q at every node (`TreeProposal.probs`).

The walk (`accept_rsd`), at node u with target distribution p and draft q, tests u's
children x_1, x_2, … in their drawing order: x_j is kept with probability
min(1, p(x_j) / q(x_j)); after a rejection p becomes norm(max(0, p − q)) and q loses
x_j (renormalised: the law of the next child given the ones before it). A kept child
is emitted and the walk moves to it; when every child is rejected (or u has none) the
walk emits a draw of the current p and stops. Each step is the classic rejection step
for the distribution it is given, so every emitted token is a draw of the target's p
at its prefix (tested against an enumerated target in `tests/test_tree.py`). With one
child per node it is the chain's token-by-token rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_specdec.acceptance import RESIDUAL_FLOOR
from jax_specdec.decode.tree import TreeProposal, TreeWalk, target_tokens, walk
from jax_specdec.sampling import RowSampling, sample_with_uniforms

__all__ = ["accept_rsd", "accept_tree", "draw_children", "static_shape"]

#: The prior chance that a node's first drawn child is kept, and that a later one is
#: (after the rejections before it): `static_shape` grows the tree where the walk is
#: most likely to go, from these unless it is given a head's measured rates.
FIRST, LATER = 0.6, 0.3


def accept_tree(logits, draws, proposal: TreeProposal, sampling: RowSampling, depth: int):
    """The exact acceptance of a tree round from the target's logits [B, N + 1, V] and
    the nodes' noise `draws` [B, N + 1, 2] (`decode.tree.tree_draws`), at most `depth`
    steps: `accept_rsd` for a sampled tree (`proposal.probs` set), else the walk on the
    target's token drawn at every node. `Generator(acceptance=...)` with a tree takes a
    rule of this signature."""
    if proposal.probs is not None and not sampling.greedy:
        return accept_rsd(logits, draws, proposal, sampling, depth)
    return walk(proposal, target_tokens(logits, draws[..., 0], sampling), depth)


def static_shape(nodes: int, depth: int, branch: int, rates=None) -> tuple[int, ...]:
    """The parent of each of nodes 1 … N: greedily, the free slot (a node's next child,
    at most `branch` per node, depth at most `depth`) the walk reaches most often. A
    node's children get increasing numbers in their order.

    `rates[d][j]`: the chance that a node at depth d keeps its child j (0-based) after
    rejecting the ones before it (a head's measured acceptance,
    `GenerationStats.rank_acceptance`; the last row and column stand for deeper nodes
    and later children); None: the prior (FIRST, then LATER)."""
    rates = ((FIRST, LATER),) if rates is None else rates
    parent, reach, level, kids = [], [1.0], [0], [0]
    for _ in range(nodes):
        best = None
        for u in range(len(reach)):
            j = kids[u]
            if level[u] >= depth or j >= branch:
                continue
            chance = _slot_chance(rates[min(level[u], len(rates) - 1)], j)
            if best is None or reach[u] * chance > best[0]:
                best = (reach[u] * chance, u)
        if best is None:
            raise ValueError(
                f"a tree of depth {depth} with branch {branch} holds fewer than {nodes} nodes"
            )
        r, u = best
        parent.append(u)
        reach.append(r)
        level.append(level[u] + 1)
        kids[u] += 1
        kids.append(0)
    return tuple(parent)


def _slot_chance(rates, j: int) -> float:
    """The chance that child j is the one kept: children 0 … j-1 rejected, j kept."""
    rate = lambda i: rates[min(i, len(rates) - 1)]  # noqa: E731
    chance = rate(j)
    for i in range(j):
        chance *= 1.0 - rate(i)
    return chance


def draw_children(keys, q, count: int):
    """`count` tokens [B, count] drawn without replacement from q [B, V] (Gumbel top-k,
    in drawing order) with one key per row [B], and whether each was drawable (q > 0)."""
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, q.shape[-1:], jnp.float32))(keys)
    scores = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)) + gumbel, -jnp.inf)
    best, tokens = jax.lax.top_k(scores, count)
    return tokens.astype(jnp.int32), best > -jnp.inf


def _reject(p, q, x, rows):
    """p and q after the rejection of x: norm(max(0, p − q)) and q without x."""
    residual = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    p = jnp.where(mass > RESIDUAL_FLOOR, residual / jnp.where(mass > 0, mass, 1.0), p)
    q = q.at[rows, x].set(0.0)
    left = jnp.sum(q, axis=-1, keepdims=True)
    return p, q / jnp.where(left > 0, left, 1.0)


def accept_rsd(
    logits, draws, proposal: TreeProposal, sampling: RowSampling, depth: int, reject=None
):
    """The walk with recursive rejection (see the module docstring): logits [B, N + 1, V],
    draws [B, N + 1, 2] (per node: its final draw, its own test as a child),
    `proposal.probs` [B, N + 1, V] the q each node's children were drawn from. `reject`
    (p, q, x, rows) -> (p, q) after a rejection: the exact one unless a test swaps it.

    Only the children of the node walked to are tested, one sibling rank per step of a
    loop that ends when every row has kept a child or run out of them, and p is made
    only at the nodes walked to: the work over the vocabulary follows the walk's path
    (its depth and the siblings tested), not the tree's size."""
    reject = _reject if reject is None else reject
    rows = jnp.arange(proposal.tokens.shape[0])

    def p_at(at):  # the target's p [B, V] at node at [B]
        return sampling.probs(logits[rows, at])

    at, alive = jnp.zeros_like(rows, jnp.int32), jnp.ones(rows.shape, bool)
    p = final = p_at(at)
    path = [at]
    for level in range(depth):
        p = p if level == 0 else p_at(at)
        q = proposal.probs[rows, at].astype(jnp.float32)
        found, chosen, p = _test_children(p, q, draws, proposal, at, alive, reject)
        final = jnp.where((alive & ~found)[:, None], p, final)  # stops here: its residual
        alive = alive & found
        at = jnp.where(found, chosen, at)
        path.append(at)
    final = jnp.where(alive[:, None], p_at(at), final)  # walked to the end: a bonus
    path = jnp.stack(path, axis=1)
    accepted = jnp.sum((path[:, 1:] != path[:, :-1]).astype(jnp.int32), axis=1)
    last = sample_with_uniforms(draws[rows, at, 0], final)
    walked = jnp.take_along_axis(proposal.tokens, jnp.maximum(path[:, 1:] - 1, 0), axis=1)
    idx = jnp.arange(depth + 1)[None]
    drafted = jnp.pad(walked, ((0, 0), (0, 1)))
    emitted = jnp.where(idx < accepted[:, None], drafted, last[:, None]).astype(jnp.int32)
    return TreeWalk(path, accepted, emitted)


def _test_children(p, q, draws, proposal: TreeProposal, at, alive, reject):
    """Recursive rejection over the children of node `at` [B] (rows where `alive`), with
    p and q [B, V] there, in their drawing order (increasing node number): (found [B], the
    kept child [B], p [B, V] after the rejections: the residual to draw from where none
    was kept)."""
    rows = jnp.arange(at.shape[0])
    is_child = (proposal.parent == at[:, None]) & proposal.valid & alive[:, None]
    rank = jnp.cumsum(is_child, axis=1) * is_child  # a child's place among its siblings, 1…
    count = rank.max(axis=1)

    def testing(carry):
        j, found = carry[0], carry[1]
        return ~found & (j < count)

    def step(carry):
        j, found, chosen, p, q = carry
        on = testing(carry)
        v = jnp.argmax(rank == j + 1, axis=1).astype(jnp.int32) + 1  # the (j+1)-th child
        x = proposal.tokens[rows, v - 1]
        kept = on & (draws[rows, v, 1] * q[rows, x] < p[rows, x])
        new_p, new_q = reject(p, q, x, rows)
        rejected = (on & ~kept)[:, None]
        p, q = jnp.where(rejected, new_p, p), jnp.where(rejected, new_q, q)
        return j + 1, found | kept, jnp.where(kept, v, chosen), p, q

    start = (jnp.int32(0), jnp.zeros_like(alive), at, p, q)
    _, found, chosen, p, _ = jax.lax.while_loop(lambda c: jnp.any(testing(c)), step, start)
    return found, chosen, p
