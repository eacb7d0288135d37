"""The CPU kernel's custom call (jax_specdec/kernels/cpu_matmul.cc): the products it
computes, the rows it takes, its gradient, and that the model's decode uses it."""

import os
import pathlib
import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_specdec.kernels import cpu_matmul
from jax_specdec.nn import KVCache, Transformer, TransformerConfig, init_cache, products

# Without a C++ compiler the kernel cannot be built and the products are XLA's; with one,
# a build that fails is a failure here, not a skip.
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX") or "c++") is None, reason="no C++ compiler"
)


@pytest.fixture(autouse=True, scope="module")
def _registered():
    """The tests that call the kernels directly need them registered (any test alone)."""
    cpu_matmul.available()


def test_the_kernel_builds():
    assert cpu_matmul.available()


# (leading dims, K, N): every row count 1-8 (6-8 take two vectors of columns per pass),
# tails of columns and of rows of e, K not a multiple of 8, one column, the model's
# shapes.
SHAPES = [
    ((2, 2), 100, 700),
    ((5,), 200, 97),
    ((1, 8), 576, 1536),
    ((2, 4), 33, 17),
    ((2,), 33, 17),
    ((3,), 200, 96),
    ((4,), 256, 256),
    ((1,), 64, 48),
    ((2, 3), 577, 1539),
    ((8,), 13, 1),
    ((6,), 64, 48),
    ((1, 5), 576, 1536),
    ((4, 2), 1536, 577),
    ((7,), 100, 700),
    ((3,), 300, 200),
    ((8,), 130, 4103),  # columns enough to split over the threads
]


def _data(lead, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    return jnp.asarray(x), jnp.asarray(w)


@pytest.mark.parametrize("lead,k,n", SHAPES)
def test_products_match_float64(lead, k, n):
    """The kernels themselves (`_kernel`, `_kernel_t`), 1-8 rows."""
    x, w = _data(lead, k, n)
    e = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))  # [N, K]: x @ e.T = x @ w
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    tol = 2e-6 * np.sqrt(k) * np.abs(want).max()
    for fn, weight in ((cpu_matmul._kernel, w), (cpu_matmul._kernel_t, e)):
        got = jax.jit(fn)(x, weight)
        assert got.shape == (*lead, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("lead,k,n", SHAPES)
def test_rows_equal_the_same_rows_one_at_a_time(lead, k, n):
    """A verify call's rows are bit for bit the rows of one-token steps, for `matmul` and
    the LM head (`matmul_t`) alike."""
    x, w = _data(lead, k, n, seed=1)
    e = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
    rows = x.reshape(-1, k)
    for fn, weight in ((cpu_matmul._kernel, w), (cpu_matmul._kernel_t, e)):
        together = jax.jit(fn)(rows, weight)
        alone = jnp.concatenate([jax.jit(fn)(rows[i : i + 1], weight) for i in range(len(rows))])
        np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40, 64, 65])
def test_matmul_and_matmul_t_take_the_kernel_up_to_their_limits(rows):
    x, w = _data((rows,), 24, 40, seed=3)
    e = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for fn, weight, limit in (
        (products.matmul, w, cpu_matmul.MAX_ROWS),
        (products.matmul_t, e, cpu_matmul.MAX_ROWS_T),
    ):
        transposed = fn is products.matmul_t
        assert cpu_matmul.uses_kernel(x, weight, transposed) == (rows <= limit)
        hlo = jax.jit(fn).lower(x, weight).as_text()
        assert ("@jax_specdec_small_matmul" in hlo) == (rows <= limit)
        np.testing.assert_allclose(jax.jit(fn)(x, weight), want, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_more_rows_than_it_takes():
    x, w = _data((cpu_matmul.MAX_ROWS + 1,), 24, 40)
    for fn, weight in ((cpu_matmul._kernel, w), (cpu_matmul._kernel_t, w.T)):
        with pytest.raises(Exception, match="x must hold 1 to 8 rows"):
            jax.block_until_ready(jax.jit(fn)(x, weight))


def test_what_takes_the_kernel(monkeypatch):
    x, w = _data((2, 4), 32, 16)
    assert cpu_matmul.uses_kernel(x, w)
    assert cpu_matmul.uses_kernel(x, w.T, transposed=True)
    assert not cpu_matmul.uses_kernel(jnp.zeros((cpu_matmul.MAX_ROWS + 1, 32)), w)
    assert not cpu_matmul.uses_kernel(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not cpu_matmul.uses_kernel(jnp.zeros((0, 32)), w)
    assert not cpu_matmul.uses_kernel(x, w[:16])  # inner sizes differ: jnp says so
    with pytest.raises((TypeError, ValueError)):
        products.matmul(x, w[:16])
    with pytest.raises((TypeError, ValueError)):
        products.matmul_t(x, w[:16])
    assert products.matmul(x, w[:, :0]).shape == (2, 4, 0)  # no outputs: jnp
    monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "0")
    assert not cpu_matmul.uses_kernel(x, w)
    np.testing.assert_array_equal(products.matmul(x, w), x @ w)


@pytest.mark.parametrize("lead,k,n", SHAPES)
def test_16_bit_weights_give_the_float32_weights_products(lead, k, n):
    """float16 and bfloat16 weights are widened as they are read: the product is, bit
    for bit, the product with the same weights stored as float32 (1-8 rows, the tails of
    columns and rows; x @ w and the tied LM head x @ eᵀ)."""
    x, w = _data(lead, k, n, seed=4)
    e = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
    for dtype in (jnp.float16, jnp.bfloat16):
        for fn, weight, transposed in (
            (products.matmul, w, False),
            (products.matmul_t, e, True),
        ):
            narrow = weight.astype(dtype)
            assert cpu_matmul.uses_kernel(x, narrow, transposed)
            got = jax.jit(fn)(x, narrow)
            assert got.dtype == jnp.float32
            np.testing.assert_array_equal(got, jax.jit(fn)(x, narrow.astype(jnp.float32)))


def test_16_bit_weights_above_the_row_limit_go_in_pieces(monkeypatch):
    """More rows than the kernel takes: with 16-bit weights, pieces through the kernel (no
    float32 copy of the weights per call); without the kernel, jnp's product with the
    weights cast to x's type."""
    x, w = _data((2, cpu_matmul.MAX_ROWS + 3), 24, 40, seed=5)
    rows = x.reshape(-1, 24)
    for fn, kernel, weight, transposed in (
        (products.matmul, cpu_matmul._kernel, w, False),
        (products.matmul_t, cpu_matmul._kernel_t, w.T, True),
    ):
        half = weight.astype(jnp.float16)
        assert not cpu_matmul.uses_kernel(x, half, transposed)
        hlo = jax.jit(fn).lower(x, half).as_text()
        assert hlo.count("@jax_specdec_small_matmul") == 3  # 8 + 8 + 6 rows
        limit = cpu_matmul.MAX_ROWS
        want = jnp.concatenate([kernel(rows[i : i + limit], half) for i in (0, limit, 2 * limit)])
        np.testing.assert_array_equal(jax.jit(fn)(x, half), want.reshape(2, limit + 3, 40))
        monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "0")
        np.testing.assert_allclose(fn(x, half), fn(x, half.astype(jnp.float32)), rtol=1e-6)
        fresh = jax.jit(lambda a, b, fn=fn: fn(a, b))  # traced again: the variable is read
        assert "@jax_specdec_small_matmul" not in fresh.lower(x, half).as_text()
        monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "1")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
@pytest.mark.slow
def test_16_bit_widening_on_every_instruction_set(march, tmp_path):
    """The 16-bit paths compiled without XLA for AVX-512 (native here), F16C without
    AVX-512 (x86-64-v3) and neither (x86-64): every float16 and bfloat16 value widens
    exactly (signalling NaNs may come out quiet), and every product path gives what the
    widened float32 weights give (tests/cpu_matmul_widen.cc)."""
    needs = {"x86-64-v3": {"avx2", "f16c", "fma"}, "x86-64": set(), "native": set()}[march]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march}")
    driver = pathlib.Path(__file__).with_name("cpu_matmul_widen.cc")
    compiler = os.environ.get("CXX") or "c++"
    binary, out = tmp_path / "widen", tmp_path / "widened.bin"
    flags = ["-O2", f"-march={march}", "-ffp-contract=fast", "-std=c++17", "-w"]
    subprocess.run([compiler, *flags, str(driver), "-o", str(binary)], check=True)
    done = subprocess.run([str(binary), str(out)], check=True, capture_output=True, text=True)
    assert done.stdout.strip() == "0", f"{done.stdout.strip()} products differ"
    got = np.fromfile(out, np.uint32).reshape(4, 65536)
    bits = np.arange(65536, dtype=np.uint16)
    half = bits.view(np.float16).astype(np.float32)
    brain = (bits.astype(np.uint32) << 16).view(np.float32)
    for row, want in zip(got, (half, half, brain, brain), strict=True):
        nan = np.isnan(want)
        np.testing.assert_array_equal(row[~nan], want[~nan].view(np.uint32))
        assert np.isnan(row[nan].view(np.float32)).all()


def test_bfloat16_products_keep_float32_logits():
    x, w = _data((1, 3), 32, 16)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got = products.matmul(x, w, preferred_element_type=jnp.float32)
    want = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


def test_gradient_is_the_products():
    x, w = _data((3,), 40, 24, seed=2)
    e = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w)))

    for kernel, plain, weight in (
        (products.matmul, jnp.matmul, w),
        (products.matmul_t, lambda x, e: x @ e.T, e),
    ):
        got = jax.grad(loss(kernel), argnums=(0, 1))(x, weight)
        want = jax.grad(loss(plain), argnums=(0, 1))(x, weight)
        for g, h in zip(got, want, strict=True):
            np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


def test_the_models_decode_calls_it():
    config = TransformerConfig.tiny(vocab_size=64, num_layers=1, tie_embeddings=True)
    model = Transformer(config, rngs=nnx.Rngs(0))
    cache: KVCache = init_cache(config, batch=1, max_len=16)
    tokens = jnp.ones((1, 5), jnp.int32)
    hlo = jax.jit(lambda t, c: model.decode(t, c)).lower(tokens, cache).as_text()
    assert hlo.count("@jax_specdec_small_matmul_t(") == 1  # the tied LM head
    assert hlo.count("@jax_specdec_small_matmul(") == 7  # q, k, v, o, gate, up, down


def test_bfloat16_models_give_float32_logits():
    """The untied LM head of a bfloat16 model accumulates in float32 (XLA's product)."""
    config = TransformerConfig.tiny(vocab_size=64, num_layers=1, dtype="bfloat16")
    model = Transformer(config, rngs=nnx.Rngs(0))
    logits = model(jnp.ones((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32
    h = jnp.ones((1, 4, config.d_model), jnp.bfloat16)
    head = model.lm_head[...].astype(jnp.bfloat16)
    want = jnp.einsum("btd,dv->btv", h, head, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(model._logits(h), want)
