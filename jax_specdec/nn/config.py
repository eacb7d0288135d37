"""`TransformerConfig`: one frozen, hashable description of a decoder-only transformer.

Two families share one model: Llama-style (RMSNorm, rotary positions, SwiGLU,
grouped-query attention, optional q/k/v bias as in Qwen2, optional per-head q/k norms
as in Qwen3) and GPT-2-style
(LayerNorm, learned positions, tanh-GELU MLP, biases everywhere). Gemma 2 and 3 are the
Llama style with a few more switches: scaled embeddings, (1 + w) norms, norms after
attention and the MLP, GeGLU, a query scale of its own, soft-capped logits, and local
layers that attend through a sliding window with a rotary base of their own.
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
_MLPS = ("swiglu", "geglu", "gelu")
_ROPE_KINDS = ("llama3", "linear")


def _per_head(base: dict[str, Any]):
    """d_model // num_heads, the default head_dim; for a num_heads that is no positive
    integer it is left to the config's own check, which names the field."""
    heads = base["num_heads"]
    return base["d_model"] // heads if isinstance(heads, int) and heads > 0 else heads


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A scaling of the rotary frequencies: Llama 3.1's (Hugging Face `rope_type:
    "llama3"`, the default kind) or linear (`rope_type: "linear"`, every frequency
    divided by `factor`, as Gemma 3's global layers).

    Llama 3.1's: a frequency whose wavelength is longer than `original_max_position /
    low_freq_factor` is divided by `factor`, one shorter than `original_max_position /
    high_freq_factor` kept, and those between interpolated smoothly. The linear kind
    takes only `factor` (the others None).
    """

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position: int | None = None
    kind: str = "llama3"

    def __post_init__(self):
        if self.kind not in _ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {_ROPE_KINDS}, got {self.kind!r}")
        llama3 = ("low_freq_factor", "high_freq_factor")
        for name in ("factor", *llama3) if self.kind == "llama3" else ("factor",):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RopeScaling.{name} must be a finite number > 0, got {value!r}")
        if self.kind == "linear":
            extra = [n for n in (*llama3, "original_max_position") if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"RopeScaling of kind 'linear' takes only factor, got {extra}")
            return
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
        mlp: "swiglu" (down(silu(gate(x)) * up(x))), "geglu" (down(gelu(gate(x)) * up(x)),
            the tanh GELU, as Gemma) or "gelu" (down(gelu(up(x))), tanh approximation).
        qkv_bias: bias on the q, k and v projections.
        out_bias: bias on the attention output projection.
        mlp_bias: bias on the MLP projections.
        qk_norm: a norm (of kind `norm`, over head_dim, its own scale [head_dim]) on each
            query and key head before the rotary embedding, as in Qwen3.
        embed_scale: token embeddings are multiplied by sqrt(d_model), in the embedding's
            dtype (Gemma).
        norm_plus_one: RMSNorms scale by (1 + w) rather than w, in float32 before the
            cast back (Gemma); their stored scale w starts at 0.
        post_norms: a norm after the attention and one after the MLP, before each is
            added to the residual stream (Gemma's four norms a layer).
        query_pre_attn_scalar: attention scores are scaled by 1 / sqrt(this) rather than
            1 / sqrt(head_dim) (Gemma); None: head_dim.
        attn_softcap: attention scores become cap * tanh(score / cap) before the mask
            (Gemma 2); None: no cap.
        final_softcap: logits become cap * tanh(logit / cap) (Gemma 2); None: no cap.
        sliding_window: W, the window of the local layers: there a query at position p
            sees the keys at positions p - W + 1 … p only. None when no layer is local.
        local_layers: the ids of the layers that attend through the window (sorted).
        rope_local_theta: the rotary base of the local layers, which then take no
            `rope_scaling` (Gemma 3); None: the local layers rotate as the others.
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
    embed_scale: bool = False
    norm_plus_one: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
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
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransformerConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        self._check_gemma_fields()

    def _check_gemma_fields(self):
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"TransformerConfig.{name} must be None or a finite number > 0, got {value!r}"
                )
        if self.norm_plus_one and self.norm != "rms":
            raise ValueError("TransformerConfig.norm_plus_one needs norm='rms'")
        w, layers = self.sliding_window, self.local_layers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(
                f"TransformerConfig.sliding_window must be None or an integer >= 1, got {w!r}"
            )
        if not isinstance(layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in layers
        ):
            raise ValueError(
                f"TransformerConfig.local_layers must be a tuple of layer ids, got {layers!r}"
            )
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"TransformerConfig.local_layers must be distinct sorted ids in "
                f"[0, {self.num_layers}), got {layers!r}"
            )
        if bool(layers) != (w is not None):
            raise ValueError(
                "TransformerConfig.sliding_window and local_layers go together: a window "
                f"needs local layers and local layers a window, got {w!r} and {layers!r}"
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

    def is_local(self, layer: int) -> bool:
        """Whether decoder layer `layer` attends through the sliding window."""
        return layer in self.local_layers

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
        if isinstance(data.get("local_layers"), list):  # JSON has no tuples
            data = {**data, "local_layers": tuple(data["local_layers"])}
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


_FLAGS = (
    "qkv_bias", "out_bias", "mlp_bias", "qk_norm", "embed_scale", "norm_plus_one", "post_norms",
    "tie_embeddings",
)  # fmt: skip

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
