"""bfloat16 models: the default dtype (bfloat16 on an accelerator), and exactness with a
bfloat16 target and draft, whose logits, acceptance and sampling stay float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPTS,
    VOCAB,
    assert_follows_target,
    make_model,
    ragged_prompts,
    sample_sequences,
)

from jax_specdec import Generator, SamplingConfig
from jax_specdec.io import hf_config

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")


@pytest.fixture(scope="module")
def half():
    """The enumerated tests' target and a one-layer draft, in bfloat16."""
    return make_model(0, **BF16), make_model(3, num_layers=1, **BF16)


def test_default_dtype_is_bfloat16_on_an_accelerator(monkeypatch):
    assert hf_config.default_dtype(None) == "float32"  # this CPU
    assert hf_config.default_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert hf_config.default_dtype("float32") == "bfloat16"
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32}
    config.update(intermediate_size=64, num_attention_heads=4, num_hidden_layers=1)
    config.update(vocab_size=16, max_position_embeddings=64, torch_dtype="float32")
    assert hf_config.config_from_hf(config).dtype == "bfloat16"
    assert hf_config.config_from_hf(config, dtype="float32").dtype == "float32"


def test_logits_are_float32(half):
    target, _ = half
    assert target.embed[...].dtype == jnp.bfloat16
    assert target(jnp.asarray([PROMPTS[1]])).dtype == jnp.float32


@pytest.mark.parametrize("gamma", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_speculative_equals_autoregressive(half, gamma):
    target, draft = half
    prompts = [(p * 3)[:10] for p in ragged_prompts(8, VOCAB, seed=4, max_len=6)]
    call = dict(key=jax.random.key(0), max_new_tokens=12)
    ar = Generator(target)(prompts, **call)
    spec = Generator(target, draft, schedule=gamma)(prompts, **call)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    assert int(spec.stats.accepted.sum()) > 0


@pytest.mark.slow
def test_samples_follow_the_bfloat16_target(half):
    """10^5 sampled sequences against the exactly enumerated distribution of the
    bfloat16 target (its float32 logits)."""
    target, draft = half
    seqs, stats = sample_sequences(target, draft, SamplingConfig(1.0), 2, None, seed=3)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert_follows_target(target, seqs, SamplingConfig(1.0), None, label="bfloat16 γ 2")
