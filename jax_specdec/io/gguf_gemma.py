"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2`, `gemma3`): their switches.

What the file states: the sizes, the window (`{arch}.attention.sliding_window`), the
soft caps of Gemma 2 (`{arch}.attn_logit_softcapping`, `{arch}.final_logit_softcapping`,
50 and 30 when absent, as llama.cpp), a linear rope scaling of Gemma 3's global layers,
and every norm weight stored as its multiplier 1 + w (llama.cpp's converter adds the 1,
`load_gguf_model` takes it off again). What llama.cpp decides without the file, done
the same here:

- the layer pattern: Gemma 2's even layers are local, Gemma 3's all but every sixth;
  `{arch}.attention.sliding_window_pattern` (an n, or one flag per layer) overrides it;
- Gemma 3's local rotary base: 10,000 (`{arch}.rope.freq_base_swa` overrides it);
- queries scaled by 1/sqrt(head_dim), except in the 27B models (46 layers for Gemma 2,
  62 for Gemma 3): 1/sqrt(hidden / heads), their `query_pre_attn_scalar`.

The tensors: `attn_norm`, `post_attention_norm`, `ffn_norm` (before the MLP: Gemma's
`pre_feedforward_layernorm`, not Llama's post-attention norm) and `post_ffw_norm`.
"""

from __future__ import annotations

from typing import Any

from jax_specdec.io.gguf_file import GGUFError, field
from jax_specdec.io.hf_fields import rope_scaling_from

__all__ = ["GEMMA", "LAYER_NAMES", "gemma_switches"]

GEMMA = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer global (llama.cpp's swa pattern)
_WIDE_QUERY_SCALE = {"gemma2": 46, "gemma3": 62}  # the 27B models' layer counts


def gemma_switches(reader, arch: str, d: int, heads: int, head_dim: int, layers: int):
    """The `TransformerConfig.llama` overrides of a gemma2/gemma3 file (see the module
    docstring), or one line naming the file and the key."""
    file = reader.data.filename
    window = field(reader, f"{arch}.attention.sliding_window", 4096)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise GGUFError(f"{file}: {arch}.attention.sliding_window must be >= 1, got {window!r}")
    gemma3 = arch == "gemma3"
    caps = {}
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        value = field(reader, f"{arch}.{key}", None)
        if gemma3 and value is not None:
            raise GGUFError(f"{file}: {arch}.{key} is set, but Gemma 3 applies no soft cap")
        caps[key] = None if gemma3 else float(default if value is None else value)
    wide = layers == _WIDE_QUERY_SCALE[arch]
    return dict(
        mlp="geglu",
        qk_norm=gemma3,
        embed_scale=True,
        norm_plus_one=True,
        post_norms=True,
        query_pre_attn_scalar=float(d // heads if wide else head_dim),
        attn_softcap=caps["attn_logit_softcapping"],
        final_softcap=caps["final_logit_softcapping"],
        sliding_window=window,
        local_layers=_local_layers(reader, arch, layers),
        rope_local_theta=float(field(reader, f"{arch}.rope.freq_base_swa", 1e4))
        if gemma3
        else None,
        rope_scaling=_rope_scaling(reader, arch) if gemma3 else None,
    )


def _local_layers(reader, arch: str, layers: int) -> tuple[int, ...]:
    file, key = reader.data.filename, f"{arch}.attention.sliding_window_pattern"
    pattern: Any = field(reader, key, _PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(x, bool) for x in pattern):
            raise GGUFError(f"{file}: {key} must be one flag per layer ({layers})")
        return tuple(i for i, local in enumerate(pattern) if local)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise GGUFError(f"{file}: {key} must be an integer >= 1, got {pattern!r}")
    return tuple(i for i in range(layers) if i % pattern < pattern - 1)


def _rope_scaling(reader, arch: str):
    """Gemma 3's global layers' scaling: linear (by {arch}.rope.scaling.factor) or none."""
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    factor = field(reader, f"{arch}.rope.scaling.factor", None)
    spec = {"rope_type": kind, **({} if factor is None else {"factor": factor})}
    try:
        return rope_scaling_from(spec, reader.data.filename, f"{arch}.rope.scaling")
    except ValueError as e:
        raise GGUFError(str(e)) from e
