"""The transformer: config validation, cached decode == full forward, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_specdec.nn import KVCache, Transformer, TransformerConfig, init_cache

ATOL = 1e-5

CONFIGS = {
    "llama": TransformerConfig.tiny(vocab_size=11, rope_theta=500.0),
    "llama_bias_tied": TransformerConfig.tiny(
        vocab_size=11, qkv_bias=True, tie_embeddings=True, num_kv_heads=1
    ),
    "gpt2": TransformerConfig.gpt2(
        vocab_size=11, d_model=32, num_layers=2, num_heads=4, max_len=64
    ),
}


def make(config, seed=0):
    # A large init scale makes the logits O(1), so the comparisons mean something.
    return Transformer(config, rngs=nnx.Rngs(seed), init_scale=0.3)


def random_tokens(seed, shape, vocab):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def full_logits(model, row):
    """Full-forward logits of one sequence (1-D token array)."""
    return np.asarray(model(jnp.asarray(row)[None]))[0]


# ---------------------------------------------------------------------- config


def test_config_is_hashable_and_frozen():
    config = TransformerConfig.tiny(vocab_size=6)
    assert hash(config) == hash(TransformerConfig.tiny(vocab_size=6))
    assert {config: 1}[TransformerConfig.tiny(vocab_size=6)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 8


def test_presets():
    tiny = TransformerConfig.tiny(vocab_size=6)
    assert (tiny.vocab_size, tiny.d_model, tiny.num_layers, tiny.num_heads) == (6, 32, 2, 4)
    assert tiny.num_kv_heads == 2
    target, draft = TransformerConfig.bench_target(), TransformerConfig.bench_draft()
    assert (target.d_model, target.num_layers, target.num_heads, target.mlp_dim) == (
        512,
        8,
        8,
        2048,
    )
    assert (draft.d_model, draft.num_layers) == (128, 2)
    assert target.vocab_size == draft.vocab_size == 4096
    gpt2 = TransformerConfig.gpt2()
    assert (gpt2.norm, gpt2.position, gpt2.mlp, gpt2.tie_embeddings) == (
        "layer",
        "learned",
        "gelu",
        True,
    )
    assert TransformerConfig.llama(num_heads=4, d_model=64).head_dim == 16
    assert TransformerConfig.from_dict(tiny.to_dict()) == tiny


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("d_model", -1),
        ("num_layers", 1.5),
        ("num_kv_heads", 3),
        ("norm", "batch"),
        ("position", "alibi"),
        ("mlp", "relu"),
        ("dtype", "float16"),
        ("param_dtype", "int8"),
        ("norm_eps", 0.0),
        ("rope_theta", float("nan")),
        ("qkv_bias", 1),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerConfig.tiny(**{field: value})


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="bogus"):
        TransformerConfig.from_dict({**TransformerConfig.tiny().to_dict(), "bogus": 1})


# --------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_shapes_and_causality(name):
    config = CONFIGS[name]
    model = make(config)
    tokens = random_tokens(0, (2, 9), config.vocab_size)
    logits = model(tokens)
    assert logits.shape == (2, 9, config.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    # Changing a later token does not change earlier logits.
    changed = model(tokens.at[:, 6].set((tokens[:, 6] + 1) % config.vocab_size))
    np.testing.assert_allclose(changed[:, :6], logits[:, :6], atol=ATOL)
    assert not np.allclose(changed[:, 6:], logits[:, 6:], atol=1e-3)


def test_parameter_layout():
    model = make(CONFIGS["llama"])
    paths = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert ("blocks", 1, "attn", "q", "kernel") in paths
    assert ("lm_head",) in paths and ("pos_embed",) not in paths
    gpt2 = {p for p, _ in nnx.to_flat_state(nnx.state(make(CONFIGS["gpt2"]), nnx.Param))}
    assert ("pos_embed",) in gpt2 and ("lm_head",) not in gpt2
    assert ("blocks", 0, "mlp", "gate", "kernel") not in gpt2


def test_init_scale():
    config = TransformerConfig.tiny()
    small = Transformer(config, rngs=nnx.Rngs(0), init_scale=0.01)
    large = Transformer(config, rngs=nnx.Rngs(0), init_scale=1.0)
    assert float(jnp.std(small.embed[...])) == pytest.approx(0.01, rel=0.2)
    assert float(jnp.std(large.embed[...])) == pytest.approx(1.0, rel=0.2)


# ----------------------------------------------------------- cache == forward


def test_init_cache_contract():
    config = CONFIGS["llama"]
    cache = init_cache(config, batch=3, max_len=20)
    assert isinstance(cache, KVCache)
    assert len(cache.keys) == len(cache.values) == config.num_layers
    assert cache.keys[0].shape == (3, config.num_kv_heads, 20, config.head_dim)
    assert cache.keys[0].dtype == jnp.float32
    assert cache.lengths.dtype == jnp.int32 and cache.lengths.tolist() == [0, 0, 0]
    assert (cache.batch_size, cache.max_len) == (3, 20)
    assert init_cache(config, batch=1, max_len=4, dtype="bfloat16").values[1].dtype == jnp.bfloat16
    # A pytree: it goes through jit and tree maps.
    assert len(jax.tree.leaves(cache)) == 2 * config.num_layers + 1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_one_token_at_a_time(name):
    config = CONFIGS[name]
    model = make(config)
    tokens = random_tokens(1, (2, 12), config.vocab_size)
    expected = np.asarray(model(tokens))
    cache = init_cache(config, batch=2, max_len=16)
    logits, cache = model.decode(tokens[:, :5], cache)
    got = [np.asarray(logits)]
    for t in range(5, 12):
        logits, cache = model.decode(tokens[:, t : t + 1], cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=ATOL)
    assert cache.lengths.tolist() == [12, 12]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow
def test_random_chunks(name):
    config = CONFIGS[name]
    model = make(config)
    rng = np.random.default_rng(2)
    tokens = random_tokens(3, (3, 20), config.vocab_size)
    expected = np.asarray(model(tokens))
    cache = init_cache(config, batch=3, max_len=24)
    start, got = 0, []
    while start < 20:
        size = min(int(rng.integers(1, 6)), 20 - start)
        logits, cache = model.decode(tokens[:, start : start + size], cache)
        got.append(np.asarray(logits))
        start += size
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=ATOL)


# The quick loop (-m "not slow") rolls back the Llama model's rows; the cache code is
# the same for every config.
@pytest.mark.parametrize(
    "name", [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS]
)
def test_ragged_rows_and_rollback(name):
    config = CONFIGS[name]
    model = make(config)
    prompts = random_tokens(4, (3, 6), config.vocab_size)
    cache = init_cache(config, batch=3, max_len=16)
    _, cache = model.decode(prompts, cache)
    # Roll rows back to different lengths (what a rejected draft does), then append
    # different tokens to all rows in one call: stale entries must not be seen.
    lengths = np.array([2, 6, 4])
    cache = cache.replace(lengths=jnp.asarray(lengths, jnp.int32))
    new = random_tokens(5, (3, 3), config.vocab_size)
    logits, cache = model.decode(new, cache)
    assert cache.lengths.tolist() == (lengths + 3).tolist()
    for b in range(3):
        row = np.concatenate([np.asarray(prompts[b, : lengths[b]]), np.asarray(new[b])])
        np.testing.assert_allclose(logits[b], full_logits(model, row)[-3:], atol=ATOL)
    # And once more on top of the ragged state.
    more = random_tokens(6, (3, 2), config.vocab_size)
    logits, _ = model.decode(more, cache)
    for b in range(3):
        row = np.concatenate(
            [np.asarray(prompts[b, : lengths[b]]), np.asarray(new[b]), np.asarray(more[b])]
        )
        np.testing.assert_allclose(logits[b], full_logits(model, row)[-2:], atol=ATOL)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_logits_at_one_token_a_row_are_that_tokens_logits(name):
    """`logits_at` (a prefill's last prompt token) gives those tokens' logits of the
    full call, [B, 1, V], the same cache and the same features."""
    config = CONFIGS[name]
    model = make(config)
    tokens = random_tokens(7, (3, 6), config.vocab_size)
    at = jnp.asarray([5, 0, 3], jnp.int32)
    empty = init_cache(config, batch=3, max_len=8)
    logits, cache, feats = model.decode(tokens, empty, features=True)
    picked, same, same_feats = model.decode(tokens, empty, features=True, logits_at=at)
    assert picked.shape == (3, 1, config.vocab_size)
    np.testing.assert_allclose(picked[:, 0], logits[jnp.arange(3), at], atol=ATOL)
    np.testing.assert_allclose(same_feats, feats, atol=ATOL)
    for new, old in zip(jax.tree.leaves(same), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(new, old)
    for bad in (jnp.asarray([5, 0], jnp.int32), jnp.asarray([6, 0, 0], jnp.int32), at * 1.0):
        with pytest.raises(ValueError, match="logits_at must"):
            model.decode(tokens, empty, logits_at=bad)


@pytest.mark.parametrize("name", ["llama_bias_tied", "gpt2"])
def test_features_are_what_the_lm_head_reads(name):
    """features=True gives the final-normed top-layer states: the same from the full
    forward, a cached decode and decode_entries, and the logits are their head."""
    config = CONFIGS[name]
    model = make(config)
    tokens = random_tokens(5, (2, 7), config.vocab_size)
    logits, feats = model(tokens, features=True)
    assert feats.shape == (2, 7, config.d_model)
    np.testing.assert_allclose(logits, model(tokens), atol=ATOL)
    np.testing.assert_allclose(model._logits(feats), logits, atol=ATOL)
    cache = init_cache(config, batch=2, max_len=16)
    _, cache, first = model.decode(tokens[:, :4], cache, features=True)
    out = model.decode_entries(tokens[:, 4:], cache, features=True)
    assert len(out) == 4
    np.testing.assert_allclose(first, feats[:, :4], atol=ATOL)
    np.testing.assert_allclose(out[3], feats[:, 4:], atol=ATOL)


def test_decode_inside_jit_and_while_loop():
    config = CONFIGS["llama"]
    model = make(config)
    graphdef, state = nnx.split(model)
    tokens = random_tokens(7, (2, 10), config.vocab_size)
    expected = np.asarray(model(tokens))

    @jax.jit
    def step(state, tokens, cache):
        return nnx.merge(graphdef, state).decode(tokens, cache)

    cache = init_cache(config, batch=2, max_len=12)
    first, cache = step(state, tokens[:, :4], cache)
    np.testing.assert_allclose(first, expected[:, :4], atol=ATOL)

    @jax.jit
    def loop(state, tokens, cache):
        model = nnx.merge(graphdef, state)

        def body(t, carry):
            cache, out = carry
            token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
            logits, cache = model.decode(token, cache)
            return cache, jax.lax.dynamic_update_slice_in_dim(out, logits, t, axis=1)

        out = jnp.zeros((2, 10, config.vocab_size), jnp.float32)
        return jax.lax.fori_loop(4, 10, body, (cache, out))

    cache, out = loop(state, tokens, cache)
    np.testing.assert_allclose(out[:, 4:], expected[:, 4:], atol=ATOL)
    assert cache.lengths.tolist() == [10, 10]


def test_traced_lengths_are_not_checked_and_do_not_recompile():
    config = CONFIGS["llama"]
    model = make(config)
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def step(state, tokens, cache):
        traces.append(1)
        return nnx.merge(graphdef, state).decode(tokens, cache)

    cache = init_cache(config, batch=2, max_len=8)
    tokens = random_tokens(8, (2, 2), config.vocab_size)
    _, cache = step(state, tokens, cache)
    _, cache = step(state, tokens, cache.replace(lengths=jnp.array([1, 3], jnp.int32)))
    assert len(traces) == 1


def test_bfloat16_smoke():
    f32_config = CONFIGS["llama"]
    bf16_config = f32_config.replace(dtype="bfloat16", param_dtype="bfloat16")
    f32, bf16 = make(f32_config), make(bf16_config)
    assert bf16.blocks[0].attn.q.kernel[...].dtype == jnp.bfloat16
    tokens = random_tokens(9, (2, 8), f32_config.vocab_size)
    reference = np.asarray(f32(tokens))
    full = bf16(tokens)
    assert full.dtype == jnp.float32
    np.testing.assert_allclose(full, reference, atol=0.15)
    cache = init_cache(bf16_config, batch=2, max_len=8)
    assert cache.keys[0].dtype == jnp.bfloat16
    first, cache = bf16.decode(tokens[:, :5], cache)
    rest, _ = bf16.decode(tokens[:, 5:], cache)
    assert first.dtype == jnp.float32
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), full, atol=0.1)


# -------------------------------------------------------------------- bad input


def test_token_ids_out_of_range():
    config = CONFIGS["llama"]
    model = make(config)
    cache = init_cache(config, batch=1, max_len=8)
    for bad in ([[0, config.vocab_size]], [[-1, 2]]):
        with pytest.raises(ValueError, match="token ids"):
            model(jnp.array(bad))
        with pytest.raises(ValueError, match="token ids"):
            model.decode(np.array(bad), cache)


def test_token_shape_and_dtype():
    model = make(CONFIGS["llama"])
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.array([1, 2, 3]))
    with pytest.raises(TypeError, match="tokens"):
        model(jnp.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.zeros((1, 0), jnp.int32))


def test_too_long_for_config():
    config = TransformerConfig.tiny(max_len=8)
    model = make(config)
    with pytest.raises(ValueError, match="max_len"):
        model(jnp.zeros((1, 9), jnp.int32))
    with pytest.raises(ValueError, match="max_len"):
        init_cache(config, batch=1, max_len=9)


def test_too_long_for_cache():
    config = CONFIGS["llama"]
    model = make(config)
    cache = init_cache(config, batch=1, max_len=4)
    with pytest.raises(ValueError, match="cache's max_len"):
        model.decode(jnp.zeros((1, 5), jnp.int32), cache)
    _, cache = model.decode(jnp.zeros((1, 3), jnp.int32), cache)
    with pytest.raises(ValueError, match=r"cache\.lengths"):
        model.decode(jnp.zeros((1, 2), jnp.int32), cache)


def test_batch_mismatch():
    config = CONFIGS["llama"]
    model = make(config)
    cache = init_cache(config, batch=2, max_len=8)
    with pytest.raises(ValueError, match="batch"):
        model.decode(jnp.zeros((3, 1), jnp.int32), cache)


def test_cache_from_another_model():
    model = make(CONFIGS["llama"])
    other = init_cache(CONFIGS["gpt2"], batch=1, max_len=8)
    with pytest.raises(ValueError, match="cache"):
        model.decode(jnp.zeros((1, 1), jnp.int32), other)
    with pytest.raises(TypeError, match="cache"):
        model.decode(jnp.zeros((1, 1), jnp.int32), {"keys": ()})


def test_init_cache_arguments():
    config = CONFIGS["llama"]
    with pytest.raises(ValueError, match="batch"):
        init_cache(config, batch=0, max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        init_cache(config, batch=1, max_len=0)
    with pytest.raises(TypeError, match="config"):
        Transformer({"d_model": 8}, rngs=nnx.Rngs(0))
