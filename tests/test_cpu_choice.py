"""Whether the CPU kernel is used where the environment leaves it open: the choice
measured once per machine (kernel against XLA's products, interleaved) and cached beside
the library, read from the cache afterwards, overridden by JAX_SPECDEC_SMALL_MATMUL."""

import json

import jax.numpy as jnp
import pytest

from jax_specdec.kernels import cpu_choice, cpu_matmul, cpu_measure

X, W = jnp.ones((2, 32), jnp.float32), jnp.ones((32, 48), jnp.float32)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty cache folder (the built library is only looked up there), the variable
    unset, and no choice remembered by this process."""
    monkeypatch.setenv("JAX_SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_SPECDEC_SMALL_MATMUL", raising=False)
    cpu_choice.kernel_pays.cache_clear()
    cpu_matmul._pays_here.cache_clear()
    yield tmp_path
    cpu_choice.kernel_pays.cache_clear()
    cpu_matmul._pays_here.cache_clear()


@pytest.mark.parametrize("pays", [True, False])
def test_the_cached_choice_decides_where_the_variable_is_unset(fresh_cache, monkeypatch, pays):
    if not cpu_matmul.available():
        pytest.skip("no C++ compiler: the kernel is never used")
    path = cpu_matmul.choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pays": pays}))
    assert cpu_matmul.uses_kernel(X, W) is pays
    monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "1")
    assert cpu_matmul.uses_kernel(X, W)
    monkeypatch.setenv("JAX_SPECDEC_SMALL_MATMUL", "0")
    assert not cpu_matmul.uses_kernel(X, W)


def test_the_measurement_times_both_ways_on_one_and_five_rows():
    if not cpu_matmul.available():
        pytest.skip("no C++ compiler: the kernel is never used")
    run, args = cpu_measure._stack(5, kernel=True)
    assert "@jax_specdec_small_matmul" in run.lower(*args).as_text()  # the kernel, timed
    run, args = cpu_measure._stack(5, kernel=False)
    assert "@jax_specdec_small_matmul" not in run.lower(*args).as_text()
    result = cpu_measure.measure(repeats=2, calls=2)
    assert set(result["rows"]) == {"1", "5"}
    assert all(t > 0 for r in result["rows"].values() for t in r.values())
    xla, kernel = result["xla_s"], result["kernel_s"]
    assert result["pays"] == (kernel < (1 - cpu_choice.MARGIN) * xla)


@pytest.mark.slow
def test_an_unmeasured_machine_is_measured_once_in_a_subprocess(fresh_cache):
    if not cpu_matmul.available():
        pytest.skip("no C++ compiler: the kernel is never used")
    path = cpu_matmul.choice_path()
    assert not path.exists()
    pays = cpu_choice.kernel_pays(path)
    record = json.loads(path.read_text())
    assert record["pays"] is pays and record["kernel_s"] > 0 and record["xla_s"] > 0
    assert cpu_matmul.uses_kernel(X, W) is pays
