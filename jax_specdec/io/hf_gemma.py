"""Gemma 2 and Gemma 3 `config.json` <-> `TransformerConfig`.

Read: Gemma2ForCausalLM (model_type gemma2), Gemma3ForCausalLM (gemma3_text) and the
text model of Gemma3ForConditionalGeneration (gemma3: its `text_config`; the vision
tower is not read). A field config.json leaves out takes transformers' default for the
class (Gemma2Config, Gemma3TextConfig), as transformers would. Written: Gemma2ForCausalLM,
or Gemma3ForCausalLM for a config with q/k norms.

The switches: embeddings scaled by sqrt(hidden_size), (1 + w) RMSNorms, four norms a
layer, GeGLU with the tanh GELU, scores scaled by query_pre_attn_scalar^-1/2,
soft-capped attention scores and logits (Gemma 2; transformers applies neither of
Gemma 3's attn_logit_softcapping, nor the final cap in Gemma3ForConditionalGeneration,
so a config that sets them is refused), and local layers ("sliding_attention") that see
only the last sliding_window positions, with a rotary base of their own in Gemma 3
(its global layers take the rope scaling).
"""

from __future__ import annotations

from typing import Any

from jax_specdec.io.hf_fields import need, rope_from_hf, rope_parameters, rope_scaling_from
from jax_specdec.nn import TransformerConfig

__all__ = ["gemma_from_hf", "gemma_to_hf", "is_gemma"]

# transformers' defaults for the fields a config.json may leave out.
_DEFAULTS = {
    "Gemma2ForCausalLM": dict(
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    ),
    "Gemma3ForCausalLM": dict(
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    ),
}  # fmt: skip
_DEFAULTS["Gemma3ForConditionalGeneration"] = _DEFAULTS["Gemma3ForCausalLM"]
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # the tanh GELU
_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_from_hf(hf: dict[str, Any], arch: str, dtype: str) -> TransformerConfig:
    """Our config for a Gemma 2 / Gemma 3 config.json (the text model of a
    Gemma3ForConditionalGeneration one); `dtype` as `config_from_hf` decided it."""
    text, where = hf, ""
    if arch == "Gemma3ForConditionalGeneration":
        text, where = need(hf, "text_config", arch), "text_config."
        if not isinstance(text, dict):
            raise ValueError(f"config.json for {arch}: text_config must be an object")
    defaults = _DEFAULTS[arch]
    get = lambda key: text.get(key, defaults.get(key))  # noqa: E731
    need_ = lambda key: need(text, key, arch, where)  # noqa: E731
    gemma3 = arch != "Gemma2ForCausalLM"
    _refuse(text, arch, where, gemma3)
    layers = need_("num_hidden_layers")
    local = _local_layers(text, arch, where, layers, gemma3)
    window = get("sliding_window") if local else None
    if local and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"{arch} {where}sliding_window must be an integer >= 1 when layers are "
            f"sliding_attention, got {window!r}"
        )
    theta, scaling, local_theta = _rope(text, arch, where, gemma3)
    bias = bool(text.get("attention_bias", False))
    final_cap = get("final_logit_softcapping")
    tie = (hf if where else text).get("tie_word_embeddings", True)
    return TransformerConfig.llama(
        vocab_size=need_("vocab_size"),
        d_model=need_("hidden_size"),
        num_layers=layers,
        num_heads=need_("num_attention_heads"),
        num_kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim"),
        mlp_dim=need_("intermediate_size"),
        max_len=get("max_position_embeddings"),
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        mlp="geglu",
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=gemma3,
        embed_scale=True,
        norm_plus_one=True,
        post_norms=True,
        query_pre_attn_scalar=_number(get("query_pre_attn_scalar")),
        attn_softcap=_number(get("attn_logit_softcapping")),
        final_softcap=_number(final_cap),
        sliding_window=window,
        local_layers=local,
        rope_local_theta=local_theta,
        tie_embeddings=bool(tie),
        dtype=dtype,
        param_dtype=dtype,
    )


def _number(value):
    """A float of a number (left as it is otherwise, for the config's check to name)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else value


def _refuse(text: dict[str, Any], arch: str, where: str, gemma3: bool) -> None:
    """One line for a setting transformers computes in a way this model does not."""
    act = text.get("hidden_activation", text.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"{arch} {where}hidden_activation {act!r} is not supported (only the tanh "
            f"GELU: {', '.join(_ACTIVATIONS)})"
        )
    if text.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} {where}use_bidirectional_attention=true is not supported")
    ignored = ["attn_logit_softcapping"] if gemma3 else []
    if arch == "Gemma3ForConditionalGeneration":
        ignored.append("final_logit_softcapping")
    for key in ignored:
        if text.get(key) is not None:
            raise ValueError(
                f"{arch} {where}{key} is set ({text[key]!r}) but transformers' {arch} "
                "does not apply it: refused rather than guessed"
            )


def _local_layers(text, arch, where, layers, gemma3) -> tuple[int, ...]:
    """The ids of the sliding_attention layers: `layer_types`, else Gemma 2's
    alternation (layers 0, 2, …) or Gemma 3's `sliding_window_pattern` (every n-th
    layer global, the others local; 6 by default)."""
    types = text.get("layer_types")
    if types is None:
        if not isinstance(layers, int) or isinstance(layers, bool):
            return ()  # the config's own check names num_hidden_layers
        if not gemma3:
            return tuple(range(0, layers, 2))
        n = text.get("sliding_window_pattern", text.get("_sliding_window_pattern", 6))
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"{arch} {where}sliding_window_pattern must be an integer >= 1, got {n!r}"
            )
        return tuple(i for i in range(layers) if (i + 1) % n)
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(
            f"{arch} {where}layer_types must be a list of num_hidden_layers ({layers}) "
            f"layer types, got {types!r}"
        )
    for i, kind in enumerate(types):
        if kind not in _LAYER_TYPES:
            raise ValueError(
                f"{arch} {where}layer_types[{i}] {kind!r} is not supported (only "
                f"{', '.join(_LAYER_TYPES)})"
            )
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _rope(text, arch, where, gemma3):
    """(global theta, global scaling, local theta or None). Gemma 2: one rotary
    embedding for every layer. Gemma 3: transformers >= 5 writes rope_parameters per
    layer type (full_attention, sliding_attention); older versions rope_theta (global,
    default 1e6), rope_local_base_freq (local, default 1e4) and rope_scaling (global)."""
    if not gemma3:
        theta, scaling = rope_from_hf(text, arch)
        return theta, scaling, None
    params = text.get("rope_parameters")
    if params is None:
        legacy = text.get("rope_scaling") or {}
        scaling = rope_scaling_from(legacy, arch, where + "rope_scaling")
        theta = float(text.get("rope_theta", 1e6))
        return theta, scaling, float(text.get("rope_local_base_freq", 1e4))
    if not isinstance(params, dict) or set(params) - set(_LAYER_TYPES):
        raise ValueError(
            f"{arch} {where}rope_parameters must map full_attention and sliding_attention "
            f"to their rope parameters, got {params!r}"
        )
    # As transformers: a legacy rope_scaling updates the global layers' parameters.
    full = {**(params.get("full_attention") or {}), **(text.get("rope_scaling") or {})}
    local = params.get("sliding_attention") or {}
    scaling = rope_scaling_from(full, arch, where + "rope_parameters.full_attention")
    own = where + "rope_parameters.sliding_attention"
    if rope_scaling_from(local, arch, own) is not None:
        raise ValueError(f"{arch} {own}: only the default rotary embedding is supported")
    theta = float(full.get("rope_theta", text.get("rope_theta", 1e6)))
    return theta, scaling, float(local.get("rope_theta", text.get("rope_local_base_freq", 1e4)))


# ------------------------------------------------------------------------- export


def is_gemma(c: TransformerConfig) -> bool:
    """Whether any Gemma switch is on (then only a Gemma export fits)."""
    flags = (c.embed_scale, c.norm_plus_one, c.post_norms, c.mlp == "geglu")
    optional = (c.query_pre_attn_scalar, c.attn_softcap, c.final_softcap, c.sliding_window)
    return any(flags) or any(x is not None for x in (*optional, c.rope_local_theta))


def gemma_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """Gemma2ForCausalLM, or Gemma3ForCausalLM with q/k norms; ValueError for a config
    that mixes Gemma's switches with others transformers' Gemma has no room for."""
    needs = dict(
        norm=c.norm == "rms", position=c.position == "rope", mlp=c.mlp == "geglu",
        embed_scale=c.embed_scale, norm_plus_one=c.norm_plus_one, post_norms=c.post_norms,
        mlp_bias=not c.mlp_bias, qkv_bias=c.qkv_bias == c.out_bias,
    )  # fmt: skip
    wrong = [name for name, ok in needs.items() if not ok]
    if wrong:
        raise ValueError(
            "Gemma export needs norm='rms', position='rope', mlp='geglu', embed_scale, "
            "norm_plus_one and post_norms, no mlp_bias and qkv_bias == out_bias (HF "
            f"attention_bias covers both); wrong here: {', '.join(wrong)}"
        )
    gemma3 = c.qk_norm
    if gemma3 and c.attn_softcap is not None:
        raise ValueError(
            "Gemma 3 export (qk_norm) has no attention soft cap: attn_softcap must be None"
        )
    if not gemma3 and c.rope_local_theta is not None:
        raise ValueError(
            "Gemma 2 export (no qk_norm) has one rotary base: rope_local_theta must be None"
        )
    out = {
        "architectures": ["Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"],
        "model_type": "gemma3_text" if gemma3 else "gemma2",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.mlp_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_len,
        "rms_norm_eps": c.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": c.qkv_bias,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": _scalar(c),
        "attn_logit_softcapping": c.attn_softcap,
        "final_logit_softcapping": c.final_softcap,
        # A window no layer uses is still written: transformers builds its mask anyway.
        "sliding_window": c.sliding_window or c.max_len,
        "layer_types": [
            "sliding_attention" if c.is_local(i) else "full_attention" for i in range(c.num_layers)
        ],
        "tie_word_embeddings": c.tie_embeddings,
        "dtype": c.param_dtype,
    }
    full = rope_parameters(c.rope_theta, c.rope_scaling)
    if not gemma3:
        return {**out, "rope_parameters": full}
    local = full if c.rope_local_theta is None else rope_parameters(c.rope_local_theta, None)
    return {**out, "rope_parameters": {"full_attention": full, "sliding_attention": local}}


def _scalar(c: TransformerConfig) -> int:
    """query_pre_attn_scalar as transformers' Gemma configs hold it: an integer."""
    value = c.head_dim if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar
    if value != int(value):
        raise ValueError(f"Gemma export needs an integer query_pre_attn_scalar, got {value!r}")
    return int(value)
