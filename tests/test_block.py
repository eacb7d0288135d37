"""Block verification as the loop's acceptance rule: the enumerated exactness test, a
wrong variant failing it, greedy equality, and never fewer tokens kept on average than
the token-by-token rule with the same drafts and noise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    VOCAB,
    assert_follows_target,
    ragged_prompts,
    sample_sequences,
    wrong_rule_pvalue,
)

from jax_specdec import Generator, SamplingConfig
from jax_specdec.acceptance import accept_block_with_noise, accept_with_noise

SETTINGS = {
    "t1_g3": (SamplingConfig(1.0), 3, None),
    "t0.7_topp0.9_g2_eos": (SamplingConfig(0.7, top_p=0.9), 2, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_block_verified_samples_follow_the_target(target, draft, name):
    sampling, gamma, eos = SETTINGS[name]
    seqs, stats = sample_sequences(
        target, draft, sampling, gamma, eos, seed=len(name), acceptance="block"
    )
    assert 0.05 < stats.acceptance_rate < 0.95
    assert_follows_target(target, seqs, sampling, eos, name)


def unnormalised_weights(uniforms, draws, draft_tokens, draft_probs, target_probs, num_drafted):
    """A wrong block rule: h_i = w_i for every i (the residual's mass ignored)."""
    p_x = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]
    q_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    w = jnp.minimum(jnp.cumprod(p_x / q_x, axis=1), 1.0)  # no running min: also wrong
    at = jnp.arange(1, draft_tokens.shape[1] + 1)[None]
    passed = (uniforms < w) & (at <= num_drafted[:, None])
    kept = jnp.max(jnp.where(passed, at, 0), axis=1).astype(jnp.int32)
    zero = jnp.zeros_like(draws)
    return accept_with_noise(
        zero[:, None] + 0 * uniforms, draws, draft_tokens, draft_probs, target_probs, kept
    )


@pytest.mark.slow
def test_a_wrong_block_rule_fails_the_same_test(target, draft):
    sampling, gamma, eos = SETTINGS["t1_g3"]
    seqs, _ = sample_sequences(
        target, draft, sampling, gamma, eos, seed=0, _rule=unnormalised_weights
    )
    assert wrong_rule_pvalue(target, seqs, sampling, eos) < 1e-6


def test_greedy_block_verification_emits_the_autoregressive_tokens(target, draft):
    prompts = ragged_prompts(8, VOCAB, seed=2)
    kwargs = dict(key=jax.random.key(0), max_new_tokens=16)
    ar = Generator(target)(prompts, **kwargs)
    out = Generator(target, draft, schedule=3, acceptance="block")(
        prompts, **kwargs
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))


def test_block_keeps_no_fewer_tokens_than_token_by_token_on_average():
    """One round, context-free p and q (the same at every position), 200,000 rows with
    the same noise for both rules: block verification keeps at least as many drafts on
    average (it is optimal among exact rules), and here strictly more."""
    rows, gamma = 200_000, 3
    p = jnp.asarray([0.1, 0.6, 0.3])
    q = jnp.asarray([0.6, 0.1, 0.3])
    key_x, key_u, key_d = jax.random.split(jax.random.key(0), 3)
    x = jax.random.categorical(key_x, jnp.log(q), shape=(rows, gamma)).astype(jnp.int32)
    u = jax.random.uniform(key_u, (rows, gamma))
    d = jax.random.uniform(key_d, (rows,))
    tp = jnp.broadcast_to(p, (rows, gamma + 1, 3))
    dq = jnp.broadcast_to(q, (rows, gamma, 3))
    token = accept_with_noise(u, d, x, dq, tp).num_accepted.mean()
    block = accept_block_with_noise(u, d, x, dq, tp).num_accepted.mean()
    print(f"\nmean kept: token-by-token {float(token):.4f}, block {float(block):.4f}")
    assert float(block) > float(token) + 0.01
