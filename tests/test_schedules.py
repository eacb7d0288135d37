"""Draft-length schedules and the n-gram proposer inside the compiled loop: greedy
equality, enumerated exactness, per-row independence, no cache copies, the rules."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPTS,
    VOCAB,
    chi_square_pvalue,
    copies_outside_entry,
    exact_sequence_probs,
    make_model,
    ragged_prompts,
    sample_sequences,
)

from jax_specdec import (
    Generator,
    NGram,
    SamplingConfig,
    autoregressive_generate,
    speculative_generate,
)
from jax_specdec.schedules import (
    Auto,
    Confidence,
    Constant,
    CostModel,
    Custom,
    Heuristic,
    ScheduleStats,
)


def skip_then_draft(stats):
    """γ = 0 for five rounds, then 3 for three: the draft cache lags by 5 and catches up."""
    return jnp.where(stats.round % 8 < 5, 0, 3)


def cycle(stats):
    return (stats.round % 3) * 2  # 0, 2, 4, 0, ...


# Each draws γ differently; all with max_gamma <= 4 to keep compile times small. A
# constant γ, early exit (Confidence) and γ = 0 steps are drafter-contract cases
# (tests/test_drafter_contract.py).
MODEL_SCHEDULES = {
    "heuristic": Heuristic(initial=2, min_gamma=1, max_gamma=4),
    # Confident enough to draft even for the slowest of the exactness test's 10^5 rows.
    "cost_model": CostModel(
        draft_cost=0.1, verify_costs=(1.0, 1.1, 1.2, 1.3, 1.4), prior_alpha=0.98
    ),
    "cost_model_off": CostModel(draft_cost=1.0, verify_costs=(1.0, 3.0, 5.0)),
    "custom_cycle": Custom(cycle, max_gamma=4),
    # schedule="auto" with its costs given (measured ones would differ per machine): a
    # menu whose widths switch between rounds as the rows' remaining tokens shrink.
    "auto": Auto(widths=(0, 1, 2, 4), round_costs=(1.0, 1.1, 1.2, 1.4), prior_alpha=0.98),
}
NGRAM_SCHEDULES = {
    "ngram_heuristic": Heuristic(initial=2, max_gamma=4),
    "ngram_cycle": Custom(cycle, max_gamma=4),
    "ngram_auto": Auto(widths=(0, 2, 4), round_costs=(1.0, 1.05, 1.1), prior_alpha=0.9),
}


def proposer_and_schedule(name, draft):
    if name in MODEL_SCHEDULES:
        return draft, MODEL_SCHEDULES[name]
    return NGram(max_ngram=3, min_ngram=1), NGRAM_SCHEDULES[name]


ALL = sorted([*MODEL_SCHEDULES, *NGRAM_SCHEDULES])


# ---------------------------------------------------------------- greedy equality


# The quick loop (-m "not slow") keeps one schedule's greedy case.
QUICK = ("heuristic",)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in ALL]
)
def test_greedy_equals_autoregressive_for_every_schedule(name):
    target = make_model(10, vocab=32, scale=0.3)
    draft = make_model(11, vocab=32, scale=0.3, num_layers=1)
    proposer, schedule = proposer_and_schedule(name, draft)
    # Repetitive prompts so the n-gram proposer finds matches.
    prompts = [(p * 3)[:12] for p in ragged_prompts(12, 32, seed=4, max_len=6)]
    greedy = SamplingConfig(temperature=0.0)
    common = dict(max_new_tokens=24, sampling=greedy, eos_token_id=5)
    ar = autoregressive_generate(target, prompts, key=jax.random.key(0), **common)
    spec = speculative_generate(
        target, proposer, prompts, key=jax.random.key(1), schedule=schedule, **common
    )
    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(ar.lengths))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    s = spec.stats
    assert int(np.sum(s.gamma_rounds)) == int(s.target_calls) - 1
    assert int(np.sum(s.drafted_at)) == int(np.sum(s.drafted))
    assert int(np.sum(s.accepted_at)) == int(np.sum(s.accepted))
    assert int(np.sum(s.rejected_at)) == int(np.sum(s.rejected))
    assert np.all(np.asarray(s.accepted_at + s.rejected_at) <= np.asarray(s.drafted_at))
    if name == "cost_model_off":  # verifying costs more than it can return: never drafts
        assert int(np.sum(s.drafted)) == 0 and s.gamma_rounds.tolist() == [23, 0, 0]
    if name in ("ngram_cycle", "cost_model", "auto"):
        assert int(s.gamma_rounds[0]) > 0 and int(np.sum(s.gamma_rounds[1:])) > 0


@pytest.mark.slow
def test_ngram_accepts_repeats_of_greedy_decoding():
    target = make_model(10, vocab=32, scale=0.3)
    common = dict(key=jax.random.key(0), max_new_tokens=48, sampling=SamplingConfig(0.0))
    ar = autoregressive_generate(target, [[1, 2, 3]], **common)
    out = speculative_generate(
        target, NGram(max_ngram=2), [[1, 2, 3]], num_draft_tokens=4, **common
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    # A small random model's greedy text repeats itself, which prompt lookup predicts:
    # fewer target calls than tokens.
    print(f"\nNGRAM greedy: alpha={out.stats.alpha:.3f}, rounds={int(out.stats.rounds[0])}")
    assert int(out.stats.accepted[0]) > 0 and int(out.stats.rounds[0]) < 47


# ---------------------------------------------------------------- exactness


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_samples_follow_the_target_for_every_schedule(target, draft, name):
    proposer, schedule = proposer_and_schedule(name, draft)
    sampling = SamplingConfig(0.8, top_k=5) if "cycle" in name else SamplingConfig(1.0)
    eos = 2 if name.startswith("ngram") else None
    seqs, run_stats = sample_sequences(
        target, proposer, sampling, None, eos, seed=len(name), schedule=schedule
    )
    if name != "cost_model_off":  # it only runs γ = 0
        assert int(np.sum(run_stats.drafted)) > 0
    for which, prompt in enumerate(PROMPTS):
        exact = exact_sequence_probs(target, np.array(prompt), sampling, eos)
        pvalue = chi_square_pvalue(seqs[which::2], exact)
        print(
            f"\nSCHEDULE-EXACTNESS {name} prompt{which}: alpha={run_stats.alpha:.3f} "
            f"widths={np.asarray(run_stats.gamma_rounds).tolist()} chi2_pvalue={pvalue:.3g}"
        )
        assert pvalue > 1e-3


# ---------------------------------------------------------------- rows and programs


@pytest.mark.parametrize("name", ["heuristic", "ngram_heuristic"])
@pytest.mark.slow
def test_per_row_schedules_keep_rows_independent_of_the_batch(target, draft, name):
    proposer, schedule = proposer_and_schedule(name, draft)
    prompts = [(p * 2)[:8] for p in ragged_prompts(8, VOCAB, seed=5)]
    keys = jax.random.split(jax.random.key(7), 8)
    kwargs = dict(max_new_tokens=12, schedule=schedule, sampling=SamplingConfig(0.9))
    batch = speculative_generate(target, proposer, prompts, key=keys, **kwargs)
    for b in (0, 5):
        alone = speculative_generate(target, proposer, [prompts[b]], key=keys[b : b + 1], **kwargs)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[b])


@pytest.mark.parametrize("schedule", [Custom(skip_then_draft, max_gamma=3), "cost_model"])
@pytest.mark.slow
def test_draft_cache_catches_up_after_skipped_rounds(target, schedule):
    """The target as its own draft: with a draft cache that caught up correctly after
    γ = 0 rounds (and without a prefill), q = p and every draft is accepted, even at
    temperature 1; a cache missing or misplacing an entry would reject some."""
    if schedule == "cost_model":
        schedule = CostModel(draft_cost=0.0, verify_costs=(1.0, 1.01, 1.02), prior_alpha=0.99)
    prompts = ragged_prompts(6, VOCAB, seed=9, max_len=30)
    out = speculative_generate(
        target,
        target,
        prompts,
        key=jax.random.key(1),
        max_new_tokens=40,
        schedule=schedule,
        sampling=SamplingConfig(1.0),
    )
    s = out.stats
    if isinstance(schedule, Custom):  # drafts after γ = 0 rounds, from a lagging cache
        assert int(s.gamma_rounds[0]) > 0
    assert int(np.sum(s.drafted)) > 0
    assert int(np.sum(s.accepted)) == int(np.sum(s.drafted))


@pytest.mark.slow
def test_constant_schedule_is_num_draft_tokens(target, draft):
    prompts = ragged_prompts(4, VOCAB, seed=2)
    kwargs = dict(key=jax.random.key(3), max_new_tokens=10, sampling=SamplingConfig(1.0))
    a = speculative_generate(target, draft, prompts, num_draft_tokens=3, **kwargs)
    b = speculative_generate(target, draft, prompts, schedule=Constant(3), **kwargs)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


@pytest.mark.slow
def test_stats_per_position_and_remaining(target, draft):
    prompts = ragged_prompts(6, VOCAB, seed=3)
    kw = dict(key=jax.random.key(4), max_new_tokens=12, sampling=SamplingConfig(1.0))
    s = speculative_generate(target, draft, prompts, schedule=Constant(3), **kw).stats
    acc, rej, drafted = (np.asarray(x) for x in (s.accepted_at, s.rejected_at, s.drafted_at))
    assert rej.sum() > 0 and acc[:, -1].sum() > 0
    # Every round that drafts tries position 0; position i is tried in the rounds that
    # accepted the first i drafts; each try is accepted or is the round's first rejection.
    np.testing.assert_array_equal(acc[:, 0] + rej[:, 0], drafted[:, 0])
    np.testing.assert_array_equal(acc[:, 1:] + rej[:, 1:], acc[:, :-1])
    np.testing.assert_array_equal(s.conditional_acceptance_at(), acc.sum(0) / (acc + rej).sum(0))
    # `remaining` is what the row may still generate: a schedule that drafts only when
    # remaining + generated == max_new_tokens drafts in every round.
    check = Custom(lambda st: jnp.where(st.remaining + st.generated == 12, 2, 0), max_gamma=2)
    s = speculative_generate(target, draft, prompts, schedule=check, **kw).stats
    assert int(s.gamma_rounds[0]) == 0 and int(s.gamma_rounds[2]) > 0


DYNAMIC = {
    "heuristic": MODEL_SCHEDULES["heuristic"],
    "confidence": Confidence(threshold=0.5, max_gamma=4),
    "custom_skip": Custom(skip_then_draft, max_gamma=3),
}


@pytest.mark.parametrize("name", sorted(DYNAMIC))
@pytest.mark.slow
def test_dynamic_rounds_do_not_copy_caches(target, draft, name):
    generator = Generator(target, draft, schedule=DYNAMIC[name])
    run = generator.bind([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=8)
    hlo = run.lower().compile().as_text()
    for model in (target, draft):
        c = model.config
        shape = f"f32[2,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
        assert shape in hlo
        assert copies_outside_entry(hlo, shape) == 0, f"cache {shape} copied in {name}"


# ---------------------------------------------------------------- the rules


def stats_of(max_gamma=4, **fields):
    round_ = np.int32(fields.pop("round", 1))
    batch = len(next(iter(fields.values())))
    base = {k: np.zeros(batch, np.int32) for k in ScheduleStats._fields}
    base["round"] = round_
    base["active"] = np.ones(batch, bool)
    base["remaining"] = np.full(batch, 64, np.int32)
    base["accepted_at"] = base["rejected_at"] = np.zeros((batch, max_gamma), np.int32)
    base.update({k: np.asarray(v) for k, v in fields.items()})
    return ScheduleStats(**{k: jnp.asarray(v) for k, v in base.items()})


def test_heuristic_rule():
    h = Heuristic(initial=3, min_gamma=1, max_gamma=6)
    assert h(stats_of(round=0, last_gamma=[0, 0])).tolist() == [3, 3]
    s = stats_of(last_gamma=[3, 3, 5, 1, 6], last_accepted=[3, 2, 5, 0, 6])
    assert h(s).tolist() == [5, 2, 6, 1, 6]


def per_position(alpha, rounds=100):
    """accepted_at / rejected_at counts of rows that met position i `rounds` times and
    accepted it with frequency alpha[b][i]."""
    alpha = np.asarray(alpha, np.float64)
    accepted = np.round(rounds * alpha).astype(np.int32)
    return dict(accepted_at=accepted, rejected_at=rounds - accepted)


def enumerated_tokens(alpha, gamma):
    """Mean and variance of the tokens of one γ round, from its enumerated outcomes."""
    probs = []
    for k in range(gamma + 1):  # k drafts accepted, then a correction or the bonus
        reach = np.prod(alpha[:k])
        probs.append(reach * (1 - alpha[k]) if k < gamma else reach)
    tokens = np.arange(1, gamma + 2)
    mean = np.dot(probs, tokens)
    return mean, np.dot(probs, tokens**2) - mean**2


def test_cost_model_rule():
    from scipy import stats as scipy_stats

    costs = CostModel(draft_cost=0.05, verify_costs=(1.0, 1.05, 1.1, 1.15, 1.2))
    confident = stats_of(**per_position([[0.9, 0.92, 0.9, 0.95], [0.95, 0.9, 0.93, 0.9]]))
    hopeless = stats_of(**per_position([[0.0, 0.1, 0.0, 0.1], [0.05, 0.0, 0.0, 0.0]]))
    assert costs(confident).tolist() == [4, 4]
    assert costs(hopeless).tolist() == [0, 0]
    # Expensive verification: a plain decode step wins even at α ≈ 0.9.
    assert CostModel(0.1, (1.0, 2.5, 4.0))(
        stats_of(max_gamma=2, **per_position([[0.9, 0.9]]))
    ).tolist() == [0]

    # Rounds until done: R/μ at batch 1, plus z_n standard deviations over n rows, with
    # μ and var(T) of the enumerated round outcomes.
    alpha = np.asarray(costs.alpha(confident))
    for b in range(2):
        one = stats_of(
            **{k: v[b : b + 1] for k, v in confident._asdict().items() if k.endswith("_at")}
        )
        rounds = np.asarray(costs.rounds(one))
        for g in range(5):
            mean, _ = enumerated_tokens(alpha[b], g)
            np.testing.assert_allclose(rounds[g], 64 / mean, rtol=1e-5)
    n = 32
    same = stats_of(**per_position(np.tile([0.7, 0.6, 0.55, 0.5], (n, 1))))
    z = scipy_stats.norm.ppf((n - 0.375) / (n + 0.25))
    rounds = np.asarray(costs.rounds(same))
    for g in range(5):
        mean, var = enumerated_tokens(np.asarray(costs.alpha(same))[0], g)
        np.testing.assert_allclose(
            rounds[g], 64 / mean + z * np.sqrt(64 * var / mean**3), rtol=1e-4
        )
    # The last token: one round whatever γ, so the cheapest round.
    last = stats_of(remaining=[1, 0], active=[True, False], **per_position([[0.9] * 4] * 2))
    assert costs(last).tolist() == [0, 0]


def test_cost_model_waits_for_the_slowest_row():
    # Round costs measured at batch 64 (ms, γ = 0 … 4) and α = 0.71 at every position:
    # one row gains from γ = 2, but a batch of 64 waits for its unluckiest row.
    model = CostModel(0.0, (26.2, 41.3, 50.6, 63.5, 72.5), prior_alpha=0.71)
    assert model(stats_of(accepted=[0])).tolist() == [2]
    assert set(model(stats_of(accepted=[0] * 64)).tolist()) == {0}
    # A row that accepts little weighs on the whole batch: seven good rows alone would
    # draft 4, with one poor row the batch drafts 1, with one hopeless row none.
    model = CostModel(0.0, (1.0, 1.2, 1.35, 1.5, 1.65))
    good = [[0.9] * 4] * 7
    assert set(model(stats_of(**per_position(good))).tolist()) == {4}
    assert set(model(stats_of(**per_position(good + [[0.3] * 4]))).tolist()) == {1}
    assert set(model(stats_of(**per_position(good + [[0.1] * 4]))).tolist()) == {0}


def test_cost_model_rounds_near_the_exact_batch_rounds():
    """`CostModel.rounds` (a normal approximation of the slowest row's rounds) against
    the exact expectation (`bench.expected_batch_rounds`), rows of equal and of spread
    α: within 15% of it, and the γ it picks costs at most 3% more than the γ the exact
    rounds would pick (measured: 13% and 2.2%; without the slowest row's term, 35% and
    8.9%)."""
    from jax_specdec.bench import expected_batch_rounds

    model = CostModel(0.07, (1.0, 1.1, 1.2, 1.3, 1.45), prior_weight=1e-3)
    costs = np.asarray(model.costs())
    worst_error = worst_regret = 0.0
    for n, left, spread, mean in itertools.product(
        (1, 4, 16), (16, 128), (0.0, 0.2), (0.3, 0.6, 0.9)
    ):
        alphas = np.clip(mean + spread * np.linspace(-1, 1, n), 0.02, 0.98)
        seen = per_position(np.repeat(alphas[:, None], 4, axis=1), rounds=10**5)
        stats = stats_of(**seen, remaining=np.full(n, left))
        approx = np.asarray(model.rounds(stats))
        exact = np.array([expected_batch_rounds(alphas, g, left) for g in range(5)])
        chosen, best = np.argmin(approx * costs), np.argmin(exact * costs)
        worst_error = max(worst_error, np.abs(approx / exact - 1).max())
        worst_regret = max(
            worst_regret, exact[chosen] * costs[chosen] / (exact[best] * costs[best])
        )
    assert worst_error < 0.15 and worst_regret < 1.03, (worst_error, worst_regret)


def test_cost_model_acceptance_per_position():
    costs = (1.0, 1.2, 1.3)
    # A good first position and a poor second one: one draft, not two.
    assert CostModel(0.0, costs, prior_alpha=(0.9, 0.1))(
        stats_of(max_gamma=2, accepted=[0])
    ).tolist() == [1]
    assert CostModel(0.0, costs, prior_alpha=0.9)(stats_of(max_gamma=2, accepted=[0])).tolist() == [
        2
    ]
    # What the rows show overrides the prior: position 2 keeps getting rejected.
    model = CostModel(0.0, costs, prior_alpha=0.9)
    seen = per_position([[0.9, 0.1]], rounds=50)
    assert model(stats_of(max_gamma=2, **seen)).tolist() == [1]
    np.testing.assert_allclose(
        np.asarray(model.alpha(stats_of(max_gamma=2, **seen)))[0], [(45 + 3.6) / 54, (5 + 3.6) / 54]
    )
    with pytest.raises(ValueError, match="max_gamma"):
        model(stats_of(max_gamma=3, accepted=[0]))
    # NumPy scalars and arrays are accepted as priors.
    assert CostModel(0.0, costs, prior_alpha=np.float32(0.5)).prior_alpha == 0.5
    assert CostModel(0.0, costs, prior_alpha=np.array([0.9, 0.1])).prior_alpha == (0.9, 0.1)


def test_cost_model_explore_keeps_drafting_through_an_unlucky_start():
    # Round costs (ms, γ = 0 … 4) and acceptance the SmolLM2 head's batch-4 sweep
    # calibrated (scripts/experiments/sweep_smollm2_head/head2m_t0/sweep.json). Drafting
    # pays at α ≈ 0.5, but one row's first position missed four times in a row
    # switches a plain posterior mean off for good (γ = 0 rounds teach it nothing);
    # an upper confidence bound keeps drafting.
    costs, prior = (26.2, 31.7, 44.9, 50.6, 54.1), (0.52, 0.51, 0.48, 0.56)
    unlucky = stats_of(rejected_at=np.array([[4, 0, 0, 0]] + [[0] * 4] * 3, np.int32))
    assert set(CostModel(0.0, costs, prior)(unlucky).tolist()) == {0}
    optimist = CostModel(0.0, costs, prior, explore=1.0)
    assert set(optimist(unlucky).tolist()) == {1}
    # Beta(a, b) after 4 misses: mean a / (a + b), plus one sd sqrt(m (1 - m) / (a + b + 1)).
    a, b = 0.52 * 4, 0.48 * 4 + 4
    m = a / (a + b)
    np.testing.assert_allclose(
        optimist.alpha(unlucky)[0, 0], m + np.sqrt(m * (1 - m) / (a + b + 1)), rtol=1e-5
    )
    # Firm evidence still switches drafting off, and with plenty of it the optimism
    # vanishes; it never plans below the mean.
    poor = stats_of(**per_position([[0.1] * 4] + [[0.5] * 4] * 3, rounds=100))
    assert set(optimist(poor).tolist()) == {0}
    seen = stats_of(**per_position([[0.5] * 4] * 4, rounds=10**6))
    np.testing.assert_allclose(
        optimist.alpha(seen), CostModel(0.0, costs, prior).alpha(seen), atol=1e-3
    )
    sure = stats_of(**per_position([[0.995] * 4], rounds=10**4))
    assert np.all(optimist.alpha(sure) >= CostModel(0.0, costs, prior).alpha(sure))


def test_custom_schedule_clips_and_checks():
    c = Custom(lambda s: s.accepted - 1, max_gamma=3)
    assert c(stats_of(accepted=[0, 2, 9])).tolist() == [0, 1, 3]
    with pytest.raises(TypeError, match="Custom.fn must return integers"):
        Custom(lambda s: s.accepted * 0.5)(stats_of(accepted=[1]))


def reference_ngram(history, gamma, max_n, min_n):
    for n in range(max_n, min_n - 1, -1):
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for j in range(len(history) - n - 1, -1, -1):
            if history[j : j + n] == suffix:
                follow = history[j + n : j + n + gamma]
                return follow
    return []


def test_ngram_matches_a_python_reference():
    rng = np.random.default_rng(0)
    batch, width, gamma = 64, 40, 5
    tokens = rng.integers(0, 4, size=(batch, width)).astype(np.int32)
    lengths = rng.integers(1, width + 1, size=batch).astype(np.int32)
    proposer = NGram(max_ngram=3, min_ngram=2)
    proposed, count = jax.jit(proposer.lookup, static_argnums=2)(
        jnp.asarray(tokens), jnp.asarray(lengths), gamma
    )
    for b in range(batch):
        want = reference_ngram(tokens[b, : lengths[b]].tolist(), gamma, 3, 2)
        assert int(count[b]) == len(want), b
        assert np.asarray(proposed)[b, : len(want)].tolist() == want


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Constant(0), "Constant.gamma"),
        (lambda: Heuristic(initial=9, max_gamma=8), "Heuristic.initial"),
        (lambda: Heuristic(min_gamma=5, max_gamma=2, initial=2), "min_gamma"),
        (lambda: Confidence(threshold=1.5), "Confidence.threshold"),
        (lambda: CostModel(0.1, (1.0,)), "verify_costs"),
        (lambda: CostModel(-0.1, (1.0, 1.0)), "positive"),
        (lambda: CostModel(0.1, (1.0, 1.0), prior_alpha=1.0), "prior_alpha"),
        (lambda: CostModel(0.1, (1.0, 1.0, 1.0), prior_alpha=(0.5,)), "prior_alpha"),
        (lambda: CostModel(0.1, (1.0, float("inf"))), "finite"),
        (lambda: CostModel(0.1, (1.0, 1.0), prior_weight=float("inf")), "prior_weight"),
        (lambda: CostModel(0.1, (1.0, 1.0), explore=-1.0), "explore"),
        (lambda: Custom(3), "Custom.fn"),
        (lambda: NGram(max_ngram=0), "NGram.max_ngram"),
        (lambda: NGram(max_ngram=2, min_ngram=3), "min_ngram"),
    ],
)
def test_bad_schedule_parameters(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


class Unhashable(NGram):
    """A drafter of the protocol that cannot be a static part of the program."""

    __hash__ = None


def test_bad_schedule_arguments(target, draft):
    kwargs = dict(key=jax.random.key(0), max_new_tokens=4)
    with pytest.raises(ValueError, match="either num_draft_tokens or schedule"):
        speculative_generate(
            target, draft, [[1]], num_draft_tokens=2, schedule=Constant(2), **kwargs
        )
    with pytest.raises(TypeError, match="schedule must be an int"):
        speculative_generate(target, draft, [[1]], schedule="4", **kwargs)
    with pytest.raises(TypeError, match="schedule must be an int"):
        speculative_generate(target, draft, [[1]], schedule=lambda s: 2, **kwargs)
    with pytest.raises(ValueError, match="schedule must be an integer >= 1"):
        speculative_generate(target, draft, [[1]], schedule=0, **kwargs)
    with pytest.raises(ValueError, match="Confidence needs a draft model"):
        speculative_generate(target, NGram(), [[1]], schedule=Confidence(), **kwargs)
    with pytest.raises(TypeError, match="a drafter with the methods init, prepare"):
        speculative_generate(target, 42, [[1]], **kwargs)
    with pytest.raises(TypeError, match="must be hashable"):
        speculative_generate(target, Unhashable(), [[1]], **kwargs)
    # a draft named by a string is loaded (io.draft.load_draft): "ngram" is prompt lookup
    kwargs["num_draft_tokens"] = 2  # a fixed γ: the default's costs are not the subject
    by_name = speculative_generate(target, "ngram", [[1, 2, 1]], **kwargs)
    same = speculative_generate(target, NGram(), [[1, 2, 1]], **kwargs)
    assert by_name.tokens.tolist() == same.tokens.tolist()
