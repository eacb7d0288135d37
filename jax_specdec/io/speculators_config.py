"""The `config.json` of an EAGLE-3 head: read from the `speculators` format or the original
release layout into an `Eagle3Config`, and written in the `speculators` format
(`io.speculators` reads and writes the weights beside it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jax_specdec.io.hf_config import config_from_hf, config_to_hf
from jax_specdec.nn.config import TransformerConfig
from jax_specdec.nn.eagle3 import Eagle3Config

__all__ = [
    "CONFIG",
    "config_dict",
    "config_json",
    "is_eagle3_release",
    "is_speculators",
    "release_config",
    "speculators_config",
]

CONFIG = "config.json"
# transformers' class defaults, for the fields a config written by `to_diff_dict` omits.
_DEFAULTS = {
    "llama": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
    ),
    "qwen3": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
}  # fmt: skip


def config_json(path) -> dict[str, Any] | None:
    file = Path(path) / CONFIG
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def is_speculators(path: str | os.PathLike) -> bool:
    """A directory whose config.json names a `speculators_model_type`."""
    data = config_json(path)
    return isinstance(data, dict) and "speculators_model_type" in data


def is_eagle3_release(path: str | os.PathLike) -> bool:
    """A directory in the original EAGLE-3 release layout: an architecture named
    ...Eagle3 (e.g. LlamaForCausalLMEagle3), or a `draft_vocab_size` without
    `speculators_model_type`."""
    data = config_json(path)
    if not isinstance(data, dict) or "speculators_model_type" in data:
        return False
    archs = data.get("architectures") or []
    return any(str(a).endswith("Eagle3") for a in archs) or "draft_vocab_size" in data


# ------------------------------------------------------------------------- config


def _flag(data: dict[str, Any], name: str, where: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _layer_config(tl: dict[str, Any], where: str, dtype: str) -> tuple[TransformerConfig, str]:
    """The decoder layer's `TransformerConfig` and style from its Hugging Face config."""
    style = tl.get("model_type", "qwen3")  # speculators' default class is Qwen3Config
    if style not in _DEFAULTS:
        raise ValueError(
            f"{where}: model_type {style!r} is not supported (only {', '.join(_DEFAULTS)})"
        )
    if tl.get("use_sliding_window") or "sliding_attention" in (tl.get("layer_types") or ()):
        raise ValueError(f"{where}: sliding-window attention (use_sliding_window) is not supported")
    llama = {**_DEFAULTS[style], **tl, "model_type": "llama", "architectures": None}
    if style == "qwen3":
        llama["mlp_bias"] = False  # a Qwen3 MLP has no biases
    try:
        return config_from_hf(llama, dtype=dtype), style
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def _layer_ids(value, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of ints")
    return tuple(value)


def speculators_config(data: dict[str, Any], where: str, dtype: str) -> Eagle3Config:
    if data.get("speculators_model_type") != "eagle3":
        raise ValueError(
            f"{where}: speculators_model_type is {data.get('speculators_model_type')!r}; "
            "only 'eagle3' heads are read"
        )
    tl = data.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ValueError(f"{where}: transformer_layer_config is missing or not an object")
    layer, style = _layer_config(tl, f"{where} transformer_layer_config", dtype)
    spec = data.get("speculators_config") or {}
    verifier = spec.get("verifier") or {}
    methods = spec.get("proposal_methods") or [{}]
    return _eagle3_config(
        data,
        where,
        layer,
        style,
        verifier=verifier.get("name_or_path") or "",
        verifier_architectures=tuple(verifier.get("architectures") or ()),
        speculative_tokens=int(methods[0].get("speculative_tokens", 3)),
    )


def _eagle3_config(data, where, layer, style, **fields) -> Eagle3Config:
    ids = data.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(data.get("eagle_config"), dict):
        ids = data["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    try:
        return Eagle3Config(
            layer,
            data.get("draft_vocab_size", 32000),
            style=style,
            aux_layer_ids=_layer_ids(ids, where),
            target_hidden_size=data.get("target_hidden_size") or 0,
            **{
                flag: _flag(data, flag, where)
                for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
            },
            **fields,
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def release_config(data: dict[str, Any], where: str, dtype: str, vocab: int | None):
    """The release's Llama config; `vocab` (t2d's length, when present) is the target's."""
    tl = {k: v for k, v in data.items() if k not in ("architectures", "draft_vocab_size")}
    tl["model_type"] = "llama"
    if vocab is not None:
        tl["vocab_size"] = vocab
    layer, style = _layer_config(tl, where, dtype)
    return _eagle3_config(data, where, layer, style)


def config_dict(config: Eagle3Config) -> dict[str, Any]:
    layer = config_to_hf(config.layer)
    layer.pop("architectures")
    layer["model_type"] = config.style
    if config.style == "qwen3":
        layer.pop("mlp_bias", None)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids) or None,
        "target_hidden_size": config.target_hidden_size or None,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "tie_word_embeddings": False,
        "dtype": config.layer.param_dtype,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": config.verifier or None,
                "architectures": list(config.verifier_architectures),
            },
        },
    }
