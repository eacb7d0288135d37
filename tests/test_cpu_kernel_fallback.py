"""The CPU kernel is optional: a failed build warns once and the model gives the same
tokens through XLA's products; on another backend the kernel is never imported."""

import os
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_specdec import autoregressive_generate, kernels
from jax_specdec.kernels import cpu_matmul
from jax_specdec.nn import Transformer, TransformerConfig, products


def _tokens():
    config = TransformerConfig.tiny(vocab_size=61, num_layers=1, d_model=40, tie_embeddings=True)
    model = Transformer(config, rngs=nnx.Rngs(3), init_scale=0.3)
    out = autoregressive_generate(model, [[1, 2, 3]], key=jax.random.key(0), max_new_tokens=6)
    return np.asarray(out.tokens)


@pytest.mark.slow
def test_a_failed_build_warns_once_and_gives_the_same_tokens(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "0")  # XLA's products, by choice
    jax.clear_caches()
    want = _tokens()
    monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "1")
    monkeypatch.setenv("JAX_SPECDEC_CACHE", str(tmp_path))  # no library built before
    monkeypatch.setenv("CXX", "no-such-compiler")
    cpu_matmul._library.cache_clear()
    jax.clear_caches()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _tokens()
            x = jnp.ones((2, 8))
            np.testing.assert_array_equal(products.matmul(x, jnp.eye(8)), x)
        messages = [str(w.message) for w in caught if "CPU kernel" in str(w.message)]
        assert len(messages) == 1 and "no-such-compiler" in messages[0], messages
        assert not cpu_matmul.available()
        np.testing.assert_array_equal(got, want)
    finally:
        cpu_matmul._library.cache_clear()  # the next test builds (or finds) the real one
        jax.clear_caches()


def _forbid_import(monkeypatch):
    """Any import of the kernel's module now raises ImportError."""
    monkeypatch.delattr(kernels, "cpu_matmul")
    monkeypatch.setitem(sys.modules, "jax_specdec.kernels.cpu_matmul", None)


def test_never_imported_on_another_backend(monkeypatch):
    _forbid_import(monkeypatch)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, w = jnp.ones((3, 8)), jnp.arange(64.0).reshape(8, 8)
    hlo = (
        jax.jit(products.matmul).lower(x, w).as_text()
        + jax.jit(products.matmul_t).lower(x, w).as_text()
    )
    assert "jax_specdec" not in hlo
    np.testing.assert_allclose(products.matmul(x, w), x @ w)


def test_the_cpu_backend_imports_it(monkeypatch):
    """The check above can fail: on the CPU backend the products import the kernel."""
    _forbid_import(monkeypatch)
    with pytest.raises(ImportError):
        products.matmul(jnp.ones((3, 8)), jnp.ones((8, 8)))


# A stand-in compiler: copies the library built by the real one (argv[1]) to "-o PATH".
FAKE_CXX = "import shutil, sys\nshutil.copyfile(sys.argv[1], sys.argv[sys.argv.index('-o') + 1])\n"


def _fake_compiler(tmp_path) -> str:
    """A $CXX of several words that "builds" the real library (skips without a compiler)."""
    if not cpu_matmul.available():
        pytest.skip("no C++ compiler: no real library to copy")
    good = cpu_matmul._library_path(os.environ.get("CXX") or "c++")
    script = tmp_path / "fake_cxx.py"
    script.write_text(FAKE_CXX)
    return f"{sys.executable} {script} {good}"


def test_cxx_may_be_a_command_of_several_words(tmp_path, monkeypatch):
    compiler = _fake_compiler(tmp_path)
    out = tmp_path / "kernels" / "lib.so"
    cpu_matmul._build(out, compiler)  # "ccache g++" is one such command
    assert out.read_bytes() == pathlib.Path(compiler.split()[-1]).read_bytes()
    monkeypatch.setenv("CXX", "no-such-ccache g++")
    with pytest.raises(RuntimeError, match=r"CXX='no-such-ccache g\+\+': \['no-such-ccache'\]"):
        cpu_matmul._build(out, "no-such-ccache g++")


@pytest.mark.slow
def test_a_damaged_library_in_the_cache_is_built_again_not_loaded(tmp_path, monkeypatch):
    """A truncated copy of the library at its cache key (a bad restore, a full disk) used
    to be loaded, and the process died of SIGBUS: a child process shows it."""
    compiler = _fake_compiler(tmp_path)
    good = pathlib.Path(compiler.split()[-1])
    monkeypatch.setenv("JAX_SPECDEC_CACHE", str(tmp_path / "cache"))
    library = cpu_matmul._library_path(compiler)
    cpu_matmul._build(library, compiler)  # as a real build leaves it, with its record
    library.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    env = {**os.environ, "CXX": compiler, "JAX_PLATFORMS": "cpu"}
    code = (
        "import jax.numpy as jnp; from jax_specdec.kernels import cpu_matmul as k; "
        "assert k.available(); x = jnp.ones((2, 8)); print(float(k.matmul(x, jnp.eye(8)).sum()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "16.0" and library.read_bytes() == good.read_bytes()
