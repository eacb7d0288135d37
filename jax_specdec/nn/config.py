"""`TransformerConfig`: one frozen, hashable description of a decoder-only transformer.

Two families share one model: Llama-style (RMSNorm, rotary positions, SwiGLU,
grouped-query attention, optional q/k/v bias as in Qwen2, optional per-head q/k norms
as in Qwen3) and GPT-2-style
(LayerNorm, learned positions, tanh-GELU MLP, biases everywhere).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16")
_PARAM_DTYPES = (*_DTYPES, "float16")
_NORMS = ("rms", "layer")
_POSITIONS = ("rope", "learned")
_MLPS = ("swiglu", "gelu")


def _per_head(base: dict[str, Any]):
    """d_model // num_heads, the default head_dim; for a num_heads that is no positive
    integer it is left to the config's own check, which names the field."""
    heads = base["num_heads"]
    return base["d_model"] // heads if isinstance(heads, int) and heads > 0 else heads


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face `rope_type: "llama3"`).

    A frequency whose wavelength is longer than `original_max_position /
    low_freq_factor` is divided by `factor`, one shorter than `original_max_position /
    high_freq_factor` kept, and those between interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RopeScaling.{name} must be a finite number > 0, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        m = self.original_max_position
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(
                f"RopeScaling.original_max_position must be an integer >= 1, got {m!r}"
            )


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape and flavour of a decoder-only transformer.

    Frozen and hashable, so it can be a static argument of `jax.jit`.

    Attributes:
        vocab_size: number of token ids; inputs must lie in [0, vocab_size).
        d_model: width of the residual stream.
        num_layers: number of transformer blocks.
        num_heads: query heads per layer.
        num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
        head_dim: width of one head (need not equal d_model // num_heads).
        mlp_dim: hidden width of the MLP.
        max_len: largest number of positions the model accepts (caches included).
        norm: "rms" (RMSNorm, scale only) or "layer" (LayerNorm, scale and bias).
        norm_eps: epsilon added to the variance in every norm.
        position: "rope" (rotary, HF rotate_half convention) or "learned".
        rope_theta: rotary base frequency (used when position == "rope").
        rope_scaling: Llama 3.1's frequency scaling (`RopeScaling`), or None.
        mlp: "swiglu" (down(silu(gate(x)) * up(x))) or "gelu" (tanh approximation).
        qkv_bias: bias on the q, k and v projections.
        out_bias: bias on the attention output projection.
        mlp_bias: bias on the MLP projections.
        qk_norm: a norm (of kind `norm`, over head_dim, its own scale [head_dim]) on each
            query and key head before the rotary embedding, as in Qwen3.
        tie_embeddings: the output head reuses the token embedding matrix.
        dtype: activation dtype, "float32" or "bfloat16". Logits are always float32.
        param_dtype: parameter storage dtype, "float32", "bfloat16" or "float16". With
            float32 activations on CPU, 16-bit weights are widened inside the products
            (jax_specdec/kernels/cpu_matmul.py): half the bytes read, the same results as
            those weights stored as float32.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_len: int = 2048
    norm: str = "rms"
    norm_eps: float = 1e-6
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: str = "swiglu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
            "max_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_kv_heads ({self.num_kv_heads}) must divide "
                f"num_heads ({self.num_heads})"
            )
        if self.head_dim % 2 and self.position == "rope":
            raise ValueError(
                f"TransformerConfig.head_dim must be even for rotary positions, got {self.head_dim}"
            )
        for name, allowed in (
            ("norm", _NORMS),
            ("position", _POSITIONS),
            ("mlp", _MLPS),
            ("dtype", _DTYPES),
            ("param_dtype", _PARAM_DTYPES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"TransformerConfig.{name} must be one of {allowed}, got {value!r}"
                )
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"TransformerConfig.{name} must be a finite number > 0, got {value!r}"
                )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"TransformerConfig.rope_scaling must be a RopeScaling or None, "
                f"got {self.rope_scaling!r}"
            )
        for name in ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransformerConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )

    # ----------------------------------------------------------------- derived

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """Activation dtype as a `jnp.dtype`."""
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        """Parameter dtype as a `jnp.dtype`."""
        return jnp.dtype(self.param_dtype)

    def replace(self, **overrides: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **overrides)

    # --------------------------------------------------------------- json I/O

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Inverse of `to_dict`; unknown keys raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {unknown}")
        scaling = data.get("rope_scaling")
        if isinstance(scaling, dict):
            data = {**data, "rope_scaling": RopeScaling(**scaling)}
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    # ---------------------------------------------------------------- presets

    @classmethod
    def llama(cls, **overrides: Any) -> TransformerConfig:
        """Llama-style defaults (RMSNorm, RoPE, SwiGLU, no biases); override any field.

        Defaults to a small model (d_model 256, 4 layers); `head_dim` defaults to
        d_model // num_heads and `num_kv_heads` to num_heads when not given.
        """
        base = {**_FAMILIES["llama"]}
        base.update(overrides)
        base.setdefault("num_kv_heads", base["num_heads"])
        base.setdefault("head_dim", _per_head(base))
        return cls(**base)

    @classmethod
    def gpt2(cls, **overrides: Any) -> TransformerConfig:
        """GPT-2-style defaults (LayerNorm, learned positions, GELU, biases, tied head).

        Without overrides this is GPT-2 small (124M). `mlp_dim` defaults to 4 * d_model.
        """
        base = {**_FAMILIES["gpt2"]}
        base.update(overrides)
        base.setdefault("num_kv_heads", base["num_heads"])
        base.setdefault("head_dim", _per_head(base))
        base.setdefault("mlp_dim", 4 * base["d_model"])
        return cls(**base)

    @classmethod
    def tiny(cls, **overrides: Any) -> TransformerConfig:
        """A Llama-style model small enough for unit tests on a CPU (~30k parameters)."""
        return cls.llama(**{**_LLAMA_PRESETS["tiny"], **overrides})

    @classmethod
    def bench_target(cls, **overrides: Any) -> TransformerConfig:
        """The benchmark target (docs/performance.md): d=512, 8 layers, 8 heads, MLP 2048,
        vocab 4096."""
        return cls.llama(**{**_LLAMA_PRESETS["bench_target"], **overrides})

    @classmethod
    def bench_draft(cls, **overrides: Any) -> TransformerConfig:
        """The benchmark draft paired with `bench_target`: d=128, 2 layers, vocab 4096."""
        return cls.llama(**{**_LLAMA_PRESETS["bench_draft"], **overrides})


# fmt: off
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, d_model=256, num_layers=4, num_heads=8, mlp_dim=688,
                  max_len=2048, norm="rms", norm_eps=1e-6, position="rope", rope_theta=10000.0,
                  mlp="swiglu", qkv_bias=False, out_bias=False, mlp_bias=False,
                  tie_embeddings=False),
    "gpt2": dict(vocab_size=50257, d_model=768, num_layers=12, num_heads=12, max_len=1024,
                 norm="layer", norm_eps=1e-5, position="learned", mlp="gelu", qkv_bias=True,
                 out_bias=True, mlp_bias=True, tie_embeddings=True),
}
_LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, mlp_dim=64, max_len=128),
    "bench_target": dict(vocab_size=4096, d_model=512, num_layers=8, num_heads=8, mlp_dim=2048,
                         max_len=2048),
    "bench_draft": dict(vocab_size=4096, d_model=128, num_layers=2, num_heads=4, mlp_dim=512,
                        max_len=2048, tie_embeddings=True),
}
# fmt: on
