"""The acceptance step: NumPy reference, Monte Carlo against closed forms, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jax_specdec.acceptance import RESIDUAL_FLOOR, accept, accept_with_noise
from jax_specdec.exact import one_position, round_distribution
from jax_specdec.sampling import SamplingConfig, probs_from_logits

NUM_DRAWS = 1_000_000
P_VALUE_MIN = 1e-3
TV_MAX = 0.003


# --------------------------------------------------------------------------- reference


def reference_accept(uniforms, draws, draft_tokens, draft_probs, target_probs):
    """Loop-by-loop NumPy version of Algorithm 1 with the same noise."""
    batch, gamma = draft_tokens.shape
    vocab = target_probs.shape[-1]
    num_accepted = np.zeros(batch, np.int32)
    next_token = np.zeros(batch, np.int32)
    for b in range(batch):
        n = 0
        while n < gamma:
            x = draft_tokens[b, n]
            q = 1.0 if draft_probs is None else draft_probs[b, n, x]
            if np.float32(uniforms[b, n]) * np.float32(q) < np.float32(target_probs[b, n, x]):
                n += 1
            else:
                break
        p = target_probs[b, n].astype(np.float32)
        if n < gamma:
            q_row = (
                np.eye(vocab, dtype=np.float32)[draft_tokens[b, n]]
                if draft_probs is None
                else draft_probs[b, n]
            )
            residual = np.maximum(p - q_row, 0)
            if residual.sum() < RESIDUAL_FLOOR:
                residual = p
        else:
            residual = p
        # Inverse CDF: the first token whose cumulative mass exceeds draw * total.
        cdf = np.cumsum(residual, dtype=np.float32)
        token = int(np.sum(cdf <= np.float32(draws[b]) * cdf[-1]))
        num_accepted[b], next_token[b] = n, min(token, int(np.flatnonzero(residual)[-1]))
    return num_accepted, next_token


def random_case(rng, batch, gamma, vocab, deterministic):
    def dist(shape):
        raw = rng.dirichlet(np.full(vocab, 0.5), size=shape).astype(np.float32)
        raw[rng.random(shape + (vocab,)) < 0.2] = 0  # some zero-probability tokens
        raw[..., 0] += 1e-3  # keep each row a distribution
        return raw / raw.sum(-1, keepdims=True)

    target = dist((batch, gamma + 1))
    draft = None if deterministic else dist((batch, gamma))
    if deterministic:
        tokens = rng.integers(0, vocab, size=(batch, gamma))
    else:
        cdf = np.cumsum(draft, -1)
        tokens = (rng.random((batch, gamma, 1)) < cdf).argmax(-1)
        # Sometimes draft exactly what the target wants, so long runs are accepted.
        target[:, :gamma] = np.where(rng.random((batch, 1, 1)) < 0.3, draft, target[:, :gamma])
    uniforms = rng.random((batch, gamma)).astype(np.float32)
    draws = rng.random(batch).astype(np.float32)
    return uniforms, draws, tokens.astype(np.int32), draft, target


@pytest.mark.parametrize("gamma", [0, 1, 3, 6])
@pytest.mark.parametrize("vocab", [2, 5, 13])
@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_numpy_reference(gamma, vocab, deterministic):
    rng = np.random.default_rng(gamma * 100 + vocab + 7 * deterministic)
    case = random_case(rng, 500, gamma, vocab, deterministic)
    uniforms, draws, tokens, draft, target = case
    got = jax.jit(accept_with_noise)(*(None if a is None else jnp.asarray(a) for a in case))
    want = reference_accept(uniforms, draws, tokens, draft, target)
    np.testing.assert_array_equal(np.asarray(got.num_accepted), want[0])
    np.testing.assert_array_equal(np.asarray(got.next_token), want[1])
    if gamma > 0:  # the random cases exercise every outcome
        assert len(set(want[0].tolist())) > 1


# ----------------------------------------------------------------- Monte Carlo, one position


@functools.partial(jax.jit, static_argnames=("num", "deterministic", "wrong"))
def first_tokens(key, p, q, *, num, deterministic=False, wrong=False):
    """First emitted token of `num` independent one-draft rounds (γ = 1)."""
    draft_key, accept_key = jax.random.split(key)
    vocab = p.shape[-1]
    if deterministic:  # q is one-hot: the proposer always drafts argmax q
        x = jnp.full((num,), jnp.argmax(q), jnp.int32)
    else:
        x = jax.random.categorical(draft_key, jnp.log(q), shape=(num,)).astype(jnp.int32)
    keys = jax.random.split(accept_key, num)
    target = jnp.broadcast_to(jnp.stack([p, p])[None], (num, 2, vocab))
    draft = None if deterministic else jnp.broadcast_to(q[None, None], (num, 1, vocab))
    if wrong:  # resample a rejection from plain p instead of the residual
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[0]))(keys)
        q_x = 1.0 if deterministic else q[x]
        fresh = jax.vmap(lambda k: jax.random.categorical(jax.random.split(k)[1], jnp.log(p)))(keys)
        return jnp.where(u * q_x < p[x], x, fresh)
    result = accept(keys, x[:, None], draft, target)
    return jnp.where(result.num_accepted >= 1, x, result.next_token)


def distribution_test(samples, expected):
    """(chi-square p-value over the support, total variation, mass outside the support)."""
    expected = np.asarray(expected, np.float64)
    counts = np.bincount(np.asarray(samples), minlength=expected.size).astype(np.float64)
    support = expected > 0
    outside = counts[~support].sum()
    chi = stats.chisquare(
        counts[support], counts.sum() * expected[support] / expected[support].sum()
    )
    tv = 0.5 * np.abs(counts / counts.sum() - expected).sum()
    return chi.pvalue if support.sum() > 1 else 1.0, tv, outside


def _pairs():
    rng = np.random.default_rng(2023)
    cases = {
        "seed_example": ([0.2, 0.5, 0.3], [0.6, 0.3, 0.1], False),
        "disjoint_supports": ([0.5, 0.5, 0, 0], [0, 0, 0.3, 0.7], False),
        "q_zero_where_p_positive": ([0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0, 0], False),
        "p_zero_where_q_positive": ([0, 0, 0.6, 0.4], [0.25, 0.25, 0.25, 0.25], False),
        "p_equals_q": ([0.1, 0.6, 0.3], [0.1, 0.6, 0.3], False),
        "p_equals_q_uniform8": ([1 / 8] * 8, [1 / 8] * 8, False),
        "one_hot_q_likely": ([0.2, 0.5, 0.3], [0, 1, 0], True),
        "one_hot_q_unlikely": ([0.7, 0.05, 0.25], [0, 1, 0], True),
        "one_hot_q_impossible": ([0.7, 0.0, 0.3], [0, 1, 0], True),
        "one_hot_q_certain": ([0, 1, 0], [0, 1, 0], True),
        "q_much_flatter": ([0.9, 0.05, 0.03, 0.02], [0.25] * 4, False),
        "q_much_sharper": ([0.25] * 4, [0.97, 0.01, 0.01, 0.01], False),
        "near_equal": ([0.3, 0.3, 0.4], [0.3000001, 0.2999999, 0.4], False),
        "greedy_agree": ([0, 0, 1, 0], [0, 0, 1, 0], False),
        "greedy_disagree": ([0, 0, 1, 0], [1, 0, 0, 0], False),
    }
    for i in range(5):  # random pairs, V = 5..8, peaked and flat
        vocab = 5 + i % 4
        alpha = [0.3, 1.0, 3.0, 0.5, 10.0][i]
        cases[f"dirichlet_{i}"] = (
            rng.dirichlet([alpha] * vocab),
            rng.dirichlet([alpha] * vocab),
            False,
        )
    for name, config in {
        "top_k3": SamplingConfig(top_k=3),
        "top_p0.7": SamplingConfig(top_p=0.7),
        "top_k4_top_p0.9_t0.6": SamplingConfig(temperature=0.6, top_k=4, top_p=0.9),
        "temperature0": SamplingConfig(temperature=0.0),
        "temperature1.5": SamplingConfig(temperature=1.5),
    }.items():
        target_logits = rng.normal(size=8) * 1.5
        draft_logits = target_logits + rng.normal(size=8)
        p = np.asarray(probs_from_logits(jnp.asarray(target_logits, jnp.float32), config))
        q = np.asarray(probs_from_logits(jnp.asarray(draft_logits, jnp.float32), config))
        cases[name] = (p, q, False)
    return cases


PAIRS = _pairs()


def test_enough_pairs():
    assert len(PAIRS) >= 21


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_first_token_distribution_is_p(name):
    p, q, deterministic = PAIRS[name]
    p = np.asarray(p, np.float64) / np.sum(p)
    q = np.asarray(q, np.float64) / np.sum(q)
    key = jax.random.key(sum(map(ord, name)))
    samples = first_tokens(
        key,
        jnp.asarray(p, jnp.float32),
        jnp.asarray(q, jnp.float32),
        num=NUM_DRAWS,
        deterministic=deterministic,
    )
    pvalue, tv, outside = distribution_test(samples, p)
    print(f"\nEXACTNESS {name}: V={p.size} tv={tv:.5f} chi2_pvalue={pvalue:.3g}")
    assert outside == 0, "emitted a token with zero target probability"
    assert tv < TV_MAX, f"total variation {tv:.5f}"
    assert pvalue > P_VALUE_MIN, f"chi-square p-value {pvalue:.2e}"


@pytest.mark.parametrize("deterministic", [False, True])
def test_wrong_correction_is_detected(deterministic):
    """The same check rejects the rule that resamples a rejection from plain p."""
    p = np.array([0.2, 0.5, 0.3])
    q = np.array([0, 1.0, 0]) if deterministic else np.array([0.6, 0.3, 0.1])
    samples = first_tokens(
        jax.random.key(0),
        jnp.asarray(p, jnp.float32),
        jnp.asarray(q, jnp.float32),
        num=NUM_DRAWS,
        deterministic=deterministic,
        wrong=True,
    )
    wrong = one_position(p, q).wrong_output
    pvalue, tv, _ = distribution_test(samples, p)
    assert pvalue < 1e-12 and tv > 0.02
    assert distribution_test(samples, wrong)[0] > P_VALUE_MIN  # it samples what theory says


# ---------------------------------------------------------- Monte Carlo, a round of γ = 3


@functools.partial(jax.jit, static_argnames=("num",))
def sample_rounds(key, ps, qs, *, num):
    gamma, vocab = qs.shape
    draft_key, accept_key = jax.random.split(key)
    x = jax.random.categorical(draft_key, jnp.log(qs), shape=(num, gamma)).astype(jnp.int32)
    result = accept(
        jax.random.split(accept_key, num),
        x,
        jnp.broadcast_to(qs[None], (num, gamma, vocab)),
        jnp.broadcast_to(ps[None], (num, gamma + 1, vocab)),
    )
    return x, result.num_accepted, result.next_token


def test_gamma3_round_matches_closed_form():
    rng = np.random.default_rng(3)
    vocab, gamma = 3, 3
    ps = rng.dirichlet([1.0] * vocab, size=gamma + 1)
    qs = 0.5 * ps[:gamma] + 0.5 * rng.dirichlet([1.0] * vocab, size=gamma)
    ps[1] = [0.0, 0.4, 0.6]  # a zero, so some drafts must be rejected
    x, n, y = map(
        np.asarray,
        sample_rounds(
            jax.random.key(3),
            jnp.asarray(ps, jnp.float32),
            jnp.asarray(qs, jnp.float32),
            num=NUM_DRAWS,
        ),
    )
    exact = round_distribution(ps, qs)

    # Encode outcomes (x_1..x_n, y) as integers.
    def code(outcome):
        value = len(outcome)
        for t in outcome:
            value = value * vocab + t
        return value * (gamma + 2) + len(outcome)

    seq = np.concatenate([x, y[:, None]], axis=1)
    codes = np.zeros(NUM_DRAWS, np.int64)
    for k in range(gamma + 1):
        rows = n == k
        c = np.full(rows.sum(), k + 1, np.int64)
        for j in range(k):
            c = c * vocab + seq[rows, j]
        c = c * vocab + y[rows]
        codes[rows] = c * (gamma + 2) + k + 1
    outcomes = sorted(exact, key=code)
    index = {code(o): i for i, o in enumerate(outcomes)}
    assert set(np.unique(codes)) <= set(index), "an impossible outcome was emitted"
    counts = np.bincount([index[c] for c in codes], minlength=len(outcomes))
    expected = np.array([exact[o] for o in outcomes])
    assert abs(expected.sum() - 1) < 1e-12
    assert stats.chisquare(counts, NUM_DRAWS * expected).pvalue > P_VALUE_MIN

    # num_accepted: P(n >= k) = prod_{i<=k} sum(min(p_i, q_i)).
    beta = np.minimum(ps[:gamma], qs).sum(-1)
    at_least = np.concatenate([[1.0], np.cumprod(beta)])
    probs_n = at_least - np.concatenate([at_least[1:], [0.0]])
    assert (
        stats.chisquare(np.bincount(n, minlength=gamma + 1), NUM_DRAWS * probs_n).pvalue
        > P_VALUE_MIN
    )
    # And the first emitted token is distributed as p_1.
    first = np.where(n >= 1, x[:, 0], y)
    pvalue, tv, outside = distribution_test(first, ps[0])
    assert outside == 0 and tv < TV_MAX and pvalue > P_VALUE_MIN


# ------------------------------------------------------------------------- properties


def test_greedy_accepts_iff_argmax():
    target = jax.nn.one_hot(jnp.array([[2, 1, 3, 0]]), 4)
    draft_tokens = jnp.array([[2, 1, 0]])
    result = accept(jax.random.split(jax.random.key(0), 1), draft_tokens, None, target)
    assert result.num_accepted.tolist() == [2] and result.next_token.tolist() == [3]
    draft = jax.nn.one_hot(draft_tokens, 4)
    result = accept(jax.random.split(jax.random.key(0), 1), draft_tokens, draft, target)
    assert result.num_accepted.tolist() == [2] and result.next_token.tolist() == [3]


def test_p_equals_q_accepts_everything_without_nan():
    rng = np.random.default_rng(0)
    probs = jnp.asarray(rng.dirichlet([1.0] * 6, size=(64, 5)), jnp.float32)
    tokens = jax.random.categorical(jax.random.key(1), jnp.log(probs[:, :4]))
    keys = jax.random.split(jax.random.key(2), 64)
    result = accept(keys, tokens, probs[:, :4], probs)
    assert result.num_accepted.tolist() == [4] * 64
    assert np.all(np.asarray(result.next_token) >= 0)


def test_row_depends_only_on_its_key_and_inputs_and_vmaps():
    rng = np.random.default_rng(5)
    uniforms, draws, tokens, draft, target = random_case(rng, 8, 3, 5, False)
    keys = jax.random.split(jax.random.key(9), 8)
    whole = accept(keys, tokens, draft, target)
    for b in [0, 3, 7]:
        alone = accept(keys[b : b + 1], tokens[b : b + 1], draft[b : b + 1], target[b : b + 1])
        assert alone.num_accepted[0] == whole.num_accepted[b]
        assert alone.next_token[0] == whole.next_token[b]
    # vmap over an extra leading axis gives the same as the batched call.
    vmapped = jax.vmap(lambda k, t, d, p: accept(k[None], t[None], d[None], p[None]))(
        keys, jnp.asarray(tokens), jnp.asarray(draft), jnp.asarray(target)
    )
    np.testing.assert_array_equal(vmapped.num_accepted[:, 0], whole.num_accepted)
    np.testing.assert_array_equal(vmapped.next_token[:, 0], whole.next_token)


def test_gamma_zero_is_plain_sampling():
    p = jnp.asarray([0.1, 0.7, 0.2], jnp.float32)
    keys = jax.random.split(jax.random.key(4), 200_000)
    result = jax.jit(accept, static_argnums=())(
        keys, jnp.zeros((200_000, 0), jnp.int32), None, jnp.broadcast_to(p, (200_000, 1, 3))
    )
    assert int(result.num_accepted.max()) == 0
    pvalue, tv, _ = distribution_test(result.next_token, np.asarray(p, np.float64))
    assert pvalue > P_VALUE_MIN and tv < TV_MAX


# --------------------------------------------------------------------------- bad input


def test_bad_shapes_are_rejected_before_tracing():
    keys = jax.random.split(jax.random.key(0), 2)
    tokens = jnp.zeros((2, 3), jnp.int32)
    p = jnp.full((2, 4, 5), 0.2)
    q = jnp.full((2, 3, 5), 0.2)
    with pytest.raises(ValueError, match="target_probs"):
        accept(keys, tokens, q, p[:, :3])
    with pytest.raises(ValueError, match="draft_probs.*vocabulary"):
        accept(keys, tokens, jnp.full((2, 3, 6), 1 / 6), p)
    with pytest.raises(ValueError, match="draft_tokens"):
        accept(keys, tokens[0], q, p)
    with pytest.raises(TypeError, match="draft_tokens"):
        accept(keys, tokens.astype(jnp.float32), q, p)
    with pytest.raises(ValueError, match="keys"):
        accept(keys[:1], tokens, q, p)
    with pytest.raises(ValueError, match="keys"):
        accept(jnp.zeros((2,), jnp.float32), tokens, q, p)
    # The noise of the explicit form: a Gumbel vector per row (the old API) is refused.
    with pytest.raises(ValueError, match="draws"):
        accept_with_noise(jnp.zeros((2, 3)), jnp.zeros((2, 5)), tokens, q, p)
    with pytest.raises(ValueError, match="uniforms"):
        accept_with_noise(jnp.zeros((2, 2)), jnp.zeros((2,)), tokens, q, p)
