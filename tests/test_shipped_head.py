"""The shipped feature head for SmolLM2-135M (`models/smollm2-135m-eagle`): it loads,
is shaped for SmolLM2, carries its training record, and drafts in the loop without
changing a greedy output. SmolLM2 itself is not needed: a random two-layer target of
its shapes stands in (the head only checks shapes and vocabulary against a target)."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from jax_specdec import SamplingConfig, autoregressive_generate, speculative_generate
from jax_specdec.decode.drafters.feature_head import attach_head
from jax_specdec.io.heads import load_head
from jax_specdec.nn import Transformer

HEAD = pathlib.Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-eagle"


def test_shipped_head_is_shaped_for_smollm2_and_small():
    head = load_head(HEAD)
    config = head.config
    assert (config.d_model, config.vocab_size, config.kept) == (576, 49152, 8192)
    assert config.target == "smollm2-135m" and len(config.tokenizer_sha256) == 64
    ids = np.asarray(head.vocab_map[...])
    assert len(np.unique(ids)) == config.kept and 0 <= ids.min() and ids.max() < 49152
    size = sum(f.stat().st_size for f in HEAD.iterdir())
    assert size <= 40e6, f"{HEAD} holds {size / 1e6:.1f} MB"
    record = json.loads((HEAD / "training.json").read_text())
    first = record.get("init_training") or {}  # the run the shipped head started from
    assert record["train_tokens"] > 400_000 and first.get("train_tokens", 0) > 900_000
    assert len(record["agreement"]) == 3 and record["data"]["kind"] == "self"
    assert "Apache-2.0" in (HEAD / "README.md").read_text()


@pytest.mark.slow
def test_shipped_head_keeps_greedy_output():
    head = load_head(HEAD)
    target = Transformer(
        head.config.layer.replace(
            num_layers=2, tie_embeddings=True, max_len=128, param_dtype="float32"
        ),
        rngs=nnx.Rngs(0),
        init_scale=0.5,
    )
    draft = attach_head(head, target)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    kwargs = dict(key=jax.random.key(0), max_new_tokens=12, sampling=SamplingConfig(0.0))
    spec = speculative_generate(target, draft, prompts, num_draft_tokens=3, **kwargs)
    plain = autoregressive_generate(target, prompts, **kwargs)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    assert int(np.asarray(spec.stats.drafted_at).sum()) > 0
