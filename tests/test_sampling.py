import jax.numpy as jnp
import numpy as np
import pytest

from jax_specdec.sampling import SamplingConfig, probs_from_logits


def reference_probs(logits, temperature, top_k, top_p, min_p=0.0):
    """Row-by-row NumPy reference of the documented transform order."""
    logits = np.asarray(logits, np.float64)
    out = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape[:-1]):
        row = logits[idx]
        if temperature == 0:
            out[idx][np.argmax(row)] = 1.0
            continue
        row = row / temperature
        keep = np.ones(row.shape, bool)
        if 0 < top_k < row.size:
            kth = np.sort(row)[::-1][top_k - 1]
            keep &= row >= kth
        probs = np.where(keep, np.exp(row - row[keep].max()), 0.0)
        probs /= probs.sum()
        if top_p < 1.0:
            order = sorted(range(row.size), key=lambda i: -probs[i])
            mass, kept = 0.0, []
            for i in order:
                if mass >= top_p:
                    break
                kept.append(i)
                mass += probs[i]
            threshold = probs[kept[-1]]
            probs = np.where(probs >= threshold, probs, 0.0)
            probs /= probs.sum()
        if min_p > 0.0:
            probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
            probs /= probs.sum()
        out[idx] = probs
    return out


SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 3, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (0.6, 0, 0.5, 0.0),
    (0.8, 4, 0.9, 0.0),
    (2.0, 5, 0.3, 0.0),
    (0.0, 0, 1.0, 0.0),
    (0.0, 3, 0.5, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.7, 0, 1.0, 0.5),
    (1.2, 6, 0.9, 0.05),
    (0.0, 0, 1.0, 0.3),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS)
def test_matches_numpy_reference(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 5, 11)) * 2.0
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = np.asarray(probs_from_logits(jnp.asarray(logits, jnp.float32), config))
    assert got.dtype == np.float32
    want = reference_probs(logits.astype(np.float32), temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_ties_greedy_lowest_index_and_topk_keeps_ties():
    logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    greedy = probs_from_logits(logits, SamplingConfig(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(greedy), [[0, 1, 0, 0], [1, 0, 0, 0]])
    top1 = probs_from_logits(logits, SamplingConfig(top_k=1))
    np.testing.assert_allclose(np.asarray(top1), [[0, 0.5, 0.5, 0], [0.25] * 4], atol=1e-7)
    # top-p: the nucleus [3, 3] reaches 0.5 with either of the tied tokens; both are kept.
    top_p = probs_from_logits(logits, SamplingConfig(top_p=0.3))
    np.testing.assert_allclose(np.asarray(top_p)[0], [0, 0.5, 0.5, 0], atol=1e-7)


def test_bfloat16_input():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 17)), jnp.bfloat16)
    for config in [SamplingConfig(), SamplingConfig(0.5, 4, 0.9), SamplingConfig(0.0)]:
        got = probs_from_logits(logits, config)
        assert got.dtype == jnp.float32
        want = reference_probs(np.asarray(logits.astype(jnp.float32)), *dataclass_values(config))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def dataclass_values(config):
    return config.temperature, config.top_k, config.top_p


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": True}, "min_p"),
    ],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_config_is_hashable_and_validates_type():
    assert hash(SamplingConfig()) == hash(SamplingConfig(1, 0, 1))
    with pytest.raises(TypeError, match="SamplingConfig"):
        probs_from_logits(jnp.zeros(3), {"temperature": 1.0})


def test_sample_inverse_cdf_distribution_and_zero_mass():
    import jax
    from scipy import stats

    from jax_specdec.sampling import sample

    p = np.array([0.0, 0.1, 0.0, 0.45, 0.3, 0.15, 0.0], np.float32)
    n = 400_000
    keys = jax.random.split(jax.random.key(0), n)
    tokens = np.asarray(jax.jit(sample)(keys, jnp.broadcast_to(jnp.asarray(p), (n, p.size))))
    counts = np.bincount(tokens, minlength=p.size)
    assert counts[p == 0].sum() == 0
    support = p > 0
    expected = n * p[support].astype(np.float64) / p[support].sum()
    assert stats.chisquare(counts[support], expected).pvalue > 1e-3
    # One-hot and unnormalised rows.
    onehot = jnp.asarray([[0, 0, 1.0, 0], [0, 0, 0, 2.0]])
    assert np.asarray(sample(keys[:2], onehot)).tolist() == [2, 3]


def test_sample_with_uniforms_ends_never_draw_zero_mass():
    from jax_specdec.sampling import sample_with_uniforms

    # Unnormalised weights with zero mass at both ends, as a residual max(0, p - q) has.
    w = jnp.asarray([[0.0, 0.3, 0.0, 0.7, 0.0]] * 5, jnp.float32)
    below_one = np.nextafter(np.float32(1), np.float32(0))
    u = jnp.asarray([0.0, 0.29, 0.31, below_one, 1.0])
    # u = 1 (threshold = total) still gives the last token with mass, not index 4.
    assert np.asarray(sample_with_uniforms(u, w)).tolist() == [1, 1, 3, 3, 3]
    # Many zero-weight tokens between a few with weight, in a large vocabulary.
    rng = np.random.default_rng(0)
    w = np.zeros((64, 50_000), np.float32)
    for row in w:
        row[rng.choice(50_000, 3, replace=False)] = rng.random(3)
    u = jnp.asarray(rng.random(64), jnp.float32)
    tokens = np.asarray(sample_with_uniforms(u, jnp.asarray(w)))
    assert np.all(w[np.arange(64), tokens] > 0)
