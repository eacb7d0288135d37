"""The key/value cache: an explicit pytree passed into and returned by `Transformer.decode`.

Contract:
- `keys[l]`, `values[l]`: [B, num_kv_heads, S, head_dim], one array per layer.
  Heads before positions, so attention reads the cache without a transpose
  (with [B, S, K, hd] XLA copied the whole cache every step: 3.4x slower at B=8).
- `lengths`: [B] int32, how many positions of each row are valid.
- `decode(tokens [B, T], cache)` writes row b's T new entries at positions
  `lengths[b] + t` and returns the cache with `lengths + T`.
- A query at position p sees keys at positions <= p of its own row, so anything
  stored at or beyond a row's length (e.g. rejected drafts) is never read.
  Rolling a row back is `cache.replace(lengths=shorter)`; nothing is copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jax_specdec.nn.config import TransformerConfig


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus the per-row number of valid positions."""

    keys: tuple[jax.Array, ...]  # num_layers x [B, K, S, hd]
    values: tuple[jax.Array, ...]  # num_layers x [B, K, S, hd]
    lengths: jax.Array  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]


def init_cache(
    config: TransformerConfig,
    *,
    batch: int,
    max_len: int,
    dtype: jnp.dtype | str | None = None,
) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` positions.

    Args:
        config: the model's config.
        batch: number of rows B (>= 1).
        max_len: positions per row S, 1 <= S <= config.max_len.
        dtype: storage dtype of keys and values; defaults to `config.dtype`.

    Returns:
        A `KVCache` with zero keys/values and zero lengths.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1, got {max_len!r}")
    if max_len > config.max_len:
        raise ValueError(
            f"max_len ({max_len}) exceeds the model's config.max_len ({config.max_len})"
        )
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def write_entries(
    cache: KVCache, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...], start: jax.Array
) -> KVCache:
    """Writes per-layer entries [B, T, K, hd] at positions start[b] + t (one scatter per
    array; writes past the cache's size are dropped). Lengths are left as they are.
    """
    T = keys[0].shape[1]
    rows = jnp.arange(cache.batch_size, dtype=jnp.int32)[:, None]
    positions = start.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)

    def write(array, new):
        # Advanced indices first: array[rows, :, positions] is [B, T, K, hd].
        return array.at[rows, :, positions].set(
            new.astype(array.dtype), indices_are_sorted=True, unique_indices=True, mode="drop"
        )

    return cache.replace(
        keys=tuple(map(write, cache.keys, keys)), values=tuple(map(write, cache.values, values))
    )
