"""Slots: N prompts through S rows refilled inside the program give each prompt the
tokens it gets alone, keep count of occupancy, compile once per bucket, and never copy a
cache. Every drafter's exactness through slots (greedy equality, enumerated sampling, a
wrong rule caught) is tests/test_drafter_contract.py's."""

import jax
import numpy as np
import pytest
from helpers import VOCAB, copies_outside_entry, ragged_prompts

from jax_specdec import Generator, NGram
from jax_specdec.decode import program
from jax_specdec.sampling import SamplingConfig
from jax_specdec.schedules import Custom, Heuristic

T1 = SamplingConfig(1.0)
TOPP = SamplingConfig(0.8, top_p=0.9)

# name: (draft kind, Generator settings); EOS 5 on, so rows end at different rounds. The
# drafters' own slot cases (each drafter at a constant γ, greedy and sampled, one and two
# slots) are the contract's; here: plain decoding, and schedules that vary γ per row or
# skip drafting, through 1, 3 and 7 slots.
SETUPS = {
    "autoregressive_t1": (None, dict(sampling=T1)),
    "autoregressive_greedy": (None, {}),
    "draft_heuristic_topp": ("draft", dict(schedule=Heuristic(max_gamma=4), sampling=TOPP)),
    "draft_skips_t1": ("draft", dict(schedule=Custom(lambda s: s.round % 2 * 2, 2), sampling=T1)),
}
BUDGETS = [7, 3, 12, 1, 9, 5, 10]


def generator(name, target, draft):
    kind, settings = SETUPS[name]
    proposer = {None: None, "draft": draft, "ngram": NGram()}[kind]
    return Generator(target, proposer, eos_token_id=5, **settings)


def outputs(out):
    s = out.stats
    per_row = (s.rounds, s.drafted, s.accepted, s.rejected, s.accepted_at, s.nonfinite)
    return [np.asarray(a) for a in (out.tokens, out.lengths, *per_row)]


@pytest.mark.parametrize("name", sorted(SETUPS))
@pytest.mark.slow
def test_any_slot_count_gives_the_tokens_a_prompt_gets_alone(target, draft, name):
    g = generator(name, target, draft)
    prompts = ragged_prompts(len(BUDGETS), VOCAB, seed=3)
    call = dict(key=jax.random.key(4), max_new_tokens=BUDGETS)
    alone = outputs(g(prompts, **call))
    for slots in (1, 3, len(prompts)):
        got = outputs(g(prompts, num_slots=slots, **call))
        for a, b in zip(alone, got, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"num_slots={slots}")


@pytest.mark.slow
def test_occupancy_and_rounds(target):
    prompts = ragged_prompts(5, VOCAB, seed=1)
    g = Generator(target)
    one = g(prompts, key=jax.random.key(0), max_new_tokens=[4, 9, 2, 7, 5], num_slots=1)
    # One slot is never idle: rounds = tokens - 1 per prompt, all of them useful.
    np.testing.assert_array_equal(np.asarray(one.stats.rounds), [3, 8, 1, 6, 4])
    assert int(one.stats.slot_rounds) == 22 and one.stats.occupancy == 1.0
    assert int(one.stats.target_calls) == 5 + 22  # five prefills, 22 steps
    fixed = g(prompts, key=jax.random.key(0), max_new_tokens=[4, 9, 2, 7, 5])
    # Five rows wait for the longest: 8 rounds x 5 rows, 22 of them useful.
    assert int(fixed.stats.slot_rounds) == 40 and fixed.stats.occupancy == pytest.approx(22 / 40)
    two = g(prompts, key=jax.random.key(0), max_new_tokens=[4, 9, 2, 7, 5], num_slots=2)
    assert 22 / 40 < two.stats.occupancy <= 1.0
    assert int(two.stats.slot_rounds) == 2 * (int(two.stats.target_calls) - 5)


@pytest.mark.slow
def test_no_recompilation_within_a_bucket(target, draft):
    """5, 7 and 6 prompts through 2 slots are all padded to 8 rows: one program."""
    g = Generator(target, draft, schedule=2)
    call = dict(key=jax.random.key(0), max_new_tokens=6, num_slots=2)
    prompts = lambda n, seed: [[1, 2, 3, 4, 5]] + ragged_prompts(n - 1, VOCAB, seed, 5)  # noqa: E731
    g(prompts(5, 0), **call)
    compiled = program.generate._cache_size()
    out = g(prompts(7, 1), **call)
    g(prompts(6, 2), **call)
    assert program.generate._cache_size() == compiled
    assert out.tokens.shape == (7, 6) and out.stats.rounds.shape == (7,)
    g(prompts(9, 3), **call)  # 16 rows: the next bucket
    assert program.generate._cache_size() == compiled + 1


@pytest.mark.parametrize("kind", ["draft", "ngram", None])
@pytest.mark.slow
def test_slot_loop_does_not_copy_caches(target, draft, kind):
    proposer = {"draft": draft, "ngram": NGram(), None: None}[kind]
    g = Generator(target, proposer, schedule=3) if proposer else Generator(target)
    run = g.bind(ragged_prompts(5, VOCAB), key=jax.random.key(0), max_new_tokens=8, num_slots=2)
    hlo = run.lower().compile().as_text()
    for model in [target, draft] if kind == "draft" else [target]:
        c = model.config
        shape = f"f32[2,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
        assert shape in hlo
        assert copies_outside_entry(hlo, shape) == 0, f"cache of shape {shape} copied in a loop"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_slots=0), "num_slots must be an integer >= 1"),
        (dict(num_slots=2.0), "num_slots must be an integer"),
        (dict(num_slots=4), r"num_slots \(4\) exceeds the number of prompts \(3\)"),
        (dict(max_new_tokens=[4, 5]), r"max_new_tokens must be one integer or \[B\] = \[3\]"),
        (dict(max_new_tokens=[4, 0, 5]), "max_new_tokens must be >= 1 for every prompt"),
        (dict(max_new_tokens=[4, -1, 5]), "got -1 at prompt 1"),
        (dict(max_new_tokens=[4.0, 1.0, 5.0]), r"max_new_tokens must be one integer or"),
        (dict(max_new_tokens="8"), "max_new_tokens must be an integer >= 1 or one per prompt"),
    ],
)
def test_bad_input(target, kwargs, match):
    call = dict(key=jax.random.key(0), max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        Generator(target).bind([[1], [2, 3], [4]], **call)
