"""Shared fixtures: the tiny target and draft of the loop tests, and a tiny pair saved as
model directories. Shared functions live in helpers.py."""

import os

import pytest
from flax import nnx
from helpers import make_draft, make_model

from jax_specdec.data import stdlib_corpus, train_tokenizer
from jax_specdec.hf import save_model
from jax_specdec.nn import Transformer, TransformerConfig

# In-process CLI calls would turn on JAX's persistent compilation cache (in the user's
# cache directory) for the rest of the test process: tests keep it off (test_zoo checks
# the switch itself). A long run with it on crashed once in the cache write.
os.environ.setdefault("JAX_SPECDEC_COMPILE_CACHE", "0")


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """target/, draft/ (same tokenizer) and other/ (a different tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    corpus = stdlib_corpus()
    tokenizer = train_tokenizer(corpus.read(corpus.train[:10]), 300)
    vocab = tokenizer.get_vocab_size()
    target = Transformer(TransformerConfig.tiny(vocab_size=vocab), rngs=nnx.Rngs(0), init_scale=0.3)
    draft = Transformer(
        TransformerConfig.tiny(vocab_size=vocab, num_layers=1), rngs=nnx.Rngs(1), init_scale=0.3
    )
    save_model(target, root / "target", tokenizer=tokenizer)
    save_model(draft, root / "draft", tokenizer=tokenizer)
    other = train_tokenizer(corpus.read(corpus.train[10:20]), 300)
    save_model(draft, root / "other", tokenizer=other)
    return root


@pytest.fixture(scope="module")
def target():
    """The target of the enumerated exactness tests (vocabulary 6)."""
    return make_model(0)


@pytest.fixture(scope="module")
def draft():
    return make_draft()
