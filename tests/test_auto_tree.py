"""A tree on `Auto`'s menu (`Auto(tree=...)`, `schedule="auto", tree=...`): the round is
the tree's or a chain's (or a plain step) as the expected times say, inside the one
program; greedy decoding stays the autoregressive one whatever is chosen, sampled rows
follow the target with shapes switching within a row, and the tree's cost and the
acceptance of its walk's steps are measured and cached with the chains'."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPTS,
    VOCAB,
    assert_follows_target,
    chi_square_pvalue,
    exact_sequence_probs,
    make_head,
    ragged_prompts,
    sample_sequences,
)
from test_drafter_contract import wrong_tree

from jax_specdec import Generator, NGram, SamplingConfig, autoregressive_generate
from jax_specdec.decode import auto_costs, program
from jax_specdec.decode.tree import Tree
from jax_specdec.schedules import Auto

T1 = SamplingConfig(1.0)
TREE = Tree(6, 2, 2)
# Seconds per round of widths 0, 1, 2 and the tree: the tree a little dearer than a plain
# step (chosen while its walk keeps tokens), dear (never chosen), or between (both).
MIXED, DEAR, BETWEEN = (1.0, 1.3, 1.5, 1.1), (1.0, 1.3, 1.5, 100.0), (1.0, 3.0, 3.0, 1.4)


@pytest.fixture(scope="module")
def head(target):
    return make_head(target)


@pytest.fixture
def costs_folder(tmp_path, monkeypatch):
    folder = tmp_path / "round_costs"
    monkeypatch.setenv(auto_costs.FOLDER_ENV, str(folder))
    return folder


def _auto(costs, tree=TREE):
    return Auto(widths=(0, 1, 2), tree=tree, round_costs=costs)


@pytest.mark.parametrize("drafter", ["head", pytest.param("ngram", marks=pytest.mark.slow)])
def test_greedy_tokens_are_the_autoregressive_ones_whatever_is_chosen(target, head, drafter):
    draft = head if drafter == "head" else NGram()
    prompts = [(p * 3)[:12] for p in ragged_prompts(4, VOCAB, seed=3, max_len=6)]
    common = dict(key=jax.random.key(2), max_new_tokens=16, sampling=SamplingConfig(0.0))
    ar = np.asarray(autoregressive_generate(target, prompts, **common).tokens)
    rounds = {}
    for name, costs in (("mixed", MIXED), ("dear", DEAR), ("between", BETWEEN)):
        out = Generator(target, draft, schedule=_auto(costs))(prompts, **common)
        np.testing.assert_array_equal(np.asarray(out.tokens), ar, err_msg=name)
        rounds[name] = np.asarray(out.stats.gamma_rounds)
        tried = np.asarray(out.stats.tree_accepted_at + out.stats.tree_rejected_at).sum()
        assert (tried > 0) == (rounds[name][-1] > 0), name  # the tree's own counters
    assert rounds["dear"][-1] == 0 and rounds["mixed"][-1] > 0
    assert rounds["between"][-1] > 0 and rounds["between"][:-1].sum() > 0  # both kinds


@pytest.mark.slow
def test_slots_refill_rows_with_a_tree_on_the_menu(target, head):
    prompts = ragged_prompts(5, VOCAB, seed=4)
    budgets = [9, 3, 12, 6, 10]
    common = dict(key=jax.random.key(3), max_new_tokens=budgets, sampling=SamplingConfig(0.0))
    ar = autoregressive_generate(target, prompts, **common)
    gen = Generator(target, head, schedule=_auto(MIXED))
    out = gen(prompts, num_slots=2, **common)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    assert np.asarray(out.stats.gamma_rounds)[-1] > 0


@dataclasses.dataclass(frozen=True)
class TreeThenChain(Auto):
    """`Auto`'s menu, its choice replaced: the tree in even rounds, a chain of 1 in odd
    ones (three tokens a row take one or two rounds: shapes switch within a row)."""

    def __call__(self, stats):
        return jnp.where(stats.round % 2 == 0, self.tree_choice, 1).astype(jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TREE, Tree(6, 2, 2, lookup=2)], ids=["sampled", "lookup"])
@pytest.mark.parametrize("rule", ["exact", "wrong"])
def test_samples_follow_the_target_with_tree_and_chain_rounds_in_a_row(target, head, tree, rule):
    """A sampled tree is accepted by recursive rejection, one with lookup by the walk; a
    wrong rule in the tree rounds (`test_drafter_contract.wrong_tree`) fails the test."""
    schedule = TreeThenChain(widths=(0, 1, 2), tree=tree, round_costs=MIXED)
    wrong = dict(_tree_rule=wrong_tree) if rule == "wrong" else {}
    seqs, stats = sample_sequences(
        target, head, T1, None, None, seed=21, schedule=schedule, **wrong
    )
    rounds = np.asarray(stats.gamma_rounds)
    assert rounds[-1] > 0 and rounds[1] > 0 and rounds[0] + rounds[2] == 0, rounds
    if rule == "exact":
        assert_follows_target(target, seqs, T1, None, f"auto tree {tree.label}")
        return
    pvalues = [
        chi_square_pvalue(seqs[i::2], exact_sequence_probs(target, np.array(p), T1, None))
        for i, p in enumerate(PROMPTS)
    ]
    assert min(pvalues) < 1e-6, pvalues


def test_the_trees_cost_and_walk_are_measured_and_cached(target, head, costs_folder):
    schedule = Auto(widths=(0, 2), tree=Tree(4, 2, 2), fallback=False)
    prompts = ragged_prompts(3, VOCAB, seed=1)
    before = program.generate._cache_size()
    run = Generator(target, head, schedule=schedule).bind(
        prompts, key=jax.random.key(0), max_new_tokens=12
    )
    out = run()
    assert program.generate._cache_size() - before == 1  # measured with its own program
    costs = run.round_costs
    assert costs.source == "measured" and len(costs.per_width) == 3  # 0, 2, the tree
    assert len(costs.alpha) == 2 and len(costs.tree_alpha) == 2
    record = json.loads(costs.path.read_text())
    np.testing.assert_allclose(record["tree_acceptance_per_step"], costs.tree_alpha)
    assert record["key"]["tree"] == repr(schedule.tree)
    forced = auto_costs._with_input(run, schedule.forcing(schedule.tree_choice))().stats
    rounds = np.asarray(forced.gamma_rounds)
    assert rounds[-1] == int(forced.target_calls) - 1 > 0 and rounds[:-1].sum() == 0
    # The prior is the forced tree run's walk (the measuring run: same program and
    # inputs, greedy), smoothed as `auto_costs._acceptance` says.
    kept = np.asarray(forced.tree_accepted_at).sum(0).astype(float)
    tried = kept + np.asarray(forced.tree_rejected_at).sum(0)
    smoothing = auto_costs.SMOOTHING
    want = (kept + smoothing * kept.sum() / tried.sum()) / (tried + smoothing)
    np.testing.assert_allclose(costs.tree_alpha, np.clip(want, 0.01, 0.99), rtol=1e-6)
    again = Generator(target, head, schedule=schedule).bind(
        prompts, key=jax.random.key(0), max_new_tokens=12
    )
    assert again.round_costs.source == "cache"
    assert again.round_costs.tree_alpha == costs.tree_alpha
    np.testing.assert_array_equal(np.asarray(again().tokens), np.asarray(out.tokens))


def test_a_tree_joins_autos_menu_and_bad_ones_are_refused(target, head, draft):
    assert Generator(target, head, schedule="auto", tree=6).schedule == Auto(tree=Tree(6, 4))
    assert Generator(target, head, schedule=Auto(tree=TREE)).schedule.tree == TREE
    assert Generator(target, head, tree=6).tree == Tree(6, 4)  # alone: a fixed tree round
    with pytest.raises(ValueError, match="Auto.tree must be a Tree of depth at most"):
        Auto(widths=(0, 2), tree=Tree(6, 3))
    with pytest.raises(ValueError, match="and one for the tree"):
        Auto(widths=(0, 2), tree=TREE, round_costs=(1.0, 2.0))
    with pytest.raises(ValueError, match="tree needs a drafter that builds trees"):
        Generator(target, draft, schedule="auto", tree=6)
    with pytest.raises(ValueError, match="give the tree once"):
        Generator(target, head, schedule=Auto(tree=TREE), tree=6)
    with pytest.raises(ValueError, match="larger than a feature head builds"):
        Generator(target, head, schedule="auto", tree=Tree(40, 2, 2))


def test_the_memory_plan_counts_the_trees_verify_width(target, head):
    prompts = ragged_prompts(2, VOCAB, seed=5)
    plans = {}
    for name, tree in (("chains", None), ("tree", Tree(40, 2, 8))):
        schedule = Auto(widths=(0, 1, 2), tree=tree, round_costs=(1.0,) * (3 + bool(tree)))
        run = Generator(target, head, schedule=schedule).bind(
            prompts, key=jax.random.key(0), max_new_tokens=4
        )
        plans[name] = run.memory_plan
    assert plans["tree"].working > 10 * plans["chains"].working  # 41 tokens a row, not 3
