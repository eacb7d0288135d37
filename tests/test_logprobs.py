"""Log-probabilities of generated tokens (`Generator(..., logprobs=N)`): each token's value
and its top alternatives equal those of a forward pass over the row's prompt and tokens,
with the row's transforms applied in NumPy (bias and penalties, temperature, top-k,
min-p), for autoregressive decoding and for every round shape: a draft model's chain
(token and block acceptance), a feature head's tree, slots."""

import jax
import numpy as np
import pytest
from helpers import make_draft, make_head, make_model, penalised_logits, ragged_prompts

from jax_specdec import Generator, SamplingConfig
from jax_specdec.decode.tree import Tree

VOCAB, NEW, TOP = 32, 12, 5
SETTINGS = (
    SamplingConfig(0.0),
    SamplingConfig(0.7, top_k=5),
    SamplingConfig(1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    SamplingConfig(1.0, min_p=0.1, logit_bias=((3, 2.0), (7, -1.5))),
)


@pytest.fixture(scope="module")
def models():
    target = make_model(3, vocab=VOCAB, scale=0.5)
    return {"target": target, "draft": make_draft(vocab=VOCAB), "head": make_head(target)}


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def transformed(logits, s: SamplingConfig):
    """Log-probabilities [n, V] of the distribution a row of setting `s` samples from,
    from its biased and penalised logits [n, V] (greedy: at temperature 1)."""
    if s.temperature == 0.0:
        return log_softmax(logits)
    scaled = logits / s.temperature
    if s.top_k:
        kth = np.sort(scaled, axis=-1)[:, -s.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    logp = log_softmax(scaled)
    if s.min_p:
        keep = logp >= np.log(s.min_p) + logp.max(axis=-1, keepdims=True)
        logp = np.where(keep, logp, -np.inf)
        logp = logp - np.log(np.exp(logp).sum(axis=-1, keepdims=True))
    return logp


def expected(target, prompt, tokens, s: SamplingConfig, kind: str) -> np.ndarray:
    """[len(tokens), V]: the distribution at each generated position, from one forward
    pass over the prompt and the tokens."""
    seq = np.asarray([list(prompt) + list(tokens)], np.int32)
    logits = np.asarray(target(seq)[0], np.float64)[len(prompt) - 1 : seq.shape[1] - 1]
    if kind == "raw":
        return log_softmax(logits)
    logits = penalised_logits(logits[None], prompt, [list(tokens)], s)[0].astype(np.float64)
    return transformed(logits, s)


def run(models, shape, kind="processed", **extra):
    target = models["target"]
    if shape == "autoregressive":
        gen = Generator(target)
    elif shape == "tree":
        gen = Generator(target, models["head"], schedule=3, tree=Tree(6, 3, 2))
    else:
        acceptance = "block" if shape == "block" else "token"
        gen = Generator(target, models["draft"], schedule=3, acceptance=acceptance)
    prompts = ragged_prompts(8, VOCAB, seed=1)
    sampling = [SETTINGS[b % len(SETTINGS)] for b in range(len(prompts))]
    out = gen(
        prompts,
        key=jax.random.key(4),
        max_new_tokens=NEW,
        sampling=sampling,
        logprobs=TOP,
        logprob_kind=kind,
        **extra,
    )
    return prompts, sampling, out


def check(target, prompts, sampling, out, kind):
    lengths, tokens = np.asarray(out.lengths), np.asarray(out.tokens)
    lp = jax.tree.map(np.asarray, out.logprobs)
    for b, prompt in enumerate(prompts):
        n = lengths[b]
        ref = expected(target, prompt, tokens[b, :n], sampling[b], kind)
        chosen = ref[np.arange(n), tokens[b, :n]]
        assert np.isfinite(lp.chosen[b, :n]).all()
        np.testing.assert_allclose(lp.chosen[b, :n], chosen, atol=1e-5, rtol=1e-5)
        top = np.take_along_axis(ref, lp.top_ids[b, :n], axis=1)
        np.testing.assert_allclose(lp.top_values[b, :n], top, atol=1e-5, rtol=1e-5)
        best = -np.sort(-ref, axis=1)[:, :TOP]
        np.testing.assert_allclose(lp.top_values[b, :n], best, atol=1e-5, rtol=1e-5)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "shape",
    ["chain", *(pytest.param(s, marks=SLOW) for s in ("autoregressive", "block", "tree", "slots"))],
)
def test_logprobs_equal_a_forward_pass(models, shape):
    extra = {"num_slots": 3} if shape == "slots" else {}
    prompts, sampling, out = run(models, "chain" if shape == "slots" else shape, **extra)
    check(models["target"], prompts, sampling, out, "processed")
    if shape != "autoregressive":
        stats = out.stats
        assert int(np.sum(stats.accepted)) > 0  # drafts were kept: their values were checked


@SLOW
def test_raw_logprobs_are_the_models(models):
    prompts, sampling, out = run(models, "chain", kind="raw")
    check(models["target"], prompts, sampling, out, "raw")


@SLOW
def test_greedy_rows_match_autoregressive_decoding(models):
    """The same tokens (greedy rows), the same values, whichever way they were made."""
    _, sampling, ar = run(models, "autoregressive")
    _, _, spec = run(models, "tree")
    for b, s in enumerate(sampling):
        if s.temperature == 0.0:
            n = int(ar.lengths[b])
            np.testing.assert_array_equal(spec.tokens[b, :n], ar.tokens[b, :n])
            np.testing.assert_allclose(
                spec.logprobs.chosen[b, :n], ar.logprobs.chosen[b, :n], atol=1e-5
            )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\], got -1"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
        ({"logprobs": 0, "logprob_kind": "soft"}, "logprob_kind must be one of"),
        ({"logprobs": 7, "vocab": 6}, r"logprobs \(7\) exceeds the vocabulary \(6\)"),
    ],
)
def test_bad_logprob_settings_are_refused(models, kwargs, message):
    target = make_model(1, vocab=kwargs.pop("vocab")) if "vocab" in kwargs else models["target"]
    with pytest.raises(ValueError, match=message):
        Generator(target).bind([[1, 2]], key=jax.random.key(0), max_new_tokens=2, **kwargs)
