"""Shared fixtures: the tiny target and draft of the exactness tests, and a tiny pair
saved as model directories. Shared functions live in helpers.py; the compile settings,
the run's compilation cache and the per-file compile budgets in compile_plugin.py."""

import pytest
from helpers import make_draft, make_model, save_tiny_pair

pytest_plugins = ["compile_plugin"]


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """target/, draft/ (same tokenizer) and other/ (a different tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    save_tiny_pair(root, other=True)
    return root


@pytest.fixture(scope="module")
def target():
    """The target of the enumerated exactness tests (vocabulary 6)."""
    return make_model(0)


@pytest.fixture(scope="module")
def draft():
    return make_draft()
