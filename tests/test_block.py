"""Block verification keeps no fewer tokens on average than the token-by-token rule with
the same drafts and noise. Its exactness as the loop's rule (greedy equality, enumerated
sampling, a wrong block rule caught) is tests/test_drafter_contract.py's."""

import jax
import jax.numpy as jnp
import pytest

from jax_specdec.acceptance import accept_block_with_noise, accept_with_noise


@pytest.mark.slow
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
