"""Fields of a Hugging Face `config.json` that several architectures read alike: a
required field, and the rotary embedding's dictionaries (rope_parameters as
transformers >= 5 writes them, rope_theta and rope_scaling as older versions did)."""

from __future__ import annotations

from typing import Any

from jax_specdec.nn import TransformerConfig
from jax_specdec.nn.config import RopeScaling

__all__ = [
    "need",
    "rope_from_hf",
    "rope_parameters",
    "rope_scaling_from",
    "rope_to_hf",
    "rope_type",
]


def need(hf: dict[str, Any], key: str, arch: str, where: str = ""):
    """hf[key], or one line naming the field (`where` prefixes it: "text_config.")."""
    if key not in hf:
        raise ValueError(f"config.json for {arch} lacks the field {where + key!r}")
    return hf[key]


def rope_from_hf(hf: dict[str, Any], arch: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling): transformers >= 5 writes rope_parameters, older versions
    rope_theta and rope_scaling. The default rotary embedding, "linear" and Llama 3.1's
    "llama3" scaling are read; any other type is refused."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type(params) != "default":
        return theta, rope_scaling_from(params, arch, "rope_parameters")
    return theta, rope_scaling_from(legacy, arch, "rope_scaling")


def rope_scaling_from(spec: dict[str, Any], arch: str, where: str) -> RopeScaling | None:
    """The `RopeScaling` of one rope dictionary (None for the default rotary embedding),
    or one line naming the field (`where`, e.g. "rope_parameters")."""
    kind = rope_type(spec)
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"{arch} {where}.rope_type {kind!r} is not supported (the default rotary "
            "embedding, 'linear' and 'llama3' are)"
        )
    keys = ("factor",) if kind == "linear" else _LLAMA3_KEYS
    missing = [k for k in keys if k not in spec]
    if missing:
        raise ValueError(f"{arch} {where}: rope type {kind!r} lacks {', '.join(missing)}")
    try:
        if kind == "linear":
            return RopeScaling(factor=float(spec["factor"]), kind="linear")
        return RopeScaling(
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position=int(spec["original_max_position_embeddings"]),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{arch} {where}: rope type {kind!r}: {e}") from None


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_type(spec: dict[str, Any]) -> str:
    return spec.get("rope_type", spec.get("type", "default"))


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """One rope dictionary as transformers >= 5 writes it (rope_type, rope_theta and the
    scaling's own fields)."""
    return {**_scaling_to_hf(scaling), "rope_theta": theta}


def _scaling_to_hf(s: RopeScaling | None) -> dict[str, Any]:
    if s is None:
        return {"rope_type": "default"}
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position,
    }


def rope_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """rope_theta, rope_parameters (transformers >= 5) and, when scaled, rope_scaling."""
    params = rope_parameters(c.rope_theta, c.rope_scaling)
    out = {"rope_theta": c.rope_theta, "rope_parameters": params}
    return (
        out if c.rope_scaling is None else {**out, "rope_scaling": _scaling_to_hf(c.rope_scaling)}
    )
