"""The model code's two products, `matmul` (x @ w) and `matmul_t` (x @ eᵀ, a tied
embedding as the LM head).

On the CPU backend they take the optional CPU kernel (`jax_specdec.kernels.cpu_matmul`)
where it applies; on every other backend, and wherever the kernel does not apply, they
are jnp's products. The kernel's module is imported (and its library built) only when
the default backend is the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["matmul", "matmul_t"]


def _kernel():
    """The CPU kernel's module on the CPU backend, else None (never imported there)."""
    if jax.default_backend() != "cpu":
        return None
    from jax_specdec.kernels import cpu_matmul

    return cpu_matmul


def matmul(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]: the CPU kernel where it applies (float32 out),
    else `jnp.matmul` of x and w cast to x's type, with `preferred_element_type`."""
    if (kernel := _kernel()) is not None and (y := kernel.matmul(x, w)) is not None:
        return y
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=preferred_element_type)


def matmul_t(x: jax.Array, e: jax.Array) -> jax.Array:
    """x [..., D] @ e [V, D]ᵀ -> [..., V] float32: the CPU kernel where it applies, else
    jnp's product with e cast to x's type."""
    if (kernel := _kernel()) is not None and (y := kernel.matmul_t(x, e)) is not None:
        return y
    return jnp.einsum("...d,vd->...v", x, e.astype(x.dtype), preferred_element_type=jnp.float32)
