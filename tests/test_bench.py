"""Measurement: interleaved timing, bound runs timed together, round calibration, and the
benchmark driver on tiny models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import VOCAB, count_compiles, ragged_prompts

from jax_specdec import Generator, SamplingConfig, speculative_generate
from jax_specdec.bench import (
    calibrate_round_costs,
    decode_step_loop,
    drop_programs_if_crowded,
    expected_batch_rounds,
    expected_tokens_per_round,
    markdown_report,
    measure,
    run_benchmark,
    time_interleaved,
)
from jax_specdec.report import markdown_table
from jax_specdec.schedules import CostModel


def test_time_interleaved_rotates_passes():
    order = []
    fns = [lambda i=i: (order.append(i), jnp.zeros(()))[1] for i in range(3)]
    timings = time_interleaved(fns, repeats=3)
    # One cold call each, then passes starting one call later each time.
    assert order == [0, 1, 2, 0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert [len(t.runs) for t in timings] == [3, 3, 3]
    assert all(t.median == float(np.median(t.runs)) for t in timings)
    with pytest.raises(ValueError, match="fns"):
        time_interleaved([])


def test_decode_step_loop_donates_and_hands_on_its_cache(target):
    """decode_step_time's loop copies no cache (it is donated, and each call gets the
    cache the previous one returned), and its calls run."""
    c = target.config
    call, lower = decode_step_loop(
        target, batch=2, tokens_per_call=3, context=5, cache_len=40, steps=4
    )
    hlo = lower().compile().as_text()
    shape = f"f32[2,{c.num_kv_heads},40,{c.head_dim}]"
    copies = [line for line in hlo.splitlines() if shape in line and " copy(" in line]
    assert shape in hlo and not copies, copies
    assert "input_output_alias" in hlo
    first, second = np.asarray(call()), np.asarray(call())  # the second gets the first's cache
    np.testing.assert_allclose(first, second, rtol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_round_calibration_gives_a_cost_model(target, draft, temperature):
    cost = calibrate_round_costs(
        target,
        draft,
        ragged_prompts(3, VOCAB),
        sampling=SamplingConfig(temperature),
        max_gamma=2,
        max_new_tokens=6,
        repeats=1,
    )
    assert isinstance(cost, CostModel) and cost.max_gamma == 2
    assert cost.draft_cost == 0 and all(c > 0 for c in cost.verify_costs)
    # The prior is the acceptance per position the calibration runs measured (random
    # models: low, not 0.6).
    prior = np.broadcast_to(cost.prior_alpha, (2,))
    assert np.all((0.01 <= prior) & (prior <= 0.99)) and not np.any(prior == 0.6)


@pytest.mark.slow
def test_round_calibration_pools_several_batches(target, draft):
    """`more_batches`: the prior is the acceptance per position pooled over every
    batch's constant-γ runs (the same key, so the same runs as here)."""
    batches = [ragged_prompts(2, VOCAB, seed=s) for s in (1, 2)]
    cost = calibrate_round_costs(
        target,
        draft,
        batches[0],
        max_gamma=2,
        max_new_tokens=6,
        repeats=1,
        more_batches=[(batches[1], None)],
    )
    accepted, tried = np.zeros(2), np.zeros(2)
    first_only = None
    for prompts in batches:
        for gamma in (1, 2):
            s = speculative_generate(
                target,
                draft,
                prompts,
                key=jax.random.key(0),
                max_new_tokens=6,
                num_draft_tokens=gamma,
                sampling=SamplingConfig(0.0),
            ).stats
            accepted[:gamma] += np.asarray(s.accepted_at).sum(0)
            tried[:gamma] += np.asarray(s.accepted_at).sum(0) + np.asarray(s.rejected_at).sum(0)
        if first_only is None:
            first_only = accepted / tried
    assert tried.min() > 0
    assert not np.allclose(first_only, accepted / tried)  # the second batch counts
    expected = np.clip(accepted / tried, 0.01, 0.99)
    np.testing.assert_allclose(np.broadcast_to(cost.prior_alpha, (2,)), expected, rtol=1e-6)
    assert len(cost.verify_costs) == 3 and min(cost.verify_costs) > 0
    with pytest.raises(ValueError, match="more_batches"):
        calibrate_round_costs(target, draft, batches[0], max_gamma=1, more_batches=[batches[1]])


@pytest.mark.slow
def test_measure_times_runs_together_and_keeps_their_outputs(target, draft):
    prompts = ragged_prompts(3, VOCAB, seed=1)
    bind = dict(key=jax.random.key(0), max_new_tokens=5)
    runs = [
        Generator(target).bind(prompts, **bind),
        Generator(target, draft, schedule=2).bind(prompts, **bind),
    ]
    ar, spec = measure(runs, repeats=2)
    assert len(ar.timing.runs) == 2 and ar.seconds == ar.timing.median
    assert ar.tokens == 15 and ar.tokens_per_second == 15 / ar.seconds
    # Greedy by default: the same tokens; only the speculative run drafted.
    np.testing.assert_array_equal(np.asarray(ar.output.tokens), np.asarray(spec.output.tokens))
    assert int(np.sum(ar.stats.drafted)) == 0 < int(np.sum(spec.stats.drafted))


@pytest.mark.slow
def test_run_benchmark_on_tiny_models(target, draft):
    results = run_benchmark(
        target,
        draft,
        batches=(2,),
        gammas=(1, 2),
        prompt_len=4,
        max_new_tokens=8,
        repeats=1,
        progress=False,
    )
    rows = results["rows"]
    assert [(r["batch"], r["gamma"]) for r in rows] == [(2, 0), (2, 1), (2, 2)]
    for r in rows[1:]:
        assert 1.0 <= r["tokens_per_round"] <= r["gamma"] + 1
        assert r["speedup"] == pytest.approx(rows[0]["seconds"] / r["seconds"])
        # 8 tokens, the first from the prefill: 7 / (γ + 1) <= rounds <= 7.
        assert 7 / (r["gamma"] + 1) <= r["expected_batch_rounds"] <= 7
        assert r["measured_over_predicted_batch"] == pytest.approx(
            r["speedup"] / r["predicted_batch_speedup"]
        )
    runs, parts = markdown_report(results).split("\n\n")
    assert len(runs.splitlines()) == 2 + 3 and len(parts.splitlines()) == 2 + 1
    first = [cell.strip() for cell in runs.splitlines()[2].split("|")[1:3]]
    assert first == ["2", "AR"]


def _simulated_max_rounds(alphas, gamma, tokens, trials=40_000, seed=0):
    """Monte Carlo of `expected_batch_rounds`: rounds of 1 + min(G, γ) tokens per row."""
    rng = np.random.default_rng(seed)
    alphas, tokens = np.asarray(alphas), np.broadcast_to(tokens, np.shape(alphas))
    have = np.zeros((trials, len(alphas)), int)
    rounds = np.zeros((trials, len(alphas)), int)
    while np.any(have < tokens):
        going = have < tokens
        gained = 1 + np.minimum(
            rng.geometric(1 - np.minimum(alphas, 1 - 1e-12), have.shape) - 1, gamma
        )
        have += np.where(going, gained, 0)
        rounds += going
    return rounds.max(1).mean()


@pytest.mark.parametrize(
    "alphas,gamma,tokens",
    [([0.8], 4, 63), ([0.8] * 8, 4, 63), ([0.5, 0.9, 0.7], 2, [40, 63, 10]), ([0.3] * 4, 1, 20)],
)
def test_expected_batch_rounds_matches_simulation(alphas, gamma, tokens):
    exact = expected_batch_rounds(alphas, gamma, tokens)
    assert exact == pytest.approx(_simulated_max_rounds(alphas, gamma, tokens), rel=0.01)


def test_expected_batch_rounds_edges():
    assert expected_batch_rounds([0.0, 0.0], 3, 17) == pytest.approx(17)  # one token a round
    assert expected_batch_rounds([1.0] * 5, 3, 17) == pytest.approx(5)  # ceil(17 / 4)
    assert expected_batch_rounds([0.6], 2, 0) == 0
    # One row: about tokens / E[tokens per round]; a batch of eight needs more rounds.
    one = expected_batch_rounds([0.8], 4, 63)
    assert one == pytest.approx(63 / expected_tokens_per_round(0.8, 4), rel=0.06)
    assert expected_batch_rounds([0.8] * 8, 4, 63) > 1.15 * one
    with pytest.raises(ValueError, match="gamma"):
        expected_batch_rounds([0.5], -1, 4)


def test_markdown_table_pads_and_aligns():
    table = markdown_table(["name", "value"], [["a", "1.5"], ["long name", "10.25"]])
    assert table.splitlines() == [
        "| name      | value |",
        "|-----------|-------|",
        "| a         |   1.5 |",
        "| long name | 10.25 |",
    ]
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        markdown_table(["a", "b"], [["x"]])


def test_programs_are_dropped_only_when_memory_maps_crowd():
    twice, x = jax.jit(lambda x: x * 3 + 1), jnp.ones(3)
    twice(x)
    with count_compiles() as compiled:
        assert not drop_programs_if_crowded(fraction=1e9)
        twice(x)
    assert compiled[0] == 0
    with count_compiles() as compiled:
        assert drop_programs_if_crowded(fraction=0.0)
        twice(x)
    assert compiled[0] == 1
