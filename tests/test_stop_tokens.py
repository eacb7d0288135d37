"""Stop sequences inside the program (`Generator(..., stop_sequences=...)`): a row ends at
the first completion of any of its sequences within its generated tokens, and its tokens
up to there are those it gets without stop sequences (greedy and sampled, in a chain, a
tree and slots); a sequence may span two rounds or end inside a round's accepted drafts."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_head, make_model, ragged_prompts

from jax_specdec import Generator, SamplingConfig
from jax_specdec.decode.state import _ended
from jax_specdec.decode.stop_tokens import first_stop, stop_array
from jax_specdec.decode.tree import Tree

VOCAB, NEW = 16, 16


@pytest.fixture(scope="module")
def target():
    return make_model(7, vocab=VOCAB, scale=0.5)


def first_end(tokens, sequences) -> int | None:
    """The length of the shortest prefix of `tokens` that ends with one of `sequences`."""
    for end in range(1, len(tokens) + 1):
        if any(end >= len(s) and list(tokens[end - len(s) : end]) == list(s) for s in sequences):
            return end
    return None


def test_first_stop_finds_sequences_across_rounds_and_inside_one():
    # row 0: [9 | 1 2] + new [3 4 5 6]: [2, 3] spans the rounds and ends at new index 0;
    # row 1: new [4 5 6 7] holds [5, 6] ending at index 2; row 2: [9, 1] lies in the
    # prompt only (no stop); row 3: two sequences, the earlier end wins.
    tokens = np.zeros((4, 12), np.int32)
    tokens[0, :3], tokens[1, :3], tokens[2, :3], tokens[3, :3] = (
        [9, 1, 2],
        [9, 1, 2],
        [9, 1, 2],
        [9, 1, 2],
    )
    new = np.array([[3, 4, 5, 6], [4, 5, 6, 7], [3, 3, 3, 3], [4, 5, 6, 7]])
    tokens[:, 3:7] = new
    stops = stop_array([[[2, 3]], [[5, 6]], [[9, 1]], [[6, 7], [4]]], VOCAB)
    start = jnp.full((4,), 3, jnp.int32)
    prompt_lengths = jnp.array([2, 3, 2, 3], jnp.int32)
    hit, at = first_stop(jnp.asarray(tokens), start, prompt_lengths, 4, jnp.asarray(stops))
    assert hit.tolist() == [True, True, False, True]
    assert at.tolist()[:2] == [0, 2] and at.tolist()[3] == 0


@pytest.mark.parametrize(
    ("count", "eos", "stops", "expected"),
    [
        (4, None, [[4, 5]], (3, True)),  # ends at new index 2: three tokens kept
        (2, None, [[4, 5]], (2, False)),  # ends past the tokens emitted (a rejected draft)
        (2, None, [[2, 3]], (1, True)),  # spans the round before
        (4, (3,), [[4, 5]], (1, True)),  # an EOS first
        (4, (6,), [[4, 5], [3]], (1, True)),  # the earliest of two
    ],
)
def test_a_round_keeps_its_tokens_up_to_the_first_stop(count, eos, stops, expected):
    tokens = jnp.zeros((1, 10), jnp.int32).at[0, :3].set(jnp.array([9, 1, 2]))
    state = types.SimpleNamespace(
        tokens=tokens,
        lengths=jnp.array([3]),
        prompt_lengths=jnp.array([2]),
        sampling=types.SimpleNamespace(stop_tokens=jnp.asarray(stop_array([stops], VOCAB))),
    )
    config = types.SimpleNamespace(eos_token_id=eos)
    new = jnp.array([[3, 4, 5, 6]])
    kept, ended = _ended(state, new, jnp.array([count]), config)
    assert (int(kept[0]), bool(ended[0])) == expected


@pytest.mark.parametrize(
    "shape", ["chain", *(pytest.param(s, marks=pytest.mark.slow) for s in ("tree", "slots"))]
)
def test_rows_stop_at_their_first_sequence_with_the_tokens_they_get_without(target, shape):
    """Draft = target at T = 0 keeps every draft (rounds of γ + 1 = 4 tokens after the
    first), so sequences taken at offsets 1..NEW cover ends inside a round's drafts and
    sequences spanning two rounds; at T = 1 rows of random drafts check the same."""
    prompts = ragged_prompts(6, VOCAB, seed=3)
    if shape == "tree":
        gen = Generator(target, make_head(target), schedule=3, tree=Tree(6, 3, 2))
    else:
        gen = Generator(target, target, schedule=3)
    extra = {"num_slots": 2} if shape == "slots" else {}
    sampling = [SamplingConfig(0.0) if b % 2 else SamplingConfig(1.0) for b in range(6)]
    call = lambda stops: gen(  # noqa: E731
        prompts,
        key=jax.random.key(2),
        max_new_tokens=NEW,
        sampling=sampling,
        stop_sequences=stops,
        **extra,
    )
    free = call(None)
    tokens = np.asarray(free.tokens)
    # row b stops at a sequence of (b % 3) + 1 tokens ending at generated token 2 + 2b
    # (the first occurrence wins), plus one sequence that never occurs.
    rows = []
    for b in range(6):
        end, size = 2 + 2 * b, b % 3 + 1
        rows.append([list(tokens[b, max(end - size, 0) : end]), [VOCAB - 1] * 5])
    out = call(rows)
    for b in range(6):
        n = first_end(tokens[b], rows[b])
        assert int(out.lengths[b]) == n
        np.testing.assert_array_equal(np.asarray(out.tokens)[b, :n], tokens[b, :n])


def test_a_sequence_in_the_prompt_does_not_stop(target):
    """[5, 7] is the prompt's tail and [7, t0] spans the prompt and the first token:
    neither stops the row unless it recurs among the generated tokens."""
    gen, prompt = Generator(target), [3, 5, 7]
    free = np.asarray(gen([prompt], key=jax.random.key(0), max_new_tokens=8).tokens)[0]
    for stops in ([[5, 7]], [[7, int(free[0])]]):
        out = gen([prompt], key=jax.random.key(0), max_new_tokens=8, stop_sequences=stops)
        assert int(out.lengths[0]) == (first_end(free, stops) or 8)
        assert int(out.lengths[0]) > 1


@pytest.mark.parametrize(
    ("stops", "message"),
    [
        ([[[1], []], [[2]]], "row 0: a stop sequence needs at least one token"),
        ([[]], r"one such list per prompt \(\[B\] = \[2\] lists\)"),
        ([[VOCAB]], rf"row 0: stop token ids must lie in \[0, {VOCAB}\)"),
        ("ab", "stop_sequences must be a list of token-id lists"),
        ([[[1]], [[2]], [[3]]], r"one such list per prompt \(\[B\] = \[2\] lists\)"),
    ],
)
def test_bad_stop_sequences_are_refused(target, stops, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Generator(target).bind(
            [[1], [2]], key=jax.random.key(0), max_new_tokens=2, stop_sequences=stops
        )
