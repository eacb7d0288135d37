"""`schedule="auto"` (`schedules.Auto`), the default with a drafter: round costs measured
with the call's own program and kept on disk, the width chosen every round from them,
drafting switched off where it does not pay, one compiled program. Exactness with shapes
switching between rounds is in tests/test_schedules.py (greedy = autoregressive, the
chi-square test) and here (a wrong rule fails it)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import (
    NUM_SAMPLES,
    PROMPTS,
    VOCAB,
    chi_square_pvalue,
    count_compiles,
    exact_sequence_probs,
    make_draft,
    ragged_prompts,
    sample_sequences,
)
from test_drafter_contract import resample_from_p

from jax_specdec import Generator, SamplingConfig, autoregressive_generate
from jax_specdec.decode import auto_costs, program
from jax_specdec.decode.tree import Tree
from jax_specdec.schedules import Auto, Constant

T1 = SamplingConfig(1.0)


@pytest.fixture
def costs_folder(tmp_path, monkeypatch):
    folder = tmp_path / "round_costs"
    monkeypatch.setenv(auto_costs.FOLDER_ENV, str(folder))
    return folder


def test_auto_is_the_default_with_a_drafter(target, draft):
    assert Generator(target, draft).schedule == Auto()
    assert Generator(target, draft, schedule="auto").schedule == Auto()
    assert Generator(target, draft, num_draft_tokens=3).schedule == Constant(3)
    assert Generator(target, draft, schedule=2).schedule == Constant(2)
    assert Generator(target).schedule is None
    with pytest.raises(TypeError, match="schedule must be an int γ >= 1, 'auto'"):
        Generator(target, draft, schedule="fast")
    with pytest.raises(ValueError, match="Auto.widths"):
        Auto(widths=(1, 2))
    with pytest.raises(ValueError, match="Auto.widths"):
        Auto(widths=(0, 4, 2))
    with pytest.raises(ValueError, match="Auto.round_costs"):
        Auto(widths=(0, 2), round_costs=(1.0,))
    with pytest.raises(ValueError, match="Auto.round_costs"):
        Auto(widths=(0, 2), round_costs=(1.0, float("nan")))


def test_costs_measured_once_per_shape_with_one_program(target, draft, costs_folder):
    generator = Generator(target, draft, schedule=Auto(widths=(0, 1, 3), fallback=False))
    prompts = ragged_prompts(3, VOCAB, seed=1)
    before = program.generate._cache_size()
    run = generator.bind(prompts, key=jax.random.key(0), max_new_tokens=12)
    out = run()
    assert program.generate._cache_size() - before == 1  # measured with its own program
    costs = run.round_costs
    assert costs.source == "measured" and len(costs.per_width) == 3
    assert all(c > 0 for c in costs.per_width)
    assert len(costs.alpha) == 3 and all(0 < a < 1 for a in costs.alpha)
    record = json.loads(costs.path.read_text())
    assert record["widths"] == [0, 1, 3] and record["key"]["rows"] == 3
    np.testing.assert_allclose(record["seconds_per_round"], costs.per_width)
    np.testing.assert_allclose(record["acceptance_per_position"], costs.alpha)
    # The same shape again: read from the file, nothing measured, nothing compiled.
    again = Generator(target, draft, schedule=Auto(widths=(0, 1, 3), fallback=False))
    with count_compiles() as compiled:
        run2 = again.bind(prompts, key=jax.random.key(0), max_new_tokens=12)
        out2 = run2()
    assert compiled[0] == 0 and run2.round_costs.source == "cache"
    assert run2.round_costs.per_width == costs.per_width
    assert run2.round_costs.alpha == costs.alpha
    np.testing.assert_array_equal(np.asarray(out2.tokens), np.asarray(out.tokens))
    # Another batch size is another program and another measurement.
    run3 = again.bind(prompts[:2], key=jax.random.key(0), max_new_tokens=12)
    assert run3.round_costs.source == "measured" and run3.round_costs.path != costs.path
    # Given costs are used as they are.
    given = Generator(target, draft, schedule=Auto(widths=(0, 1, 3), round_costs=(1, 2, 3)))
    run4 = given.bind(prompts, key=jax.random.key(0), max_new_tokens=12)
    assert run4.round_costs.source == "given" and run4.round_costs.per_width == (1.0, 2.0, 3.0)


def test_a_draft_of_the_same_shapes_with_other_weights_is_keyed_apart(target):
    """The costs' key holds a sample of the weights: another draft of the same shapes
    gets its own key (its own prior), the same weights the same key. The sample an
    accelerator takes on its device is the one a CPU reads in place."""
    schedule = Auto(widths=(0, 1, 3), round_costs=(1.0, 2.0, 3.0), fallback=False)

    def key(draft):
        generator = Generator(target, draft, schedule=schedule)
        run = generator.bind([[1, 2, 3]], key=jax.random.key(0), max_new_tokens=4)
        return auto_costs.cache_key(run, schedule, [m for _, m in generator._models])

    first, again, other = key(make_draft(1)), key(make_draft(1)), key(make_draft(2))
    assert first == again
    assert first["models"][0] == other["models"][0] and first["models"][1] != other["models"][1]
    leaves = jax.tree.leaves(nnx.state(make_draft(1)))
    for leaf in leaves:
        step = -(-leaf.size // auto_costs.SAMPLED)
        sample = np.asarray(leaf).reshape(-1)[::step]
        assert sample.size <= auto_costs.SAMPLED
        np.testing.assert_array_equal(auto_costs._strided(leaf, step), sample)
    auto_costs._fingerprint(leaves)  # each array sampled once while it lives
    assert all(auto_costs._SAMPLES[id(leaf)][0]() is leaf for leaf in leaves)


@pytest.mark.slow
def test_a_measuring_run_holds_its_width(target, draft, costs_folder):
    schedule = Auto(widths=(0, 2, 4), fallback=False)
    run = Generator(target, draft, schedule=schedule).bind(
        ragged_prompts(4, VOCAB, seed=2), key=jax.random.key(1), max_new_tokens=10
    )
    for width in schedule.widths:
        stats = auto_costs._with_input(run, schedule.forcing(width))().stats
        rounds = np.asarray(stats.gamma_rounds)
        assert rounds[width] == int(stats.target_calls) - 1 > 0, (width, rounds)


@pytest.mark.slow
def test_auto_switches_drafting_off_where_it_does_not_pay(target, draft):
    prompts = ragged_prompts(4, VOCAB, seed=3)
    common = dict(key=jax.random.key(2), max_new_tokens=16, sampling=SamplingConfig(0.0))
    costs = (1.0, 4.0, 6.0)  # a verify at 4-6 steps: no width pays
    own = Generator(
        target, draft, schedule=Auto(widths=(0, 2, 4), round_costs=costs, fallback=False)
    )
    out = own(prompts, **common)
    ar = autoregressive_generate(target, prompts, **common)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    assert np.asarray(out.stats.gamma_rounds).tolist() == [15, 0, 0, 0, 0]  # plain steps
    # By default such a call runs autoregressive decoding's own program: its tokens at
    # T = 1 too (greedy last: `ar` below), with no drafter in it.
    dear = Generator(target, draft, schedule=Auto(widths=(0, 2, 4), round_costs=costs))
    for sampling in (T1, SamplingConfig(0.0)):
        common["sampling"] = sampling
        run = dear.bind(prompts, **common)
        assert run.config.drafter is None and run.args.auto is None
        assert run.cache_len == Generator(target).bind(prompts, **common).cache_len
        assert run.round_costs.per_width == costs
        out, ar = run(), autoregressive_generate(target, prompts, **common)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
        assert np.asarray(out.stats.gamma_rounds).shape == (1,)  # the program's own stats
    cheap = Auto(widths=(0, 2, 4), round_costs=(1.0, 1.01, 1.02))  # drafting nearly free
    out = Generator(target, draft, schedule=cheap)(prompts, **common)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    rounds = np.asarray(out.stats.gamma_rounds)
    assert rounds[4] > 0 and rounds[1] == rounds[3] == 0  # only widths of the menu


@pytest.mark.slow
def test_a_wrong_rule_fails_under_auto(target, draft):
    """The shapes switch between rounds (as in test_schedules' auto cases), and a wrong
    acceptance rule is caught by the chi-square test."""
    schedule = Auto(widths=(0, 1, 2, 4), round_costs=(1.0, 1.1, 1.2, 1.4), prior_alpha=0.98)
    seqs, stats = sample_sequences(
        target, draft, T1, None, None, seed=11, schedule=schedule, _rule=resample_from_p
    )
    assert np.count_nonzero(np.asarray(stats.gamma_rounds)) >= 2
    pvalues = [
        chi_square_pvalue(seqs[i::2], exact_sequence_probs(target, np.array(p), T1, None))
        for i, p in enumerate(PROMPTS)
    ]
    assert min(pvalues) < 1e-6, pvalues
    assert len(seqs) == NUM_SAMPLES


@pytest.mark.slow
def test_the_prior_is_the_measured_acceptance(target, costs_folder):
    """The target as its own draft: q = p, so every draft position is accepted in the
    measuring runs and the prior is the cap, 0.99, at every position."""
    run = Generator(target, target, schedule=Auto(widths=(0, 2, 3), fallback=False)).bind(
        ragged_prompts(2, VOCAB, seed=4),
        key=jax.random.key(5),
        max_new_tokens=8,
        sampling=T1,
    )
    assert run.round_costs.alpha == (0.99, 0.99, 0.99)
    np.testing.assert_allclose(np.asarray(run.args.auto.alpha), 0.99)


def test_the_first_round_drafts_where_some_shape_pays():
    """`Auto.drafts_first`: the choice before any round, from the costs and the prior."""
    cheap = Auto(widths=(0, 2, 4), round_costs=(1.0, 1.1, 1.2))
    dear = Auto(widths=(0, 2, 4), round_costs=(1.0, 4.0, 6.0))
    for schedule, budgets, drafts in (
        (cheap, [16, 16], True),
        (cheap, [1, 1], False),  # every row done at its first token
        (dear, [16, 16], False),
        (dear, [16, 0], False),
    ):
        inputs = schedule.inputs(schedule.round_costs)
        assert schedule.drafts_first(inputs, budgets) == drafts, (schedule, budgets)
    # A low prior turns a cheap menu off; a tree that pays turns a dear one on.
    low = cheap.inputs(cheap.round_costs, alpha=[0.05] * 4)
    assert not cheap.drafts_first(low, [16, 16])
    tree = Auto(widths=(0, 2), tree=Tree(6, 2, 2), round_costs=(1.0, 4.0, 1.2))
    assert tree.drafts_first(tree.inputs(tree.round_costs), [16])


def test_widths_grow_one_step_past_the_positions_tried():
    """No position tried yet: at most the menu's first width; after positions 1 and 2
    were tried (by any row), at most the first width past 2; the measuring runs
    (ramp off) may take any."""
    from test_schedules import stats_of

    schedule = Auto(widths=(0, 1, 2, 4, 8))
    inputs = schedule.inputs((1.0, 1.01, 1.02, 1.03, 1.04), alpha=0.95)  # drafting pays
    fresh = stats_of(max_gamma=8, accepted=[0, 0])._replace(auto=inputs)
    assert schedule._reachable(fresh).tolist() == [True, True] + [False] * 7
    assert schedule(fresh).tolist() == [1, 1]
    tried = np.zeros((2, 8), np.int32)
    tried[0, :2] = 1  # row 0 tried positions 1 and 2
    seen = fresh._replace(accepted_at=tried)
    assert schedule._reachable(seen).tolist() == [True] * 5 + [False] * 4
    assert schedule(seen).tolist() == [4, 4]
    unlocked = fresh._replace(auto=inputs._replace(ramp=np.bool_(False)))
    assert schedule(unlocked).tolist() == [8, 8]


def test_costs_solve_rounds_of_mixed_widths():
    """A drafter that proposes fewer tokens than asked (n-gram lookup) runs some rounds
    narrower than the forced width: the costs solve rounds × cost = seconds over the
    runs; a width with no rounds of its own keeps its run's seconds per round."""
    costs = np.array([1.0, 2.0, 3.0])
    rounds = np.array([[10.0, 0, 0], [2, 8, 0], [1, 3, 6]])
    np.testing.assert_allclose(auto_costs._solve(rounds, rounds @ costs), costs)
    never = np.array([[10.0, 0, 0], [4, 6, 0], [10, 0, 0]])  # width 2 never ran
    solved = auto_costs._solve(never, np.array([10.0, 16.0, 10.0]))
    np.testing.assert_allclose(solved, [1.0, 2.0, 1.0])


def test_each_width_costs_its_fastest_pass(target, draft, costs_folder, monkeypatch):
    """A slow spell of a shared machine only adds time: each measuring run counts its
    fastest pass (a median of these passes would take the slow ones)."""
    from jax_specdec.bench import timing

    schedule = Auto(widths=(0, 2))
    given = Auto(widths=(0, 2), round_costs=(1.0, 1.0), fallback=False)  # nothing timed
    run = Generator(target, draft, schedule=given).bind(
        ragged_prompts(2, VOCAB, seed=3), key=jax.random.key(0), max_new_tokens=10
    )
    passes = [(0.1, 0.9, 0.9), (1.1, 3.0, 3.0), (3.0, 0.6, 3.0)]  # prefill, width 0, 2

    def fake(runs, repeats):
        assert len(runs) == len(passes) and repeats == auto_costs.REPEATS
        made = [timing.Timing(9.0, float(np.median(t)), t) for t in passes]
        return [timing.Measurement(t, r()) for t, r in zip(made, runs, strict=True)]

    monkeypatch.setattr(timing, "measure", fake)
    per_width, *_ = auto_costs.measure(run, schedule)
    forced = [
        auto_costs._with_input(run, schedule.forcing(w), np.minimum(run.args.budgets, 24))
        for w in schedule.widths
    ]
    rounds = [
        int(np.asarray(f().stats.gamma_rounds)[w]) for f, w in zip(forced, (0, 2), strict=True)
    ]
    np.testing.assert_allclose(per_width, [1.0 / rounds[0], 0.5 / rounds[1]], rtol=1e-6)


@pytest.mark.slow
def test_slots_and_short_calls(target, draft, costs_folder):
    """With slots only the first slots' prompts run in the measuring runs, and the
    output is still the greedy tokens; a call too short for every width to run 4
    rounds measures for itself and caches nothing."""
    prompts = ragged_prompts(5, VOCAB, seed=6)
    common = dict(key=jax.random.key(3), max_new_tokens=12)
    run = Generator(target, draft, schedule=Auto(widths=(0, 2))).bind(
        prompts, num_slots=2, **common
    )
    assert run.round_costs.source == "measured" and run.round_costs.path.is_file()
    ar = autoregressive_generate(target, prompts, **common)
    np.testing.assert_array_equal(np.asarray(run().tokens), np.asarray(ar.tokens))
    short = Generator(target, draft, schedule=Auto(widths=(0, 2))).bind(
        prompts[:1], key=jax.random.key(3), max_new_tokens=3
    )
    assert short.round_costs.source == "measured" and not short.round_costs.path.exists()
