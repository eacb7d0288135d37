"""Per-row sampling: rows of several settings in one program, each sampled by its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    NUM_SAMPLES,
    PROMPTS,
    VOCAB,
    assert_follows_target,
    count_compiles,
    exact_sequence_probs,
    make_head,
    ragged_prompts,
)

from jax_specdec import Generator, NGram, speculative_generate
from jax_specdec.sampling import RowSampling, SamplingConfig, SamplingPlan, probs_from_logits

S = SamplingConfig
MIXED = [S(0.0), S(0.7), S(1.0), S(1.0, top_p=0.9), S(0.8, top_k=3), S(0.0), S(1.0, min_p=0.2)]


def test_row_probs_are_each_rows_own_probs():
    """A row's probabilities in a mixed batch are those of its own setting (to float32
    rounding: XLA may fuse another program's reductions differently)."""
    logits = jax.random.normal(jax.random.key(0), (len(MIXED), 3, 50)) * 3
    rows = jax.tree.map(jnp.asarray, RowSampling.of(MIXED))
    got = np.asarray(jax.jit(RowSampling.probs)(rows, logits))
    for b, s in enumerate(MIXED):
        want = np.asarray(probs_from_logits(logits[b], s))
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-8, err_msg=str(s))
        assert np.array_equal(got[b] > 0, want > 0)  # the same tokens kept


def test_plan_is_the_static_union_of_the_rows():
    plan = SamplingPlan.of(MIXED)
    assert plan == SamplingPlan(greedy=False, any_greedy=True, top_k=3, top_p=True, min_p=True)
    assert SamplingPlan.of([S(0.0)]).greedy and not SamplingPlan.of([S(0.0), S(1.0)]).greedy
    # A greedy row's top-k and top-p never enter the plan: greedy ignores them.
    assert SamplingPlan.of([S(0.0, top_k=5, top_p=0.5)]) == SamplingPlan(True, True, 0, False)
    assert plan.covers(SamplingPlan.of([S(1.0, top_k=2)]))
    assert not plan.covers(SamplingPlan.of([S(1.0, top_k=4)]))
    assert not SamplingPlan.of([S(1.0)]).covers(SamplingPlan.of([S(0.0)]))
    assert not SamplingPlan.of([S(1.0)]).covers(SamplingPlan.of([S(1.0, min_p=0.1)]))
    with pytest.raises(ValueError, match="does not cover"):
        RowSampling.of([S(1.0, top_k=9)], plan)


def test_bad_per_row_sampling_names_the_argument(target):
    gen = Generator(target)
    with pytest.raises(ValueError, match=r"sampling must be one SamplingConfig or \[B\] = \[2\]"):
        gen.bind([[1], [2]], key=jax.random.key(0), max_new_tokens=2, sampling=[S(1.0)])
    with pytest.raises(TypeError, match=r"sampling\[1\] must be a SamplingConfig"):
        gen.bind([[1], [2]], key=jax.random.key(0), max_new_tokens=2, sampling=[S(1.0), 0.5])
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig or one per prompt"):
        gen.bind([[1]], key=jax.random.key(0), max_new_tokens=2, sampling="greedy")


def _generators(target, draft):
    head = make_head(target)
    return {
        "draft model": Generator(target, draft, schedule=3),
        "head, slots": (Generator(target, head, schedule=3), 2),
        "head tree": Generator(target, head, schedule=3, tree=6),
        "n-gram tree, slots": (Generator(target, NGram(), schedule=3, tree=5), 3),
    }


@pytest.mark.parametrize("name", ["draft model", "head, slots", "head tree", "n-gram tree, slots"])
@pytest.mark.slow
def test_each_row_gets_the_tokens_of_its_own_setting(target, draft, name):
    """A batch mixing greedy, temperature, top-p and top-k rows (through slots where
    named): every row's tokens equal those it gets in a batch of its own setting with
    the same key."""
    gen = _generators(target, draft)[name]
    gen, slots = gen if isinstance(gen, tuple) else (gen, None)
    prompts = ragged_prompts(len(MIXED), VOCAB, seed=3)
    keys = jax.random.split(jax.random.key(7), len(MIXED))
    mixed = gen(prompts, key=keys, max_new_tokens=10, sampling=MIXED, num_slots=slots)
    for setting in dict.fromkeys(MIXED):
        alone = gen(prompts, key=keys, max_new_tokens=10, sampling=setting)
        rows = [b for b, s in enumerate(MIXED) if s == setting]
        np.testing.assert_array_equal(
            np.asarray(mixed.tokens)[rows], np.asarray(alone.tokens)[rows], err_msg=str(setting)
        )
    # Rows 0 and 5 (greedy) on different prompts; rows 1 and 2 differ in temperature only.
    assert mixed.stats.rounds.sum() > 0


def test_one_program_for_any_mix_under_one_plan(target, draft):
    """Settings are arrays: a second call with other settings under the same plan reuses
    the compiled program."""
    gen = Generator(target, draft, schedule=2)
    prompts = ragged_prompts(4, VOCAB, seed=1)
    plan = SamplingPlan.of(MIXED)
    first = RowSampling.of([S(0.0), S(1.0), S(0.5, top_p=0.8), S(1.0, top_k=2)], plan)
    second = RowSampling.of([S(0.9, top_k=3), S(0.0), S(0.0), S(0.3)], plan)
    gen(prompts, key=jax.random.key(0), max_new_tokens=6, sampling=first)
    with count_compiles() as compiled:
        out = gen(prompts, key=jax.random.key(0), max_new_tokens=6, sampling=second)
    assert compiled[0] == 0
    greedy = gen(prompts, key=jax.random.key(0), max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(out.tokens)[1:3], np.asarray(greedy.tokens)[1:3])


MIX_FOR_CHI2 = [S(1.0), S(0.6), S(1.0, top_k=3), S(1.0, top_p=0.8), S(0.0)]


@pytest.mark.slow
def test_mixed_rows_each_follow_their_own_target_distribution(target, draft):
    """NUM_SAMPLES rows, settings in turn by pairs of rows (so each setting's rows
    alternate between the two prompts), in one program with sampled drafts: every
    setting's rows pass the enumerated chi-square test for that setting; greedy rows are
    the greedy continuation."""
    n = len(MIX_FOR_CHI2)
    which = [(b // 2) % n for b in range(NUM_SAMPLES)]
    out = speculative_generate(
        target,
        draft,
        [PROMPTS[b % 2] for b in range(NUM_SAMPLES)],
        key=jax.random.key(21),
        max_new_tokens=3,
        num_draft_tokens=2,
        sampling=[MIX_FOR_CHI2[i] for i in which],
        eos_token_id=2,
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    seqs = [tuple(tokens[b, : lengths[b]].tolist()) for b in range(NUM_SAMPLES)]
    for i, setting in enumerate(MIX_FOR_CHI2):
        rows = [seqs[b] for b in range(NUM_SAMPLES) if which[b] == i]
        if setting.greedy:
            for j, prompt in enumerate(PROMPTS):
                exact = exact_sequence_probs(target, np.array(prompt), setting, 2)
                assert set(rows[j::2]) == set(exact) and len(exact) == 1
            continue
        assert_follows_target(target, rows, setting, 2, label=f"mixed {setting}")
