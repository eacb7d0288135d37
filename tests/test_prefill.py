"""A whole batch's prompts past `prefill.BATCH_CHUNK` positions prefill in chunks (the
target, a draft model and a head alike): the same logits, cache entries and features
as one call, and the same tokens and acceptance counts end to end. The chunk is made 4
here, so that the tiny models' prompts of 13 tokens run in four chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    VOCAB,
    copies_outside_entry,
    make_draft,
    make_eagle3,
    make_head,
    ragged_prompts,
)

from jax_specdec import Generator, NGram, SamplingConfig
from jax_specdec.decode import prefill
from jax_specdec.nn import TransformerConfig, init_cache
from jax_specdec.nn.transformer import Transformer

ATOL = 2e-5
LENGTHS = [13, 4, 8, 11]  # 4 and 8: a last prompt position at a chunk's end


@pytest.fixture
def chunk_of_four(monkeypatch):
    """BATCH_CHUNK = 4 for the test; programs traced under either chunk size are
    dropped before and after (their cache does not know the constant)."""
    jax.clear_caches()
    monkeypatch.setattr(prefill, "BATCH_CHUNK", 4)
    yield
    jax.clear_caches()


def _prompts(vocab, seed=3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(LENGTHS), max(LENGTHS)), dtype=np.int32)
    for row, n in enumerate(LENGTHS):
        tokens[row, n:] = 0
    return jnp.asarray(tokens), jnp.asarray(LENGTHS, jnp.int32)


@pytest.mark.parametrize("features", [True, (0, 1, 2)], ids=["final", "layers"])
def test_a_long_prompt_prefills_in_chunks_as_in_one_call(target, monkeypatch, features):
    """Chunks of 4 (13 positions: four calls) against one call: the logits at each
    row's last prompt token, every valid cache entry and the features agree, and
    without logits (a draft model's prefill) the same cache."""
    prompts, lengths = _prompts(target.config.vocab_size)
    # 14 positions: the last chunk's (12-15) writes past the cache are dropped
    empty = init_cache(target.config, batch=len(LENGTHS), max_len=14)
    one = prefill.prefill_batch(target, prompts, lengths, empty, features=features)
    monkeypatch.setattr(prefill, "BATCH_CHUNK", 4)
    calls, decode = [], type(target).decode

    def counted(self, tokens, *args, **kwargs):
        calls.append(tokens.shape)
        return decode(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(target), "decode", counted)
    chunked = prefill.prefill_batch(target, prompts, lengths, empty, features=features)
    assert calls == [(4, 4)], "traced once, in the loop's body, four positions a call"
    np.testing.assert_allclose(chunked[0], one[0], atol=ATOL)
    assert chunked[1].lengths.tolist() == LENGTHS
    entries = zip(chunked[1].keys + chunked[1].values, one[1].keys + one[1].values, strict=True)
    for new, old in entries:
        for row, n in enumerate(LENGTHS):
            np.testing.assert_allclose(new[row, :, :n], old[row, :, :n], atol=ATOL)
    assert chunked[2].shape == one[2].shape
    for row, n in enumerate(LENGTHS):
        np.testing.assert_allclose(chunked[2][row, :n], one[2][row, :n], atol=ATOL)
    bare = prefill.prefill_batch(target, prompts, lengths, empty, logits=False)
    assert bare[0] is None and bare[2] is None
    for new, old in zip(jax.tree.leaves(bare[1]), jax.tree.leaves(chunked[1]), strict=True):
        np.testing.assert_array_equal(new, old)


def test_a_heads_chunked_prefill_writes_its_cache_in_place(target, chunk_of_four):
    """The head's entries of each chunk are written after the attention that read its
    cache: the compiled program copies no head cache in a loop."""
    gen = Generator(target, make_head(target, layers=2), schedule=3)
    prompts = [[1] * n for n in LENGTHS]
    run = gen.bind(prompts, key=jax.random.key(0), max_new_tokens=4)
    hlo = run.lower().compile().as_text()
    c = gen.draft_model.config
    shape = f"f32[{len(LENGTHS)},{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
    assert shape in hlo
    assert copies_outside_entry(hlo, shape) == 0, f"head cache {shape} copied in a loop"


def test_a_decode_whose_logits_go_unused_drops_the_lm_head():
    """A caller that keeps only the cache (a draft model's prefill or catch-up) compiles
    no LM head: the cache writes wait on the hidden state, not on the logits."""
    config = TransformerConfig.tiny(vocab_size=997)  # no other dimension of the program
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(7), (3, 6), 0, config.vocab_size)
    empty = init_cache(config, batch=3, max_len=8)
    logits = ("f32[3,6,997]", "f32[18,997]")

    def compiled(keep):
        fn = lambda model, tokens, cache: keep(model.decode(tokens, cache))  # noqa: E731
        return nnx.jit(fn).lower(model, tokens, empty).compile().as_text()

    assert any(shape in compiled(lambda out: out) for shape in logits)  # the check sees them
    assert not any(shape in compiled(lambda out: out[1]) for shape in logits)


def _drafters(target):
    return {
        "draft": make_draft(),
        # two layers: the second layer's entries depend on what the first attended
        "head": make_head(target, layers=2),
        "eagle3": make_eagle3(target, scale=0.05),
        "ngram": NGram(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft", "head", "eagle3", "ngram"])
def test_generation_after_a_chunked_prefill_is_the_same(target, name, chunk_of_four):
    """Greedy and at T = 1 (one key): the tokens and acceptance counts after prefills in
    chunks of 4 are those after one call (the drafter's cache is the same, so it drafts
    and is accepted the same), and greedy tokens are autoregressive decoding's."""
    drafter = _drafters(target)[name]
    prompts = [(p * 13)[:n] for p, n in zip(ragged_prompts(4, VOCAB, seed=6), LENGTHS, strict=True)]
    call = dict(key=jax.random.key(2), max_new_tokens=10)
    outs = {}
    for chunk in (4, 512):
        prefill.BATCH_CHUNK = chunk  # undone by the fixture's monkeypatch
        jax.clear_caches()
        for sampling in (SamplingConfig(0.0), SamplingConfig(1.0)):
            gen = Generator(target, drafter, schedule=3, sampling=sampling)
            outs[chunk, sampling.temperature] = gen(prompts, **call)
    for temperature in (0.0, 1.0):
        chunked, one = outs[4, temperature], outs[512, temperature]
        np.testing.assert_array_equal(np.asarray(chunked.tokens), np.asarray(one.tokens))
        np.testing.assert_array_equal(
            np.asarray(chunked.stats.accepted_at), np.asarray(one.stats.accepted_at)
        )
    if name == "head":  # a slot's head load, in chunks too (prompts past 4 positions)
        prefill.BATCH_CHUNK = 4
        jax.clear_caches()
        gen = Generator(target, drafter, schedule=3, sampling=SamplingConfig(0.0))
        slots = gen(prompts, num_slots=2, **call)
        np.testing.assert_array_equal(np.asarray(slots.tokens), np.asarray(outs[4, 0.0].tokens))
        np.testing.assert_array_equal(
            np.asarray(slots.stats.accepted_at), np.asarray(outs[4, 0.0].stats.accepted_at)
        )
    accepted = sum(int(out.stats.accepted.sum()) for out in outs.values())
    assert accepted > 0, "nothing accepted: a vacuous test"
    ar = Generator(target, sampling=SamplingConfig(0.0))(prompts, **call)
    np.testing.assert_array_equal(np.asarray(outs[4, 0.0].tokens), np.asarray(ar.tokens))
