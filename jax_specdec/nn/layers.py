"""The transformer's layers: dense projections, norms, attention's projections, the
MLP and the decoder block that holds them (`nn.transformer` stacks the blocks; the
feature and EAGLE-3 heads reuse them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_specdec.nn.attention import attention, rope
from jax_specdec.nn.config import TransformerConfig
from jax_specdec.nn.products import matmul

__all__ = ["Attention", "Block", "Dense", "Mlp", "Norm"]

_F32 = jnp.float32


class Dense(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (HF nn.Linear weights are transposed)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, config: TransformerConfig, key, scale):
        dtype = config.jnp_param_dtype
        self.kernel = nnx.Param(scale * jax.random.normal(key, (d_in, d_out), _F32).astype(dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.dtype = config.jnp_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x, self.kernel[...])  # a 16-bit kernel is widened in the product
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Norm(nnx.Module):
    """RMSNorm (scale only) or LayerNorm (scale and bias), computed in float32;
    `config.norm_plus_one`: an RMSNorm scaling by (1 + w), in float32 (Gemma)."""

    def __init__(self, config: TransformerConfig):
        dtype = config.jnp_param_dtype
        self.kind = config.norm
        self.eps = config.norm_eps
        self.dtype = config.jnp_dtype
        self.plus_one = config.norm_plus_one
        start = jnp.zeros if self.plus_one else jnp.ones  # the identity either way
        self.scale = nnx.Param(start((config.d_model,), dtype))
        self.bias = (
            nnx.Param(jnp.zeros((config.d_model,), dtype)) if config.norm == "layer" else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(_F32)
        if self.kind == "layer":
            h = h - jnp.mean(h, axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:  # Gemma's: scaled in float32, then cast back (as HF)
            return (h * (1.0 + self.scale[...].astype(_F32))).astype(self.dtype)
        # Like HF: normalise in float32, cast back, then apply the affine part.
        h = h.astype(self.dtype) * self.scale[...].astype(self.dtype)
        if self.bias is not None:
            h = h + self.bias[...].astype(self.dtype)
        return h


class Attention(nnx.Module):
    """Multi-head attention's projections. q, k and v read `d_in` inputs (default the
    model width; an EAGLE-3 head's first layer reads 2 × d_model); `qk_norm` adds
    per-head RMSNorms on q and k before the rotary embedding (a Qwen3 layer). `local`:
    a layer that attends through the sliding window (`window`, which its caller's masks
    apply), rotating with `config.rope_local_theta` when that is set. The scores' scale
    and soft cap come from the config (`query_pre_attn_scalar`, `attn_softcap`)."""

    def __init__(
        self, config: TransformerConfig, *, keys, scale, d_in=None, qk_norm=False, local=False
    ):
        c = config
        self.config = c
        d_in = c.d_model if d_in is None else d_in
        q_out, kv_out, b = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.qkv_bias
        self.q = Dense(d_in, q_out, bias=b, config=c, key=keys[0], scale=scale)
        self.k = Dense(d_in, kv_out, bias=b, config=c, key=keys[1], scale=scale)
        self.v = Dense(d_in, kv_out, bias=b, config=c, key=keys[2], scale=scale)
        self.o = Dense(q_out, c.d_model, bias=c.out_bias, config=c, key=keys[3], scale=scale)
        per_head = c.replace(d_model=c.head_dim)
        self.q_norm = Norm(per_head) if qk_norm else None
        self.k_norm = Norm(per_head) if qk_norm else None
        self.window = c.sliding_window if local else None
        own_rope = local and c.rope_local_theta is not None
        self.rope = (c.rope_local_theta, None) if own_rope else (c.rope_theta, c.rope_scaling)
        scalar = c.head_dim if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar
        self.score_scale, self.softcap = float(scalar) ** -0.5, c.attn_softcap

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, d_in] -> q [B, T, H, hd], k and v [B, T, K, hd] (positions applied)."""
        c = self.config
        B, T, _ = x.shape
        q = self.q(x).reshape(B, T, c.num_heads, c.head_dim)
        k = self.k(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = self.v(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.position == "rope":
            q, k = rope(q, positions, *self.rope), rope(k, positions, *self.rope)
        return q, k, v

    def output(self, attended: jax.Array) -> jax.Array:
        """[B, T, H, hd] float32 attention output -> [B, T, D] (output projection)."""
        B, T, H, hd = attended.shape
        return self.o(attended.reshape(B, T, H * hd).astype(self.config.jnp_dtype))

    def attend(self, q: jax.Array, parts) -> jax.Array:
        """Softmax attention of q over several key/value parts (see
        `attention.attention`), then the output projection: [B, T, D]."""
        return self.output(attention(q, parts, self.score_scale, self.softcap))


class Mlp(nnx.Module):
    """SwiGLU, GeGLU (the tanh GELU on the gate, as Gemma) or GPT-2's GELU MLP."""

    def __init__(self, config: TransformerConfig, *, keys, scale):
        c = config
        self.kind = c.mlp
        self.gate = (
            Dense(c.d_model, c.mlp_dim, bias=c.mlp_bias, config=c, key=keys[0], scale=scale)
            if c.mlp in ("swiglu", "geglu")
            else None
        )
        self.up = Dense(c.d_model, c.mlp_dim, bias=c.mlp_bias, config=c, key=keys[1], scale=scale)
        self.down = Dense(c.mlp_dim, c.d_model, bias=c.mlp_bias, config=c, key=keys[2], scale=scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kind == "swiglu":
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        if self.kind == "geglu":
            return self.down(jax.nn.gelu(self.gate(x), approximate=True) * self.up(x))
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


class Block(nnx.Module):
    """A decoder layer: attention and MLP, each behind its norm (`config.qk_norm` adds
    the per-head q/k norms of a Qwen3 layer, `config.post_norms` a norm after each, as
    Gemma); `local`: its attention goes through the sliding window."""

    def __init__(self, config: TransformerConfig, *, key, scale, local=False):
        keys = jax.random.split(key, 7)
        post = config.post_norms
        self.attn_norm = Norm(config)
        self.attn = Attention(
            config, keys=keys[:4], scale=scale, qk_norm=config.qk_norm, local=local
        )
        self.attn_post_norm = Norm(config) if post else None
        self.mlp_norm = Norm(config)
        self.mlp = Mlp(config, keys=keys[4:], scale=scale)
        self.mlp_post_norm = Norm(config) if post else None

    def attended(self, h: jax.Array) -> jax.Array:
        """The attention's output [B, T, D] as it joins the residual stream."""
        return h if self.attn_post_norm is None else self.attn_post_norm(h)

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """What the MLP adds to the residual stream x [B, T, D]."""
        h = self.mlp(self.mlp_norm(x))
        return h if self.mlp_post_norm is None else self.mlp_post_norm(h)
