"""Logit bias and repetition, presence and frequency penalties: greedy speculative output
equals autoregressive output with the same settings (chains, trees, slots), the
repetition penalty equals `transformers`' `generate(repetition_penalty=...)`, the bias
forces and bans tokens, and bad settings are refused in one line. Their enumerated
exactness (and a wrong count caught) is tests/test_drafter_contract.py's."""

import jax
import numpy as np
import pytest
from helpers import make_head, ragged_prompts

from jax_specdec import Generator, NGram, SamplingConfig
from jax_specdec.penalties import Seen

VOCAB = 32
PROMPTS = [(p * 3)[:10] for p in ragged_prompts(5, VOCAB, seed=2, max_len=5)]
CALL = dict(key=jax.random.key(0), max_new_tokens=[14, 6, 16, 10, 12])
SETTINGS = {
    "rep": SamplingConfig(0.0, repetition_penalty=1.8),
    "pres_freq_bias": SamplingConfig(
        0.0, presence_penalty=0.7, frequency_penalty=0.6, logit_bias={3: 0.8, 5: -1.0}
    ),
}


@pytest.fixture(scope="module")
def pair():
    from helpers import make_model

    target = make_model(3, vocab=VOCAB, scale=0.3)
    return target, target  # the target as its own draft model: drafts accepted often


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_speculative_equals_autoregressive(pair, setting):
    target, draft = pair
    kw = dict(sampling=SETTINGS[setting], eos_token_id=2)
    ar = Generator(target, **kw)(PROMPTS, **CALL)
    plain = Generator(target, eos_token_id=2)(PROMPTS, **CALL)
    assert not np.array_equal(np.asarray(ar.tokens), np.asarray(plain.tokens)), "no effect"
    runs = {
        "draft model chain": Generator(target, draft, schedule=3, **kw)(PROMPTS, **CALL),
        "n-gram tree": Generator(target, NGram(), schedule=3, tree=6, **kw)(PROMPTS, **CALL),
        "feature head tree": Generator(target, make_head(target), schedule=2, tree=5, **kw)(
            PROMPTS, **CALL
        ),
        "draft model slots": Generator(target, draft, schedule=3, **kw)(
            PROMPTS, num_slots=2, **CALL
        ),
    }
    for out in runs.values():
        same(out, ar)
    accepted = {name: int(np.asarray(out.stats.accepted).sum()) for name, out in runs.items()}
    trees = accepted["n-gram tree"] + accepted["feature head tree"]
    assert accepted["draft model chain"] > 0 and trees > 0, accepted


def test_repetition_penalty_equals_transformers_generate(tmp_path):
    """A random tiny Llama saved by transformers: greedy `generate(repetition_penalty=1.3)`
    (prompt and output counted) gives our autoregressive and speculative tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jax_specdec.io.hf import load_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.3)
    reference.save_pretrained(tmp_path)
    target = load_model(tmp_path)
    sampling = SamplingConfig(0.0, repetition_penalty=1.3)
    budget = 16
    expected, plain = [], []
    for prompt in PROMPTS:
        with torch.no_grad():
            for penalty, out in ((1.3, expected), (1.0, plain)):
                ids = reference.generate(
                    torch.tensor([prompt]), max_new_tokens=budget, do_sample=False,
                    repetition_penalty=penalty, eos_token_id=None, pad_token_id=0,
                )  # fmt: skip
                out.append(ids[0, len(prompt) :].tolist())
    assert expected != plain, "the penalty changed nothing: a vacuous test"
    call = dict(key=jax.random.key(0), max_new_tokens=budget)
    for gen in (
        Generator(target, sampling=sampling),
        Generator(target, NGram(), schedule=4, sampling=sampling),  # a fixed width, not auto
    ):
        assert np.asarray(gen(PROMPTS, **call).tokens).tolist() == expected


def test_bias_forces_and_bans_tokens(pair):
    target, draft = pair
    forced = SamplingConfig(0.0, logit_bias={7: 100.0})
    out = Generator(target, draft, schedule=2, sampling=forced)(PROMPTS, **CALL)
    assert all(
        set(row[:n]) == {7}
        for row, n in zip(out.tokens.tolist(), out.lengths.tolist(), strict=True)
    )
    plain = Generator(target)(PROMPTS, **CALL)
    common = int(np.bincount(np.asarray(plain.tokens).ravel(), minlength=VOCAB)[1:].argmax()) + 1
    banned = SamplingConfig(1.0, logit_bias={common: -100.0})
    out = Generator(target, draft, schedule=2, sampling=banned)(PROMPTS, **CALL)
    assert common not in np.asarray(out.tokens)[np.asarray(out.tokens) != 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
        (dict(repetition_penalty=-1), "repetition_penalty must be a number > 0"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token ids must be integers >= 0"),
        (dict(logit_bias={3: 101.0}), r"logit_bias\[3\] must be a number in \[-100, 100\]"),
        (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "logit_bias names token 3 twice"),
        (dict(logit_bias=5), "logit_bias must map token ids to biases"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(1.0, **kwargs)


def test_a_bias_outside_the_vocabulary_is_refused_before_compiling(pair):
    target, _ = pair
    settings = [SamplingConfig(1.0), SamplingConfig(1.0, logit_bias={VOCAB: 1.0, 2: 1.0})]
    with pytest.raises(ValueError, match=r"sampling\[1\].logit_bias names token ids outside"):
        Generator(target).bind(
            [[1], [2]], key=jax.random.key(0), max_new_tokens=2, sampling=settings
        )


def test_probs_from_logits_refuses_penalties_and_takes_the_bias():
    from jax_specdec import probs_from_logits

    with pytest.raises(ValueError, match="penalties are applied by the generation loop"):
        probs_from_logits(np.zeros(4), SamplingConfig(1.0, repetition_penalty=1.2))
    p = probs_from_logits(np.zeros(4), SamplingConfig(1.0, logit_bias={2: np.log(3.0)}))
    np.testing.assert_allclose(np.asarray(p), [1 / 6, 1 / 6, 1 / 2, 1 / 6], rtol=1e-6)


def test_seen_counts_prompt_and_emitted_tokens():
    seen = Seen.of(np.array([[1, 2, 2, 0], [3, 0, 0, 0]]), np.array([3, 1]), 5)
    assert seen.prompt.tolist() == [[False, True, True, False, False], [False] * 3 + [True, False]]
    seen = seen.emit(np.array([[4, 4, 1], [2, 3, 3]]), np.array([2, 3]))
    assert seen.counts.tolist() == [[0, 0, 0, 0, 2], [0, 0, 1, 2, 0]]
    seen = seen.reset(np.int32(0), np.array([[0, 4]]), np.int32(1))
    assert seen.counts[0].tolist() == [0] * 5 and seen.prompt[0].tolist() == [True] + [False] * 4
