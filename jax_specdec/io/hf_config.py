"""Hugging Face `config.json` <-> `TransformerConfig`.

`config_from_hf` reads LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM, GPT2LMHeadModel and the Gemma configs (Gemma2ForCausalLM,
Gemma3ForCausalLM and the text model of Gemma3ForConditionalGeneration, in
`io.hf_gemma`) by `architectures`, or by `model_type` when `architectures` is missing
or null, as transformers does; `config_to_hf` writes the inverse.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jax_specdec.io.hf_fields import need, rope_from_hf, rope_to_hf
from jax_specdec.io.hf_gemma import gemma_from_hf, gemma_to_hf, is_gemma
from jax_specdec.nn import TransformerConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "GPT2LMHeadModel",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
# model_type -> architecture, for configs without `architectures` (GGUF-loaded ones).
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}

# --------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any], *, dtype: str | None = None) -> TransformerConfig:
    """Our `TransformerConfig` for a Hugging Face `config.json` dictionary.

    Args:
        hf: the parsed config.json.
        dtype: "float32" or "bfloat16" for parameters and activations; None:
            `default_dtype` of the checkpoint's stored dtype.
    """
    arch = architecture(hf)
    if dtype is None:
        dtype = default_dtype(hf.get("dtype") or hf.get("torch_dtype"))
    dtype = dtype_name(dtype)
    if arch == "GPT2LMHeadModel":
        return _gpt2_from_hf(hf, dtype)
    if arch.startswith("Gemma"):
        return gemma_from_hf(hf, arch, dtype)
    return _llama_from_hf(hf, arch, dtype)


def _per_head(d, heads):
    """d // heads; a heads that is no positive integer goes on to the config's own check,
    which names the field."""
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (d, heads))
    return d // heads if ints and heads > 0 else heads


def _gpt2_from_hf(hf: dict[str, Any], dtype: str) -> TransformerConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise ValueError(
            f"GPT-2 activation_function {act!r} is not supported (only the tanh GELU: "
            "gelu_new, gelu_pytorch_tanh)"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ValueError(f"GPT-2 option {flag}=true is not supported")
    if hf.get("scale_attn_weights", True) is False:
        raise ValueError("GPT-2 option scale_attn_weights=false is not supported")
    need_ = lambda key: need(hf, key, "GPT2LMHeadModel")  # noqa: E731
    d, heads = need_("n_embd"), need_("n_head")
    return TransformerConfig.gpt2(
        vocab_size=need_("vocab_size"),
        d_model=d,
        num_layers=need_("n_layer"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=_per_head(d, heads),
        mlp_dim=hf.get("n_inner") or 4 * d,
        max_len=need_("n_positions"),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dtype=dtype,
        param_dtype=dtype,
    )


def _llama_from_hf(hf: dict[str, Any], arch: str, dtype: str) -> TransformerConfig:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{arch} hidden_act {act!r} is not supported (only silu)")
    need_ = lambda key: need(hf, key, arch)  # noqa: E731
    d, heads = need_("hidden_size"), need_("num_attention_heads")
    theta, scaling = rope_from_hf(hf, arch)
    qwen3 = arch == "Qwen3ForCausalLM"
    if arch == "Qwen2ForCausalLM":
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:  # Qwen3's attention_bias covers o_proj too, as Llama's; its MLP has none
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False)) and not qwen3
    # transformers' Qwen3Config has head_dim 128 whatever the width, when it names none.
    head_dim = hf.get("head_dim") or (128 if qwen3 else _per_head(d, heads))
    return TransformerConfig.llama(
        vocab_size=need_("vocab_size"),
        d_model=d,
        num_layers=need_("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        mlp_dim=need_("intermediate_size"),
        max_len=_max_len(hf, arch, need_("max_position_embeddings")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        qk_norm=qwen3,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=dtype,
    )


def _max_len(hf: dict[str, Any], arch: str, max_len: int) -> int:
    """Sliding-window attention equals full attention up to the window: cap the context."""
    window = hf.get("sliding_window")
    uses_window = {
        "MistralForCausalLM": window is not None,
        "Qwen2ForCausalLM": bool(hf.get("use_sliding_window"))
        or "sliding_attention" in (hf.get("layer_types") or ()),
        "Qwen3ForCausalLM": _qwen3_window(hf),
    }.get(arch, False)
    return min(max_len, int(window)) if uses_window and window else max_len


def _qwen3_window(hf: dict[str, Any]) -> bool:
    """Whether a Qwen3 layer attends through a window, as transformers decides: only with
    use_sliding_window, in the layers `layer_types` calls "sliding_attention" (without
    it, the layers from max_window_layers on)."""
    if not hf.get("use_sliding_window"):
        return False
    types = hf.get("layer_types")
    if types:
        return "sliding_attention" in types
    first, layers = hf.get("max_window_layers", 28), hf.get("num_hidden_layers")
    if isinstance(first, int) and isinstance(layers, int):
        return first < layers
    return True  # unreadable: capped, which is exact either way


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` dictionary for one of our configs.

    Llama-style models export as LlamaForCausalLM (Qwen2ForCausalLM when only q/k/v
    have biases, Qwen3ForCausalLM with q/k norms); GPT-2-style ones as GPT2LMHeadModel;
    Gemma-style ones (`io.hf_gemma`) as Gemma2ForCausalLM, or Gemma3ForCausalLM with q/k
    norms. Other combinations raise ValueError.
    """
    c = config
    if is_gemma(c):
        return gemma_to_hf(c)
    if c.norm == "layer" and c.position == "learned" and c.mlp == "gelu":
        if c.qk_norm:
            raise ValueError("GPT-2 export has no q/k norms: qk_norm must be false")
        return _gpt2_to_hf(c)
    if not (c.norm == "rms" and c.position == "rope" and c.mlp == "swiglu"):
        raise ValueError(
            "only Llama-style (norm='rms', position='rope', mlp='swiglu') or GPT-2-style "
            "(norm='layer', position='learned', mlp='gelu') configs can be exported, got "
            f"norm={c.norm!r}, position={c.position!r}, mlp={c.mlp!r}"
        )
    return _llama_to_hf(c)


def _gpt2_to_hf(c: TransformerConfig) -> dict[str, Any]:
    if not (c.qkv_bias and c.out_bias and c.mlp_bias):
        raise ValueError("GPT-2 export needs qkv_bias, out_bias and mlp_bias all true")
    if c.num_kv_heads != c.num_heads or c.head_dim * c.num_heads != c.d_model:
        raise ValueError(
            "GPT-2 export needs num_kv_heads == num_heads and head_dim * num_heads == d_model"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_embd": c.d_model,
        "n_layer": c.num_layers,
        "n_head": c.num_heads,
        "n_inner": c.mlp_dim,
        "n_positions": c.max_len,
        "n_ctx": c.max_len,
        "layer_norm_epsilon": c.norm_eps,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": c.tie_embeddings,
        "dtype": c.param_dtype,
    }


def _llama_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """LlamaForCausalLM; Qwen2ForCausalLM when only q/k/v have biases; Qwen3ForCausalLM
    with q/k norms."""
    common = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.mlp_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_len,
        "rms_norm_eps": c.norm_eps,
        **rope_to_hf(c),
        "hidden_act": "silu",
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": c.param_dtype,
    }
    if c.qk_norm:
        return _qwen3_to_hf(c, common)
    if c.qkv_bias and not c.out_bias and not c.mlp_bias:
        if c.head_dim * c.num_heads != c.d_model:
            raise ValueError("Qwen2 export needs head_dim * num_heads == d_model")
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": None,
            **common,
        }
    if c.qkv_bias != c.out_bias:
        raise ValueError(
            "Llama export needs qkv_bias == out_bias (HF attention_bias covers both); "
            "qkv_bias without out_bias exports as Qwen2 only without mlp_bias"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": c.qkv_bias,
        "mlp_bias": c.mlp_bias,
        **common,
    }


def _qwen3_to_hf(c: TransformerConfig, common: dict[str, Any]) -> dict[str, Any]:
    if c.mlp_bias or c.qkv_bias != c.out_bias:
        raise ValueError(
            "Qwen3 export (qk_norm) needs mlp_bias false and qkv_bias == out_bias "
            "(HF attention_bias covers both)"
        )
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": c.qkv_bias,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c.num_layers,
        **common,
    }


# Mixture-of-experts families without "Moe" in their class name (refused by name).
MIXTURES_OF_EXPERTS = ("MixtralForCausalLM", "DeepseekV3ForCausalLM", "DbrxForCausalLM")


def architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs:
        # transformers picks the class from model_type when architectures is absent or
        # null (it writes null for GGUF-loaded models).
        model_type = hf.get("model_type")
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        raise ValueError(
            f"config.json has no architectures and an unsupported model_type {model_type!r}; "
            f"supported model types: {', '.join(_BY_MODEL_TYPE)}"
        )
    moe = [a for a in archs if "Moe" in a or a in MIXTURES_OF_EXPERTS]
    if moe:
        raise ValueError(
            f"config.json: {moe[0]} is a mixture-of-experts model, not supported yet "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    raise ValueError(
        f"unsupported architectures {archs!r} in config.json; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def default_dtype(stored: str | None = None) -> str:
    """The dtype a model loads in when none is asked for: bfloat16 on an accelerator
    (GPU, TPU); on the CPU, bfloat16 for a checkpoint stored in it, else float32. The
    logits, the acceptance rule and the sampling transforms compute in float32 whatever
    the model's dtype."""
    import jax

    if jax.default_backend() != "cpu" or stored == "bfloat16":
        return "bfloat16"
    return "float32"


def dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return name
