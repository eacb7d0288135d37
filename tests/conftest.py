"""Shared fixtures: the tiny target and draft of the loop tests, and a tiny pair saved as
model directories. Shared functions live in helpers.py."""

import os

import jax
import pytest
from flax import nnx
from helpers import make_draft, make_model

from jax_specdec.io.hf import save_model
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.training.corpus import stdlib_corpus, train_tokenizer

# In-process CLI calls would turn on JAX's persistent compilation cache (in the user's
# cache directory) for the rest of the test process: tests keep it off so that they write
# nothing there (test_zoo checks the switch itself).
os.environ.setdefault("JAX_SPECDEC_COMPILE_CACHE", "0")

# Every program XLA:CPU compiles keeps a few hundred memory maps until it is dropped, and a
# process may hold vm.max_map_count (65530 by default) of them: past that, the next compile
# segfaults. The whole suite compiles thousands of programs in one process, so compiled
# programs are dropped once a test leaves the process above MAP_BUDGET maps.
MAP_BUDGET = 20_000


def _memory_maps():
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no count, drop programs after every test
        return MAP_BUDGET + 1


@pytest.fixture(autouse=True)
def _drop_compiled_programs():
    yield
    if _memory_maps() > MAP_BUDGET:
        jax.clear_caches()


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
