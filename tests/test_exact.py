import numpy as np
import pytest

from jax_specdec.exact import one_position, round_distribution


def test_seed_example():
    b = one_position([0.2, 0.5, 0.3], [0.6, 0.3, 0.1])
    np.testing.assert_allclose(b.accepted, [0.2, 0.3, 0.1], atol=1e-15)
    assert b.rejected_mass == pytest.approx(0.4, abs=1e-15)
    np.testing.assert_allclose(b.residual, [0.0, 0.5, 0.5], atol=1e-15)
    np.testing.assert_allclose(b.output, [0.2, 0.5, 0.3], atol=1e-15)
    np.testing.assert_allclose(b.wrong_output, [0.28, 0.50, 0.22], atol=1e-15)
    assert b.output.dtype == np.float64


def test_output_equals_p_for_random_pairs():
    rng = np.random.default_rng(0)
    for _ in range(200):
        vocab = rng.integers(2, 10)
        p, q = rng.dirichlet([0.5] * vocab), rng.dirichlet([0.5] * vocab)
        np.testing.assert_allclose(one_position(p, q).output, p, atol=1e-12)
    b = one_position([0.3, 0.7], [0.3, 0.7])
    assert b.rejected_mass == 0 and np.allclose(b.residual, [0.3, 0.7])


def test_round_distribution_sums_to_one_and_has_marginal_p1():
    rng = np.random.default_rng(1)
    ps, qs = rng.dirichlet([1.0] * 3, size=4), rng.dirichlet([1.0] * 3, size=3)
    dist = round_distribution(ps, qs)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    first = np.zeros(3)
    for outcome, prob in dist.items():
        first[outcome[0]] += prob
    np.testing.assert_allclose(first, ps[0], atol=1e-12)


@pytest.mark.parametrize(
    "p,q,match",
    [
        ([0.5, 0.6], [0.5, 0.5], "p must sum to 1"),
        ([1.2, -0.2], [0.5, 0.5], "p has negative"),
        ([0.5, 0.5], [0.2, 0.3, 0.5], "same length"),
        ([], [], "non-empty"),
        ([float("nan"), 1.0], [0.5, 0.5], "non-finite"),
    ],
)
def test_bad_distributions(p, q, match):
    with pytest.raises(ValueError, match=match):
        one_position(p, q)
