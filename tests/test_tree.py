"""Tree rounds: the tree's structure and mask, the walk against a NumPy reference, the
n-gram trie, a head's tree against EAGLE-2's expansion, and stub drafters of fixed tree
shapes: greedy equality with autoregressive decoding and the enumerated exactness test
over tree shapes and sampling settings. The drafters' tree rounds (greedy equality,
enumerated sampling, a wrong walk or recursive rejection caught, rows independent of
the batch) are tests/test_drafter_contract.py's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    VOCAB,
    assert_follows_target,
    cli_refusal,
    copies_outside_entry,
    make_draft,
    make_head,
    ragged_prompts,
    sample_sequences,
)

from jax_specdec import Generator, NGram
from jax_specdec.acceptance import accept_block_with_noise
from jax_specdec.decode.drafters.base import DraftInputs
from jax_specdec.decode.drafters.head_tree import candidates
from jax_specdec.decode.drafters.ngram import trie
from jax_specdec.decode.tree import (
    Tree,
    TreeProposal,
    TreeWalk,
    ancestors,
    depths,
    graft,
    rank_counts,
    target_tokens,
    walk,
)
from jax_specdec.decode.tree_accept import accept_rsd, draw_children, static_shape
from jax_specdec.sampling import RowSampling, SamplingConfig
from jax_specdec.schedules import Heuristic

# A star of 3 children, a path of 3, and a depth-3 tree of 7 nodes (parent of node v+1).
SHAPES = {
    "star3": (0, 0, 0),
    "path3": (0, 1, 2),
    "tree7": (0, 0, 1, 1, 2, 4, 4),
}


def _depth(parents) -> int:
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return max(d)


@dataclasses.dataclass(frozen=True)
class FixedTree(NGram):
    """A stub drafter: a tree of the given shape whose tokens are drawn uniformly with
    the round's draft keys (sampling), or follow the last token (greedy)."""

    parents: tuple = ()

    def prepare(self, model, cache, inputs, config):
        return None, None, None

    def propose_tree(self, model, cache, inputs, prepared, tree, config):
        batch, n = inputs.lengths.shape[0], len(self.parents)
        if inputs.sampling.greedy:
            last = jnp.take_along_axis(inputs.tokens, inputs.lengths[:, None] - 1, axis=1)
            tokens = (last + jnp.arange(n)[None] // 2) % config.vocab_size
        else:
            draw = lambda k: jax.random.randint(k, (n,), 0, config.vocab_size)  # noqa: E731
            tokens = jax.vmap(draw)(inputs.keys[:, 0])
        parent = jnp.broadcast_to(jnp.asarray(self.parents, jnp.int32), (batch, n))
        valid = jnp.ones((batch, n), bool)
        return TreeProposal(tokens.astype(jnp.int32), parent, valid, jnp.zeros((batch,), bool))


Q_FIXED = (0.3, 0.05, 0.25, 0.1, 0.2, 0.1)  # the sampled stub's q, at every node


@dataclasses.dataclass(frozen=True)
class SampledTree(NGram):
    """A stub drafter: a tree of the given shape whose children are drawn without
    replacement from Q_FIXED with the round's draft keys, q carried for RSD."""

    parents: tuple = ()

    def prepare(self, model, cache, inputs, config):
        return None, None, None

    def propose_tree(self, model, cache, inputs, prepared, tree, config):
        batch, n = inputs.lengths.shape[0], len(self.parents)
        q = jnp.broadcast_to(jnp.asarray(Q_FIXED, jnp.float32), (batch, VOCAB))
        tokens, valid = [None] * n, [None] * n
        for u in range(n + 1):
            kids = [v for v in range(n) if self.parents[v] == u]
            if kids:
                keys = jax.vmap(jax.random.fold_in)(inputs.keys[:, 0], jnp.full(batch, u))
                drawn, ok = draw_children(keys, q, len(kids))
                for j, v in enumerate(kids):
                    tokens[v], valid[v] = drawn[:, j], ok[:, j]
        parent = jnp.broadcast_to(jnp.asarray(self.parents, jnp.int32), (batch, n))
        probs = jnp.broadcast_to(q[:, None], (batch, n + 1, VOCAB))
        bad = jnp.zeros((batch,), bool)
        return TreeProposal(jnp.stack(tokens, 1), parent, jnp.stack(valid, 1), bad, probs)


def fixed(shape: str):
    parents = SHAPES[shape]
    return FixedTree(parents=parents), Tree(len(parents), _depth(parents))


# ---------------------------------------------------------------- structure

# Compiled once each (called eagerly, every operation would be a program of its own).
_ancestors = jax.jit(ancestors, static_argnums=1)
_depths = jax.jit(depths)
_walk = jax.jit(walk, static_argnums=2)
_rank_counts = jax.jit(rank_counts, static_argnums=2)
_trie = jax.jit(trie, static_argnums=2)
_target_tokens = jax.jit(lambda logits, draws, rows, at: target_tokens(logits, draws, rows)(at))


def test_ancestors_and_depths_of_a_known_tree():
    parent = jnp.asarray([SHAPES["tree7"]], jnp.int32)
    mask = np.asarray(_ancestors(parent, 3))[0]
    assert np.asarray(_depths(jnp.asarray(mask[None])))[0].tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    assert np.flatnonzero(mask[7]).tolist() == [0, 1, 4, 7]  # 7 -> 4 -> 1 -> root
    assert np.flatnonzero(mask[5]).tolist() == [0, 2, 5]
    assert mask.sum() == 1 + 2 + 2 + 3 + 3 + 3 + 4 + 4  # itself and its ancestors (depth + 1)


def _walk_reference(tokens, parent, valid, y, depth):
    at, path = 0, [0]
    for _ in range(depth):
        kids = [v + 1 for v in range(len(tokens)) if parent[v] == at and valid[v]]
        nxt = [c for c in kids if tokens[c - 1] == y[at]]
        if not nxt:
            break
        at = nxt[0]
        path.append(at)
    return path, [y[v] for v in path]


def _random_trees(batch, n, depth, vocab, seed=0):
    """Random trees (node v+1 under a random node before it, about 10% invalid, none
    deeper than `depth`) and a target token at every node: (proposal, tokens, parent,
    valid, y) as NumPy arrays beside the proposal."""
    rng = np.random.default_rng(seed)
    parent = np.zeros((batch, n), np.int32)
    for v in range(1, n):  # a random tree: node v+1 hangs under a node before it
        parent[:, v] = rng.integers(0, v + 1, size=batch)
    mask = np.asarray(_ancestors(jnp.asarray(parent), n))
    too_deep = np.asarray(_depths(jnp.asarray(mask)))[:, 1:] > depth
    valid = (rng.random((batch, n)) < 0.9) & ~too_deep
    for v in range(n):  # a valid node's parent is valid
        valid[:, v] &= (parent[:, v] == 0) | valid[
            np.arange(batch), np.maximum(parent[:, v] - 1, 0)
        ]
    tokens = rng.integers(0, vocab, size=(batch, n)).astype(np.int32)
    y = rng.integers(0, vocab, size=(batch, n + 1)).astype(np.int32)
    proposal = TreeProposal(*map(jnp.asarray, (tokens, parent, valid)), jnp.zeros(batch, bool))
    return proposal, tokens, parent, valid, y


def test_walk_matches_a_numpy_reference():
    batch, n, depth = 64, 9, 4
    proposal, tokens, parent, valid, y = _random_trees(batch, n, depth, vocab=3)
    got = _walk(proposal, jnp.asarray(y), depth)
    assert isinstance(got, TreeWalk)
    got = TreeWalk(*map(np.asarray, got))
    lengths = []
    for b in range(batch):
        path, emitted = _walk_reference(tokens[b], parent[b], valid[b], y[b], depth)
        a = int(got.accepted[b])
        assert a == len(path) - 1
        assert got.path[b, : a + 1].tolist() == path
        assert got.emitted[b, : a + 1].tolist() == emitted
        lengths.append(a)
    assert max(lengths) >= 2  # the random trees are walked deep enough to test something


def test_rank_counts_match_a_numpy_reference():
    """At each step the walk tested its node's children up to the one it kept (ranks in
    node order among valid siblings), or all of them at its last step; ranks past the
    counters' width are not counted."""
    batch, n, depth, ranks = 128, 9, 4, 3
    proposal, tokens, parent, valid, y = _random_trees(batch, n, depth, vocab=2, seed=1)
    found = _walk(proposal, jnp.asarray(y), depth)
    tested, kept = map(np.asarray, _rank_counts(proposal, found, ranks))
    want_tested = np.zeros((batch, depth, ranks), np.int32)
    want_kept = np.zeros_like(want_tested)
    for b in range(batch):

        def kids(u, b=b):
            return [v for v in range(1, n + 1) if valid[b, v - 1] and parent[b, v - 1] == u]

        path, _ = _walk_reference(tokens[b], parent[b], valid[b], y[b], depth)
        for d, u in enumerate(path[:depth]):
            if d + 1 < len(path):
                r = kids(u).index(path[d + 1])
                want_tested[b, d, : r + 1] = 1
                want_kept[b, d, r : r + 1] = 1
            else:
                want_tested[b, d, : len(kids(u))] = 1
    np.testing.assert_array_equal(tested, want_tested)
    np.testing.assert_array_equal(kept, want_kept)
    assert want_kept[:, :, 1:].sum() > 20 and want_tested[:, :, 2].sum() > 5


def test_target_tokens_draw_each_node_from_its_own_p():
    logits = jnp.log(jnp.asarray([[[0.5, 0.5, 0.0], [0.0, 0.2, 0.8]]]))
    draws = jnp.asarray([[0.6, 0.1]])

    def y(temperature):  # the target's token at nodes 0 and 1
        rows = RowSampling.of([SamplingConfig(temperature)])
        return [int(_target_tokens(logits, draws, rows, jnp.asarray([v]))[0]) for v in (0, 1)]

    assert y(1.0) == [1, 1]  # inverse CDF: 0.6 -> 1; 0.1 -> 1
    assert y(0.0) == [0, 2]


def test_trie_merges_shared_prefixes_and_cuts_at_its_size():
    seqs = jnp.asarray([[[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]]], jnp.int32)
    lengths = jnp.asarray([[3, 3, 2, 1]], jnp.int32)
    tokens, parent, valid = map(np.asarray, _trie(seqs, lengths, 8))
    assert tokens[0, :6].tolist() == [1, 2, 3, 4, 5, 7]
    assert parent[0, :6].tolist() == [0, 1, 2, 2, 1, 0]
    assert valid[0].tolist() == [True] * 6 + [False] * 2
    tokens, parent, valid = map(np.asarray, _trie(seqs, lengths, 4))
    assert tokens[0].tolist() == [1, 2, 3, 4] and valid[0].all()


def test_graft_appends_only_the_paths_the_base_lacks():
    # Base: 1 -> 2 and 3 under the root. Grafted: 1 -> 2 -> 5 -> 8, 4 under the root, and
    # an invalid 6 with an invalid child 7: 1 and 2 are base's, 5, 8 and 4 are appended.
    base = TreeProposal(
        jnp.asarray([[1, 2, 3]], jnp.int32),
        jnp.asarray([[0, 1, 0]], jnp.int32),
        jnp.ones((1, 3), bool),
        jnp.zeros((1,), bool),
    )
    tokens = jnp.asarray([[1, 2, 5, 8, 4, 6, 7]], jnp.int32)
    parent = jnp.asarray([[0, 1, 2, 3, 0, 0, 6]], jnp.int32)
    valid = jnp.asarray([[True] * 5 + [False] * 2])
    got = jax.jit(graft)(base, tokens, parent, valid)
    assert np.asarray(got.tokens)[0].tolist() == [1, 2, 3, 1, 2, 5, 8, 4, 6, 7]
    assert np.asarray(got.parent)[0, 5:8].tolist() == [2, 6, 0]  # 5 under base's 2
    assert np.asarray(got.valid)[0].tolist() == [True] * 3 + [False] * 2 + [True] * 3 + [False] * 2
    y = jnp.asarray([[1, 2, 5, 0, 0, 0, 8, 9, 0, 0, 0]], jnp.int32)  # the target's, per node
    found = _walk(got, y, 4)
    assert np.asarray(found.path)[0].tolist() == [0, 1, 2, 6, 7]
    assert np.asarray(found.emitted)[0].tolist() == [1, 2, 5, 8, 9]


def test_ngram_matches_start_with_the_lookup_proposal():
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 4, size=(32, 40)), jnp.int32)
    lengths = jnp.asarray(rng.integers(2, 40, size=32), jnp.int32)
    ngram = NGram(3, 1)
    proposed, count = jax.jit(ngram.lookup, static_argnums=2)(tokens, lengths, 4)
    found, found_len = jax.jit(ngram.matches, static_argnums=(2, 3))(tokens, lengths, 5, 4)
    np.testing.assert_array_equal(np.asarray(found_len[:, 0]), np.asarray(count))
    keep = np.arange(4)[None] < np.asarray(count)[:, None]
    np.testing.assert_array_equal(
        np.where(keep, np.asarray(found[:, 0]), 0), np.where(keep, np.asarray(proposed), 0)
    )
    assert (np.asarray(found_len[:, 1]) > 0).sum() > 10  # second matches exist


# ---------------------------------------------------------------- greedy


@pytest.mark.slow
def test_greedy_fixed_tree_emits_the_autoregressive_tokens(target):
    drafter, tree = fixed("tree7")
    prompts = ragged_prompts(6, VOCAB, seed=4, max_len=12)
    kwargs = dict(key=jax.random.key(0), max_new_tokens=16)
    ar = Generator(target)(prompts, **kwargs)
    out = Generator(target, drafter, schedule=tree.depth, tree=tree)(prompts, **kwargs)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    assert int(out.stats.accepted.sum()) > 0


# ---------------------------------------------------------------- exactness

EXACTNESS = {
    "star3_t0.7": ("star3", SamplingConfig(0.7), None),
    "path3_t1": ("path3", SamplingConfig(1.0), 2),
    "tree7_t1_topp0.8": ("tree7", SamplingConfig(1.0, top_p=0.8), None),
    "tree7_t0.7": ("tree7", SamplingConfig(0.7), 2),
}


def _tree_samples(target, drafter, tree, sampling, eos, seed, **kwargs):
    return sample_sequences(target, drafter, sampling, tree.depth, eos, seed, tree=tree, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXACTNESS))
def test_tree_samples_follow_the_target(target, name):
    shape, sampling, eos = EXACTNESS[name]
    drafter, tree = fixed(shape)
    seqs, stats = _tree_samples(target, drafter, tree, sampling, eos, seed=len(name))
    assert 0.05 < stats.acceptance_rate < 0.95
    assert_follows_target(target, seqs, sampling, eos, name)


RSD = {
    "star3_t1": ("star3", SamplingConfig(1.0), None),
    "tree7_t0.7_topp0.8": ("tree7", SamplingConfig(0.7, top_p=0.8), 2),
    "path3_t1_topk3": ("path3", SamplingConfig(1.0, top_k=3), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RSD))
def test_sampled_tree_samples_follow_the_target(target, name):
    shape, sampling, eos = RSD[name]
    tree = fixed(shape)[1]
    drafter = SampledTree(parents=SHAPES[shape])
    seqs, stats = _tree_samples(target, drafter, tree, sampling, eos, seed=len(name) + 50)
    assert 0.05 < stats.acceptance_rate < 0.95
    # every step the walk took kept one child of some rank, and tested it
    kept, tested = np.asarray(stats.rank_kept), np.asarray(stats.rank_tested)
    np.testing.assert_array_equal(kept.sum(-1), np.asarray(stats.accepted_at))
    assert (tested >= kept).all() and (shape == "path3" or tested[:, :, 1:].sum() > 0)
    assert_follows_target(target, seqs, sampling, eos, name)


def test_static_shapes_grow_where_the_walk_goes():
    assert static_shape(8, 6, 2) == (0, 1, 2, 3, 0, 4, 1, 5)
    assert static_shape(3, 1, 4) == (0, 0, 0)  # depth 1: a star
    assert static_shape(3, 3, 1) == (0, 1, 2)  # branch 1: a chain
    with pytest.raises(ValueError, match="holds fewer than 4 nodes"):
        static_shape(4, 1, 3)
    # measured rates: a head whose first child is nearly always kept grows a chain; one
    # whose later children are kept nearly as often as its first, a star
    assert static_shape(4, 4, 4, ((0.9, 0.05),)) == (0, 1, 2, 3)
    assert static_shape(4, 4, 4, ((0.3, 0.3),)) == (0, 0, 0, 0)
    # rates by depth: sure at the root's first child, unsure below it
    assert static_shape(5, 3, 4, ((0.95, 0.1), (0.2, 0.2))) == (0, 1, 1, 1, 1)
    assert static_shape(8, 6, 2, ((0.6, 0.3),)) == static_shape(8, 6, 2)  # the prior


def test_recursive_rejection_tests_the_walked_nodes_children_only():
    """accept_rsd's program has the same size for 8 and 32 nodes: it tests the children of
    the node walked to, not every node at every depth (which cost 64 passes over the
    vocabulary per round for a tree of 8 nodes and depth 8)."""
    sampling = jax.tree.map(jnp.asarray, RowSampling.of([SamplingConfig(1.0)] * 2))
    sizes = []
    for nodes in (8, 32):
        proposal = TreeProposal(
            jnp.zeros((2, nodes), jnp.int32),
            jnp.asarray([static_shape(nodes, 4, 8)] * 2, jnp.int32),
            jnp.ones((2, nodes), bool),
            jnp.zeros((2,), bool),
            jnp.full((2, nodes + 1, 16), 1 / 16),
        )
        logits, draws = jnp.zeros((2, nodes + 1, 16)), jnp.zeros((2, nodes + 1, 2))
        rule = functools.partial(accept_rsd, sampling=sampling, depth=4)
        sizes.append(len(jax.make_jaxpr(rule)(logits, draws, proposal).eqns))
    assert sizes[0] == sizes[1]


# ---------------------------------------------------------------- HLO


@pytest.mark.parametrize("drafter", ["ngram", "head", "sampled head"])
@pytest.mark.slow
def test_tree_round_copies_no_cache(target, drafter):
    """No cache is copied inside the loop: the target's, nor a head's (same shape here)."""
    draft = NGram() if drafter == "ngram" else make_head(target, seed=3)
    sampling = SamplingConfig(1.0 if drafter == "sampled head" else 0.0)
    run = Generator(target, draft, schedule=3, tree=6, sampling=sampling).bind(
        ragged_prompts(4, VOCAB, seed=2), key=jax.random.key(0), max_new_tokens=8
    )
    hlo = run.lower().compile().as_text()
    c = target.config
    shape = f"[4,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
    assert shape in hlo
    assert copies_outside_entry(hlo, shape) == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tree=0), "tree must be a positive int"),
        (dict(tree=2.5), "tree must be a positive int"),
        (dict(tree=2, schedule=3), "cannot reach the schedule's γ (3)"),
        (dict(tree=Tree(6, 2), schedule=3), "tree.depth (2) must equal the schedule's γ (3)"),
        (dict(tree=6, schedule=Heuristic(4)), "the schedule must be an int γ"),
    ],
)
def test_bad_tree_arguments_are_refused_naming_them(target, kwargs, words):
    with pytest.raises(ValueError) as err:
        Generator(target, NGram(), **kwargs)
    assert words in str(err.value)


def test_a_tree_needs_a_drafter_that_builds_trees(target):
    with pytest.raises(ValueError, match="tree needs a drafter that builds trees"):
        Generator(target, make_draft(), schedule=3, tree=6)
    with pytest.raises(ValueError, match="tree need a draft"):
        Generator(target, tree=6)
    with pytest.raises(ValueError, match="Tree.nodes must be an integer >= 1"):
        Tree(0, 1)


# ---------------------------------------------------------------- a feature head's tree

WIDTH = 24  # the reference pads every sequence to one shape


@nnx.jit
def _head_pass(head, prev, tokens, embed):
    return head(prev, tokens, embed)


def _reference_logits(target, head, seq, pending_at):
    """The head's kept-token logits after `seq` (prompt, pending token, then drafted
    tokens) by full passes: the target's true features up to the pending token, the
    head's own predictions after it."""
    embed, d = target.embed[...], target.config.d_model
    pad = lambda t: jnp.asarray([t + [0] * (WIDTH - len(t))])  # noqa: E731
    _, true = target(pad(seq[:pending_at]), features=True)
    prev = np.zeros((1, WIDTH, d), np.float32)
    prev[0, 1 : pending_at + 1] = np.asarray(true)[0, :pending_at]
    for i in range(pending_at, len(seq)):
        logits, predicted = _head_pass(head, jnp.asarray(prev), pad(seq), embed)
        if i + 1 < len(seq):
            prev[0, i + 1] = np.asarray(predicted)[0, i]
    return np.asarray(logits, np.float64)[0, len(seq) - 1]


def _reference_tree(target, head, seq, tree):
    """EAGLE-2's expansion and selection, node by node from `_reference_logits`."""
    ids, k, pending_at = np.asarray(head.vocab_map[...]), tree.branch, len(seq) - 1

    def best(path):
        logits = _reference_logits(target, head, seq + path, pending_at)
        lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        order = np.argsort(-lp, kind="stable")[:k]
        return [(lp[i], int(ids[i])) for i in order]

    cands = [(s, t, -1, [t]) for s, t in best([])]  # (score, token, parent, path)
    frontier = list(range(k))
    for _ in range(1, tree.depth):
        children = []
        for f in frontier:
            score, _, _, path = cands[f]
            children += [(score + s, t, f, path + [t]) for s, t in best(path)]
        first = len(cands)
        cands += children
        ranked = sorted(range(len(children)), key=lambda i: -children[i][0])
        frontier = [first + i for i in ranked[:k]]
    return cands


def _head_round(target, head, tree, prompt, sampling=SamplingConfig(0.0)):
    """A head's first round after `prompt` up to its tree: (drafter, model, cache, inputs,
    prepared, config, the pending token)."""
    gen = Generator(target, head, schedule=tree.depth, tree=tree, sampling=sampling)
    config = gen.bind([prompt], key=jax.random.key(0), max_new_tokens=8).config
    model, drafter = gen.draft_model, gen.drafter
    prompts, lengths = jnp.asarray([prompt]), jnp.asarray([len(prompt)], jnp.int32)
    logits, features = target(prompts, features=True)
    pending = int(np.argmax(np.asarray(logits)[0, -1]))
    cache = drafter.init(model, prompts, lengths, config, features=features)
    buffer = (
        jnp.zeros((1, 16), jnp.int32).at[0, : len(prompt) + 1].set(jnp.asarray(prompt + [pending]))
    )
    rows = jax.tree.map(jnp.asarray, RowSampling.of([sampling]))
    keys = jax.random.split(jax.random.key(1), (1, tree.depth))
    inputs = DraftInputs(buffer, lengths + 1, jnp.zeros(1, bool), keys, tree.depth, rows)
    cache, prepared, _ = drafter.prepare(model, cache, inputs, config)
    return drafter, model, cache, inputs, prepared, config, pending


@pytest.mark.slow
def test_a_heads_sampled_tree_grows_from_its_measured_acceptance(target):
    """A head carrying measured rates (`FeatureHeadConfig.tree_acceptance`) draws its
    sampled trees in the shape they favour; without them, in the prior's: seen in which
    child ranks the rounds tested."""
    tree = Tree(6, 3, branch=3, sampled=True)
    rates = ((0.3, 0.3), (0.95, 0.1))  # unsure at the root, sure below
    assert static_shape(6, 3, 3) == (0, 1, 2, 0, 0, 1)
    assert static_shape(6, 3, 3, rates) == (0, 1, 2, 0, 4, 5)
    head = make_head(target, seed=3, scale=0.5)
    prompts = ragged_prompts(8, VOCAB, seed=8, max_len=10)
    tested = {}
    for measured in ((), rates):
        head.config = dataclasses.replace(head.config, tree_acceptance=measured)
        gen = Generator(target, head, schedule=3, tree=tree, sampling=SamplingConfig(1.0))
        out = gen(prompts, key=jax.random.key(0), max_new_tokens=24)
        tested[measured] = np.asarray(out.stats.rank_tested).sum(0) > 0  # [depth, rank]
    # the prior's shape: three children at the root, two under its first
    assert tested[()][0, 2] and tested[()][1, 1]
    # the measured one's: two at the root, one under every node below it
    assert tested[rates][0, :2].all() and not tested[rates][0, 2]
    assert tested[rates][1:, 0].all() and not tested[rates][1:, 1:].any()


def test_a_heads_sampled_tree_draws_no_child_past_qs_support(target):
    """Under top-k 2 a node has two drawable children: a third, past q's support, is
    left invalid, never tested (were it tested after the two were rejected, q being
    zero, it would be kept whenever the residual gives it any mass: not exact)."""
    head = make_head(target, seed=3, scale=0.5)
    sampling = SamplingConfig(1.0, top_k=2)
    gen = Generator(target, head, schedule=2, tree=Tree(6, 2, 3, sampled=True), sampling=sampling)
    out = gen(
        ragged_prompts(8, VOCAB, seed=8, max_len=10), key=jax.random.key(0), max_new_tokens=24
    )
    tested = np.asarray(out.stats.rank_tested).sum(0)
    assert tested[0, 1] > 0 and tested[:, 2:].sum() == 0


@pytest.mark.slow
def test_a_heads_tree_is_eagle2s_expansion_of_its_own_predictions(target):
    head = make_head(target, seed=3, scale=0.5)
    tree = Tree(6, 3, branch=2)
    prompt = [2, 5, 1, 4]
    drafter, model, cache, inputs, prepared, config, pending = _head_round(
        target, head, tree, prompt
    )
    scores, tokens, parents, _ = candidates(model, cache, prepared, tree)
    want = _reference_tree(target, head, prompt + [pending], tree)
    assert np.asarray(tokens)[0].tolist() == [c[1] for c in want]
    assert np.asarray(parents)[0].tolist() == [c[2] for c in want]
    np.testing.assert_allclose(np.asarray(scores)[0], [c[0] for c in want], rtol=1e-5)
    # The tree: the best N, parents before children, renumbered.
    chosen = sorted(sorted(range(len(want)), key=lambda i: -want[i][0])[: tree.nodes])
    node = {c: j + 1 for j, c in enumerate(chosen)}
    got = drafter.propose_tree(model, cache, inputs, prepared, tree, config)
    assert np.asarray(got.tokens)[0].tolist() == [want[c][1] for c in chosen]
    assert np.asarray(got.parent)[0].tolist() == [node.get(want[c][2], 0) for c in chosen]
    assert np.asarray(got.valid).all() and max(np.asarray(got.parent)[0]) > 1


@pytest.mark.slow
def test_a_head_tree_of_branch_one_is_the_chain(target):
    head = make_head(target, seed=3, scale=0.5)
    prompts = ragged_prompts(8, VOCAB, seed=8, max_len=10)
    kwargs = dict(key=jax.random.key(0), max_new_tokens=16)
    chain = Generator(target, head, schedule=3)(prompts, **kwargs)
    tree = Generator(target, head, schedule=3, tree=Tree(3, 3, branch=1))(prompts, **kwargs)
    for field in ("tokens", "lengths"):
        np.testing.assert_array_equal(
            np.asarray(getattr(tree, field)), np.asarray(getattr(chain, field))
        )
    for field in ("rounds", "accepted", "accepted_at"):
        a, b = getattr(tree.stats, field), getattr(chain.stats, field)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(chain.stats.accepted.sum()) > 5


def test_a_tree_larger_than_the_head_builds_is_refused(target):
    head = make_head(target)
    with pytest.raises(ValueError, match=r"tree \(11 nodes\) is larger than a feature head builds"):
        Generator(target, head, schedule=3, tree=Tree(11, 3, branch=2))


def test_a_chain_rule_with_a_tree_is_refused(target):
    with pytest.raises(ValueError, match="accept_block_with_noise is a chain's rule"):
        Generator(target, NGram(), schedule=3, tree=6, _rule=accept_block_with_noise)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--tree", "0"], "--tree must be >= 1, got 0"),
        (["--tree", "8", "--branch", "0"], "--branch must be >= 1, got 0"),
        (["--tree", "2", "-k", "4"], "--tree (2 nodes) cannot reach the depth"),
        (["--tree", "8", "--acceptance", "block"], "--acceptance block is for chains"),
        (["--tree", "8"], "tree needs a drafter that builds trees"),
        (["--lookup", "4"], "--lookup grafts prompt lookup onto a --tree: give --tree too"),
        (["--tree", "8", "-k", "4", "--lookup", "5"], "--lookup must be >= 0 and leave"),
        (["--tree", "8", "--draft", "ngram", "--lookup", "2"], "NGram's tree is prompt lookup"),
    ],
)
def test_the_cli_refuses_bad_tree_flags_naming_them(argv, words, capsys):
    err = cli_refusal(["generate", "x", "--max-new-tokens", "2", *argv], capsys)
    assert words in err
