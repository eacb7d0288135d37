"""Attention over the cache's live prefix: same logits as full-cache attention, only the
live prefix read, both kernels agree, and the generation loop still copies no cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import copies_outside_entry

import jax_specdec.nn.attention as attention
from jax_specdec import Generator
from jax_specdec.nn import Transformer, TransformerConfig, init_cache


@pytest.fixture(scope="module")
def model():
    config = TransformerConfig.tiny(max_len=256)
    return Transformer(config, rngs=nnx.Rngs(0), init_scale=0.3)


def filled_cache(model, lengths, max_len=200):
    """A cache of `max_len` positions holding a random prefix, with the given lengths."""
    tokens = jax.random.randint(jax.random.key(1), (len(lengths), max(lengths)), 0, 16)
    cache = init_cache(model.config, batch=len(lengths), max_len=max_len)
    _, cache = model.decode(tokens, cache)
    return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


def decode_with(model, tokens, cache, block, monkeypatch, recent=None):
    """decode_entries traced afresh with attention.LIVE_BLOCK = block (and every size
    worth a branch, however few bytes the tiny model's cache takes)."""
    monkeypatch.setattr(attention, "LIVE_BLOCK", block)
    monkeypatch.setattr(attention, "MIN_LIVE_BYTES", 0)
    graphdef, state = nnx.split(model)

    def run(state, tokens, cache, recent):
        return nnx.merge(graphdef, state).decode_entries(tokens, cache, recent)

    return jax.jit(run)(state, tokens, cache, recent)


def test_live_sizes_and_index():
    assert attention.live_sizes(200, 16) == (16, 32, 64, 128, 200)
    assert attention.live_sizes(16, 16) == (16,)
    assert attention.live_sizes(10, 16) == (10,)
    assert attention.live_sizes(4096, 16) == (256, 512, 1024, 2048, 4096)  # the 5 largest
    sizes = attention.live_sizes(200, 16)
    for lengths, index in [([0], 0), ([16, 3], 0), ([17, 3], 1), ([5, 64], 2), ([129], 4)]:
        assert int(attention.live_index(jnp.asarray(lengths), sizes)) == index


def test_no_branch_for_a_prefix_cheaper_than_its_conditional():
    # One position of SmolLM2's batch-1 float32 cache: 2 x 3 heads x 64 x 4 bytes.
    row = 2 * 3 * 64 * 4
    cache = jnp.zeros((1, 3, 1024, 64), jnp.float32)
    assert attention.position_bytes(cache) == row
    assert attention.position_bytes(jnp.zeros((8, 3, 5, 64), jnp.bfloat16)) == 4 * row
    floor = attention.MIN_LIVE_BYTES // row  # 341 positions
    assert attention.live_sizes(200, 16, position_bytes=row) == (200,)  # no conditional
    assert attention.live_sizes(1024, 16, position_bytes=row) == (512, 1024)
    assert all(s > floor for s in attention.live_sizes(8192, 16, position_bytes=row))
    assert attention.live_sizes(1024, 16, position_bytes=8 * row) == (64, 128, 256, 512, 1024)
    assert attention.live_sizes(1024, 16, position_bytes=0) == attention.live_sizes(1024, 16)


def test_small_cache_compiles_no_conditional(model):
    """The tiny model's cache is far below MIN_LIVE_BYTES: attended whole, no switch."""
    cache = init_cache(model.config, batch=2, max_len=200)
    tokens = jnp.ones((2, 1), jnp.int32)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, cache: nnx.merge(graphdef, state).decode(tokens, cache)[0])
    assert " conditional(" not in run.lower(state, cache).compile().as_text()


@pytest.mark.parametrize("lengths", [[100, 37, 5], [16, 16, 1], [17, 0, 3], [199, 2, 60]])
def test_same_logits_as_full_cache_attention(model, lengths, monkeypatch):
    cache = filled_cache(model, lengths)
    tokens = jnp.asarray([[1, 2, 3, 4]] * 3, jnp.int32)[:, : 200 - max(lengths)]
    full = decode_with(model, tokens, cache, 10**6, monkeypatch)  # one size: the whole cache
    live = decode_with(model, tokens, cache, 16, monkeypatch)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(live), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_same_logits_with_recent_entries(model, monkeypatch):
    """The draft's path: entries kept aside (`recent`) are attended besides the cache."""
    cache = filled_cache(model, [40, 20])
    c = model.config
    shape = (2, 3, c.num_kv_heads, c.head_dim)
    keys = tuple(jax.random.normal(jax.random.key(i), shape) for i in range(c.num_layers))
    values = tuple(jax.random.normal(jax.random.key(9 + i), shape) for i in range(c.num_layers))
    recent = (keys, values, jnp.asarray([3, 1], jnp.int32))
    tokens = jnp.asarray([[5], [6]], jnp.int32)
    full = decode_with(model, tokens, cache, 10**6, monkeypatch, recent)
    live = decode_with(model, tokens, cache, 16, monkeypatch, recent)
    np.testing.assert_allclose(np.asarray(live[0]), np.asarray(full[0]), rtol=1e-5, atol=1e-5)


def test_only_the_live_prefix_is_read(model, monkeypatch):
    """NaN values past the live size poison full-cache attention (0 * NaN) but are never
    read by the live-prefix attention."""
    cache = filled_cache(model, [30, 10])
    poison = lambda a: a.at[:, :, 32:].set(jnp.nan)  # noqa: E731  (sizes 16, 32, 64, ...)
    cache = cache.replace(values=tuple(map(poison, cache.values)))
    tokens = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    assert np.isnan(np.asarray(decode_with(model, tokens, cache, 10**6, monkeypatch)[0])).all()
    logits = np.asarray(decode_with(model, tokens, cache, 16, monkeypatch)[0])
    assert np.isfinite(logits).all()


def test_dot_product_attention_kernel_agrees(model, monkeypatch):
    cache = filled_cache(model, [50, 7])
    tokens = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    monkeypatch.setenv("JAX_SPECDEC_ATTENTION", "einsum")
    ours = decode_with(model, tokens, cache, 16, monkeypatch)[0]
    for name in ("xla", "cudnn"):  # on CPU, cudnn falls back to xla
        monkeypatch.setenv("JAX_SPECDEC_ATTENTION", name)
        assert attention.kernel() == name
        theirs = decode_with(model, tokens, cache, 16, monkeypatch)[0]
        np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JAX_SPECDEC_ATTENTION", "flash")
    with pytest.raises(ValueError, match="JAX_SPECDEC_ATTENTION"):
        attention.kernel()


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.slow
def test_loop_with_live_prefix_switch_copies_no_cache(target, draft, speculative, monkeypatch):
    """A cache long enough for several live sizes: the switch sits inside the loop's
    rounds, and still no cache is copied there."""
    monkeypatch.setattr(attention, "MIN_LIVE_BYTES", 0)
    generator = Generator(target, draft, schedule=3) if speculative else Generator(target)
    run = generator.bind([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=40)
    assert len(attention.live_sizes(run.cache_len)) >= 3
    hlo = run.lower().compile().as_text()
    assert " conditional(" in hlo
    for model in [target, draft] if speculative else [target]:
        c = model.config
        shape = f"f32[2,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
        assert shape in hlo
        assert copies_outside_entry(hlo, shape) == 0, f"cache of shape {shape} copied in a loop"


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_a_program_of_many_rows_compiles_in_seconds(draft, softcap):
    """10^5 rows (an exactness test's program) compile in seconds: a prefill's empty cache
    part, masked on its own before the softmax, was a constant that XLA folded in 27 s
    here (1.4 s without; with and without Gemma 2's score cap)."""
    import time

    from helpers import PROMPTS, make_model

    target = make_model(0, attn_softcap=softcap)
    run = Generator(target, draft, schedule=1).bind(
        [PROMPTS[b % 2] for b in range(100_000)], key=jax.random.key(1), max_new_tokens=3
    )
    start = time.perf_counter()
    run.lower().compile()
    seconds = time.perf_counter() - start
    print(f"\nCOMPILE 10^5 rows softcap={softcap}: {seconds:.1f} s")
    assert seconds < 10, f"compiling took {seconds:.0f} s: a large constant was folded?"
