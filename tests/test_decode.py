"""The compiled loops: acceptance counts, keys, prompts as arrays, compilation, budgets, bad
input. The exactness of every drafter (greedy equality, enumerated sampling, a wrong rule
caught, rows independent of the batch) is tests/test_drafter_contract.py's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    VOCAB,
    copies_outside_entry,
    count_compiles,
    make_draft,
    make_model,
    ragged_prompts,
)

from jax_specdec import Generator, SamplingConfig, autoregressive_generate, speculative_generate

# ---------------------------------------------------------------- acceptance


@pytest.mark.slow
def test_draft_identical_to_target_accepts_everything(target):
    prompts = ragged_prompts(8, VOCAB, seed=3)
    out = speculative_generate(
        target,
        target,
        prompts,
        key=jax.random.key(2),
        max_new_tokens=20,
        num_draft_tokens=4,
        sampling=SamplingConfig(1.0),
    )
    s = out.stats
    assert s.acceptance_rate == 1.0
    np.testing.assert_array_equal(np.asarray(s.accepted), np.asarray(s.drafted))
    # 19 tokens after the prefill's first, 5 per round: 4 rounds.
    assert np.asarray(s.rounds).tolist() == [4] * 8
    assert np.asarray(s.accepted_at).min() == 4


# ---------------------------------------------------------------- keys and batches


def test_same_key_same_output_and_one_key_is_folded_in_per_row(target, draft):
    """(A row's tokens do not depend on its neighbours: tests/test_drafter_contract.py.)"""
    prompts = ragged_prompts(8, VOCAB, seed=5)
    keys = jax.random.split(jax.random.key(7), 8)
    kwargs = dict(max_new_tokens=12, num_draft_tokens=3, sampling=SamplingConfig(0.9))
    a = speculative_generate(target, draft, prompts, key=keys, **kwargs)
    b = speculative_generate(target, draft, prompts, key=keys, **kwargs)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    # One key: row b uses fold_in(key, b).
    one = speculative_generate(target, draft, prompts, key=jax.random.key(7), **kwargs)
    folded = jax.vmap(lambda b: jax.random.fold_in(jax.random.key(7), b))(jnp.arange(8))
    two = speculative_generate(target, draft, prompts, key=folded, **kwargs)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(two.tokens))


@pytest.mark.slow
def test_array_prompts_with_lengths_equal_list_prompts(target, draft):
    prompts = ragged_prompts(4, VOCAB, seed=6)
    width = max(map(len, prompts))
    array = np.full((4, width), 5, np.int32)
    for b, p in enumerate(prompts):
        array[b, : len(p)] = p
    kwargs = dict(key=jax.random.key(3), max_new_tokens=7, num_draft_tokens=2)
    kwargs["sampling"] = SamplingConfig(1.0)
    a = speculative_generate(target, draft, prompts, **kwargs)
    b = speculative_generate(
        target, draft, array, prompt_lengths=np.array([len(p) for p in prompts]), **kwargs
    )
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


@pytest.mark.slow
def test_no_recompilation_on_second_call(target, draft):
    prompts = ragged_prompts(4, VOCAB, seed=8)
    other = [[(t + 1) % VOCAB for t in p] for p in prompts]  # same shapes, other values
    kwargs = dict(max_new_tokens=9, num_draft_tokens=3)
    with count_compiles() as first:
        speculative_generate(target, draft, prompts, key=jax.random.key(0), **kwargs)
        autoregressive_generate(target, prompts, key=jax.random.key(0), max_new_tokens=9)
    assert first[0] >= 2  # the counter sees both programs compile
    with count_compiles() as second:
        speculative_generate(target, draft, other, key=jax.random.key(1), **kwargs)
        autoregressive_generate(target, other, key=jax.random.key(5), max_new_tokens=9)
    assert second[0] == 0


def test_budget_and_frozen_rows(target, draft):
    out = speculative_generate(
        target,
        draft,
        [[1], [2, 3, 4, 5, 0, 1]],
        key=jax.random.key(0),
        max_new_tokens=1,
        num_draft_tokens=2,
    )
    assert np.asarray(out.lengths).tolist() == [1, 1]
    assert np.asarray(out.stats.rounds).tolist() == [0, 0]
    out = speculative_generate(
        target, draft, [[1], [2, 3]], key=jax.random.key(0), max_new_tokens=10, num_draft_tokens=4
    )
    assert np.asarray(out.lengths).tolist() == [10, 10]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"prompts": [[1, 2], []]}, ValueError, r"prompts\[1\] is empty"),
        ({"prompts": []}, ValueError, "prompts is empty"),
        ({"prompts": [[1, 6]]}, ValueError, r"outside \[0, 6\)"),
        ({"prompts": [[1, -1]]}, ValueError, r"outside \[0, 6\)"),
        ({"prompts": "abc"}, TypeError, "prompts must be"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 200}, ValueError, "config.max_len"),
        ({"num_draft_tokens": 0}, ValueError, "num_draft_tokens"),
        ({"key": jax.random.split(jax.random.key(0), 3)}, ValueError, "key must be"),
        ({"key": 0}, TypeError, "key must be"),
        ({"eos_token_id": 6}, ValueError, "eos_token_id"),
        ({"sampling": {"temperature": 1}}, TypeError, "sampling"),
        ({"prompts": np.zeros((2, 3), np.float32)}, TypeError, "integer"),
        (
            {"prompts": np.zeros((2, 3), np.int32), "prompt_lengths": [1]},
            ValueError,
            "prompt_lengths",
        ),
    ],
)
def test_bad_input(target, draft, kwargs, error, match):
    args = dict(prompts=[[1, 2], [3]], key=jax.random.key(0), max_new_tokens=4, num_draft_tokens=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        speculative_generate(target, draft, args.pop("prompts"), **args)


def test_vocabularies_must_match_unless_padded(target):
    padded = make_model(3, vocab=VOCAB + 2, num_layers=1)
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative_generate(target, padded, [[1]], key=jax.random.key(0), max_new_tokens=3)
    call = dict(key=jax.random.key(0), max_new_tokens=5, num_draft_tokens=4)  # not auto
    out = speculative_generate(target, padded, [[1]], vocab_size=VOCAB, **call)
    assert int(np.asarray(out.tokens).max()) < VOCAB
    # A string is a draft to load (a path, zoo name or Hub id): none here, named as such.
    with pytest.raises(ValueError, match="--draft: nowhere is not a model directory"):
        speculative_generate(target, "nowhere", [[1]], key=jax.random.key(0), max_new_tokens=2)


def test_nonfinite_logits_are_reported(target, draft):
    broken = make_model(0)
    head = broken.lm_head if broken.lm_head is not None else broken.embed
    head.set_value(head.get_value().at[0, 0].set(jnp.nan))
    with pytest.warns(RuntimeWarning, match="NaN/inf logits"):
        # a fixed width (auto with NaN weights: tests/test_bad_input.py's generate run)
        out = speculative_generate(
            broken, draft, [[1, 2]], key=jax.random.key(0), max_new_tokens=4, num_draft_tokens=4
        )
    assert bool(np.asarray(out.stats.nonfinite)[0])
    with pytest.warns(RuntimeWarning, match="NaN/inf logits"):
        autoregressive_generate(broken, [[1, 2]], key=jax.random.key(0), max_new_tokens=4)


@pytest.mark.parametrize("speculative", [True, False])
def test_compiled_loop_does_not_copy_caches(target, draft, speculative):
    generator = Generator(target, draft, schedule=3) if speculative else Generator(target)
    run = generator.bind([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=8)
    hlo = run.lower().compile().as_text()
    assert "while" in hlo  # one program: the loop over rounds is inside it
    for model in [target, draft] if speculative else [target]:
        c = model.config
        shape = f"f32[2,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
        assert shape in hlo
        assert copies_outside_entry(hlo, shape) == 0, f"cache of shape {shape} copied in a loop"


def _skip_second_round(stats):
    return jnp.where(stats.round == 1, 0, 2)


@pytest.mark.parametrize(
    "schedule,slots",
    [
        (2, None),
        pytest.param("skip", None, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
    ],
    ids=["prefills", "catch-up", "slots"],
)
def test_the_lm_head_runs_on_one_prompt_token_a_row(schedule, slots):
    """The prefills (the target's and a draft model's, of the whole batch or of a slot
    in chunks) and a draft model's catch-up after γ = 0 rounds run the LM head on one
    token a row: the compiled program holds no logits wider than a verify call's γ + 1
    (over a prompt they take rows × prompt × vocabulary floats)."""
    from jax_specdec.schedules import Custom

    if schedule == "skip":  # a γ = 0 round: the draft model catches up
        schedule = Custom(_skip_second_round, max_gamma=2)
    vocab = 997  # no other dimension of the program
    target, draft = make_model(0, vocab), make_draft(vocab=vocab)
    prompts = ragged_prompts(3, vocab, seed=3, max_len=13)
    run = Generator(target, draft, schedule=schedule).bind(
        prompts, key=jax.random.key(0), max_new_tokens=4, num_slots=slots
    )
    hlo = run.lower().compile().as_text()
    # [rows, T, V] or flattened [rows · T, V]; not the LM heads' weights [D, V]
    weights = {(target.config.d_model,), (draft.config.d_model,)}
    leading = {
        tuple(map(int, dims.split(","))) for dims in re.findall(rf"f32\[([\d,]+),{vocab}\]", hlo)
    }
    tokens = {int(np.prod(dims)) for dims in leading - weights}
    assert max(tokens) <= (slots or 3) * 3, f"logits of {sorted(tokens)} tokens"


@pytest.mark.slow
def test_ngram_constant_schedule_runs_rounds_of_width_zero_or_gamma(target):
    """A model-free drafter under a constant γ compiles two round widths (0 and γ): a
    row whose match is shorter still tests only its own drafts, in a width-γ round."""
    from jax_specdec import NGram

    prompts = ragged_prompts(6, VOCAB, seed=2)
    call = dict(key=jax.random.key(0), max_new_tokens=24)
    out = Generator(target, NGram(), schedule=3)(prompts, **call)
    widths = np.asarray(out.stats.gamma_rounds)
    assert widths[1] == widths[2] == 0 and widths[3] > 0
    assert np.asarray(out.stats.drafted).sum() < 3 * widths[3] * len(prompts)  # short matches
    alone = Generator(target)(prompts, **call)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(alone.tokens))


def test_several_stop_ids_end_rows_at_the_first_and_finish_reasons_say_so(target, draft):
    """eos_token_id may be a list: a row ends at the first of them it emits (kept); the
    finish reason is "eos" there and "length" at the budget (greedy: the tokens are the
    autoregressive ones up to there); bad lists are refused."""
    from jax_specdec.decode.stats import finish_reasons

    prompts = ragged_prompts(12, VOCAB, seed=9)
    call = dict(key=jax.random.key(3), max_new_tokens=10)
    free = Generator(target)(prompts, **call)
    both = Generator(target, draft, schedule=2, eos_token_id=[5, 1])
    assert both.stop_ids == (1, 5)
    out = both(prompts, **call)
    reasons = finish_reasons(out, 10, both.stop_ids)
    for b, free_row in enumerate(np.asarray(free.tokens).tolist()):
        stop = next((i for i, t in enumerate(free_row) if t in (1, 5)), None)
        n = 10 if stop is None else stop + 1
        assert int(out.lengths[b]) == n
        assert np.asarray(out.tokens)[b, :n].tolist() == free_row[:n]
        assert reasons[b] == ("length" if stop is None else "eos")
    assert {"eos", "length"} <= set(reasons)
    for bad, message in (([], "empty list"), ([1, 99], "must lie in"), ("x", "integer")):
        with pytest.raises(ValueError, match=message):
            Generator(target, eos_token_id=bad)
