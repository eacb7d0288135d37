"""Attention maths: rotary positions, softmax attention over several key/value parts,
and attention over a cache's live prefix only.

A decode or verify call attends over the cache only up to its longest live row,
rounded up to one of a few static sizes (`live_sizes`: a block, then doubling, then
the cache's size; at most five, and none smaller than a size worth its conditional):
`lax.switch` picks the branch whose static slice of the cache covers every row. The
maths in each branch is the plain masked softmax of `attention`, so the logits equal
full-cache attention's within float32 rounding (the masked positions added exactly
zero there). A loop over key/value blocks with an
online softmax, measured against it on this project's CPU, was no faster
(scripts/experiments/step_cost).

The attention kernel is chosen by backend (`kernel`): on GPU `jax.nn.dot_product_attention`,
elsewhere the einsum formulation below; every kernel takes the same parts (keys,
values, masks) and computes the same masked softmax.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32

#: smallest static prefix a call attends over; prefixes double from here to the cache size.
LIVE_BLOCK = 16
#: at most this many prefix sizes (the largest): every size is one more branch per layer
#: to compile (compile time grew 1.5-4x with up to 7 of them on the SmolLM2 shapes).
MAX_LIVE_SIZES = 5
#: a prefix size gets its own branch only if one layer's keys and values over it (all
#: rows) take at least this many bytes. Skipping fewer bytes saves less than the
#: conditional costs (about 30 us per layer on this project's CPU, the time to read
#: ~0.7 MB), while every branch is compiled once per layer and call site: on the SmolLM2
#: n-gram program five sizes made up more than half of the compile time.
MIN_LIVE_BYTES = 1 << 19


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] (float64), scaled as `scaling` (a
    `RopeScaling`) says: Llama 3.1's (Hugging Face's "llama3" rope type) or linear
    (every frequency divided by the factor, "linear")."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq
    s = scaling
    if s.kind == "linear":
        return inv_freq / s.factor
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = s.original_max_position / s.low_freq_factor  # longer: divided by factor
    high_wavelen = s.original_max_position / s.high_freq_factor  # shorter: kept
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(between, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling=None) -> jax.Array:
    """Rotary embedding, HF "rotate_half" convention.

    Args:
        x: [B, T, N, hd] queries or keys.
        positions: [B, T] int32 absolute positions.
        theta: base frequency.
        scaling: a `RopeScaling` (Llama 3.1), or None.
    """
    hd = x.shape[-1]
    inv_freq = rope_frequencies(hd, theta, scaling)  # [hd/2]
    angles = positions.astype(_F32)[..., None] * inv_freq.astype(np.float32)  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(_F32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def heads_first(x: jax.Array) -> jax.Array:
    """[B, T, K, hd] -> [B, K, T, hd]."""
    return x.transpose(0, 2, 1, 3)


KERNELS = ("einsum", "xla", "cudnn")


def kernel() -> str:
    """The attention kernel: "xla" (`jax.nn.dot_product_attention`, its XLA
    implementation) on GPU, "einsum" (the formulation below) elsewhere; "cudnn" asks
    `jax.nn.dot_product_attention` for cuDNN and falls back to "xla" where cuDNN refuses
    the call while tracing. cuDNN is not the GPU default because no GPU has run it here
    (scripts/device_bench.py times all three). The environment variable
    JAX_SPECDEC_ATTENTION overrides the choice (read at trace time)."""
    chosen = os.environ.get("JAX_SPECDEC_ATTENTION")
    if chosen:
        if chosen not in KERNELS:
            raise ValueError(f"JAX_SPECDEC_ATTENTION must be one of {KERNELS}, got {chosen!r}")
        return chosen
    return "xla" if jax.default_backend() == "gpu" else "einsum"


def attention(q: jax.Array, parts, scale: float | None = None, softcap=None) -> jax.Array:
    """Softmax attention of q over the concatenation of several key/value parts.

    Args:
        q: [B, T, H, hd] queries.
        parts: sequence of (k [B, K, S_i, hd], v [B, K, S_i, hd], mask [B or 1, T or 1,
          S_i] bool); every query must see at least one position.
        scale: the scores' scale; None: 1 / sqrt(hd).
        softcap: scaled scores become softcap * tanh(score / softcap) before the mask
          (Gemma 2); None: no cap.

    Returns:
        [B, T, H, hd] float32.
    """
    B, T, H, hd = q.shape
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    if kernel() != "einsum" and softcap is None:  # jax.nn's attention has no cap
        return _dot_product_attention(q, parts, kernel(), scale)
    K = parts[0][0].shape[1]
    q = q.reshape(B, T, K, H // K, hd)
    # Scaled and capped before the mask, all parts at once: masking each part first
    # would make an empty part (a prefill's cache) a constant that XLA folds, for
    # minutes at 10^5 rows, where the softmax reduces it.
    scores = jnp.concatenate([_scores(q, k) for k, _, _ in parts], axis=-1) * np.float32(scale)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = jnp.concatenate([jnp.broadcast_to(m, (B, T, m.shape[-1])) for _, _, m in parts], -1)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # float32 softmax
    out, start = 0.0, 0
    for _, v, mask in parts:
        p = probs[..., start : start + mask.shape[-1]].astype(v.dtype)
        start += mask.shape[-1]
        # Like HF, probabilities are cast to the value dtype for this product (XLA:CPU
        # also has no bf16 x bf16 -> f32 kernel for it).
        out = out + _weighted(p, v)
    return out.reshape(B, T, H, hd)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, T, K, G, hd] . k [B, K, S, hd] -> [B, K, G, T, S] float32."""
    return jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=_F32)


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B, K, G, T, S] . v [B, K, S, hd] -> [B, T, K, G, hd] float32.

    The product is taken in [B, K, G, T, hd] order and transposed after: asked for
    [B, T, K, G, hd] directly, XLA:CPU computed v^T p^T with a slow batched dot
    (4.4x slower attention at batch 8, context 512; scripts/experiments/step_cost)."""
    out = jnp.einsum("bkgts,bksd->bkgtd", p, v).astype(_F32)
    return out.transpose(0, 3, 1, 2, 4)


def _dot_product_attention(q: jax.Array, parts, implementation: str, scale) -> jax.Array:
    """`attention` through `jax.nn.dot_product_attention` (keys concatenated, positions
    before heads as it wants them)."""
    B, T, _, _ = q.shape
    k = jnp.concatenate([heads_first(k) for k, _, _ in parts], axis=1).astype(q.dtype)
    v = jnp.concatenate([heads_first(v) for _, v, _ in parts], axis=1).astype(q.dtype)
    mask = jnp.concatenate([jnp.broadcast_to(m, (B, T, m.shape[-1])) for _, _, m in parts], axis=-1)
    call = functools.partial(
        jax.nn.dot_product_attention, q, k, v, mask=mask[:, None], scale=float(scale)
    )
    if implementation == "cudnn":
        try:
            return call(implementation="cudnn").astype(_F32)
        except (ValueError, NotImplementedError, TypeError, RuntimeError):
            pass  # e.g. float32, a head size or mask cuDNN does not take
    return call(implementation="xla").astype(_F32)


def live_sizes(
    max_len: int, block: int | None = None, *, position_bytes: int = 0
) -> tuple[int, ...]:
    """The static prefix sizes a cache of `max_len` positions is attended over:
    block, 2 block, 4 block, ... below max_len, then max_len; only the largest
    `MAX_LIVE_SIZES` of them, and none whose keys and values take fewer than
    `MIN_LIVE_BYTES` when one position of them takes `position_bytes` (0: no such
    floor). A small cache is thus attended whole, with no conditional at all."""
    block = LIVE_BLOCK if block is None else block
    smallest = -(-MIN_LIVE_BYTES // position_bytes) if position_bytes > 0 else 0
    sizes, size = [], block
    while size < max_len:
        if size >= smallest:
            sizes.append(size)
        size *= 2
    return (*sizes, max_len)[-MAX_LIVE_SIZES:]


def position_bytes(k_cache: jax.Array) -> int:
    """Bytes of one position's keys and values in one layer, over all rows, for a
    cache array [B, K, S, hd]."""
    B, K, _, hd = k_cache.shape
    return 2 * B * K * hd * k_cache.dtype.itemsize


def live_index(lengths: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """Index of the smallest size in `sizes` that holds every row's `lengths`."""
    longest = jnp.max(lengths.astype(jnp.int32))
    return jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < longest).astype(jnp.int32)


def in_window(query_positions: jax.Array, key_positions: jax.Array, window: int) -> jax.Array:
    """[B, T, S] bool: whether each key's position lies in (p - window, p] for each
    query's position p; query_positions [B, T], key_positions [B or 1, S] int32. A local
    layer's masks are ANDed with it, whoever builds them (prefill, chains, trees, slots:
    a tree node's position is its prefix's length plus its depth, so the rule is that of
    the path it ends)."""
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    return (k <= q) & (k > q - window)


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    others,
    sizes: tuple[int, ...],
    index: jax.Array,
    *,
    window: tuple[jax.Array, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """`attention` over row b's first lengths[b] cache positions plus `others`.

    Args:
        q: [B, T, H, hd] queries.
        k_cache, v_cache: [B, K, S, hd], only read.
        lengths: [B] int32, the cache's live positions per row.
        others: further parts, as in `attention` (e.g. the call's own keys).
        sizes, index: from `live_sizes(S)` and `live_index(lengths, sizes)`: the
          branch that attends over the first sizes[index] positions.
        window: (the queries' positions [B, T], W) for a local layer: the cache's
          positions outside `in_window` are masked too (`others` carry their own).
        scale, softcap: as in `attention`.

    Returns:
        [B, T, H, hd] float32.
    """

    def prefix(size, q, k_cache, v_cache, lengths, others, query_positions):
        k = jax.lax.slice_in_dim(k_cache, 0, size, axis=2)
        v = jax.lax.slice_in_dim(v_cache, 0, size, axis=2)
        at = jnp.arange(size, dtype=jnp.int32)[None, :]
        mask = (at < lengths[:, None])[:, None]
        if window is not None:
            mask = mask & in_window(query_positions, at, window[1])
        return attention(q, [(k, v, mask), *others], scale, softcap)

    positions = None if window is None else window[0]
    if len(sizes) == 1:
        return prefix(sizes[0], q, k_cache, v_cache, lengths, others, positions)
    branches = [functools.partial(prefix, size) for size in sizes]
    args = (q, k_cache, v_cache, lengths, list(others), positions)
    return jax.lax.switch(index, branches, *args)
