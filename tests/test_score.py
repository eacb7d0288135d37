"""`score`: the log-likelihood of given continuations equals a forward pass over each row
alone (rows of ragged lengths share one padded batch), "greedy" is right, bad input is
refused naming the row."""

import jax
import numpy as np
import pytest
from helpers import make_model

from jax_specdec import score

VOCAB = 32


@pytest.fixture(scope="module")
def model():
    return make_model(4, vocab=VOCAB, scale=0.3)


def alone(model, context, continuation) -> np.ndarray:
    """Each continuation token's log-probability from a forward pass over this row only."""
    tokens = np.asarray([list(context) + list(continuation)], np.int32)
    logp = np.asarray(jax.nn.log_softmax(model(tokens)[0], axis=-1), np.float64)
    n = len(context)
    return np.array([logp[n - 1 + i, t] for i, t in enumerate(continuation)])


def test_scores_equal_a_forward_pass_per_row(model):
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 7, 3, 12)]
    continuations = [rng.integers(0, VOCAB, n).tolist() for n in (5, 1, 9, 2)]
    out = score(model, contexts, continuations)
    for b, (ctx, cont) in enumerate(zip(contexts, continuations, strict=True)):
        expected = alone(model, ctx, cont)
        np.testing.assert_allclose(out.logprobs[b], expected, rtol=1e-5, atol=1e-5)
        assert out.total[b] == pytest.approx(expected.sum(), rel=1e-5)
        assert not out.greedy[b]


def test_greedy_is_the_argmax_continuation(model):
    context, cont = [3, 1, 4], []
    for _ in range(6):
        logits = np.asarray(model(np.asarray([context + cont], np.int32))[0, -1])
        cont.append(int(logits.argmax()))
    changed = cont[:-1] + [(cont[-1] + 1) % VOCAB]
    out = score(model, [context, context], [cont, changed])
    assert out.greedy.tolist() == [True, False]
    assert out.total[0] > out.total[1]


@pytest.mark.parametrize(
    ("contexts", "continuations", "message"),
    [
        ([[1]], [[2], [3]], "one continuation per context"),
        ([[1], []], [[2], [3]], "row 1: the context and the continuation need a token each"),
        ([[1]], [[VOCAB]], r"row 0: token ids must lie in \[0, 32\)"),
        ([[1] * 128], [[2]], "row 0: 129 tokens exceed the model's context of 128"),
    ],
)
def test_bad_input_names_the_row(model, contexts, continuations, message):
    with pytest.raises(ValueError, match=message):
        score(model, contexts, continuations)
