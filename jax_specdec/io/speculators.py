"""EAGLE-3 heads in the `speculators` format (what vLLM reads speculator checkpoints in)
and in the original EAGLE-3 release layout, read as an `Eagle3Head`; heads written in
the `speculators` format.

A `speculators` directory: `config.json` with `speculators_model_type: "eagle3"`, the
decoder layer's Hugging Face config in `transformer_layer_config` (its `model_type`
"llama" or "qwen3"), `draft_vocab_size`, the variant's flags and `speculators_config`
(the verifier's name and architectures, the proposal settings); `model.safetensors`
with `fc.weight`, `layers.{i}.*` (Hugging Face decoder-layer names, plus
`layers.0.hidden_norm.weight`), `norm.weight`, `lm_head.weight` [K, H], optionally
`embed_tokens.weight`, `input_norm.weight`, `fc_norm.{j}.weight`, and, when K < V,
`d2t` [K] (draft id d is target id d + d2t[d]) and `t2d` [V] (bool, the target ids
drafted).

The original release (as `speculators`' converter reads it): a Llama-style
`config.json` (`hidden_size`, ..., `vocab_size` the target's, `draft_vocab_size`) and
weights with the layer under `midlayer.` (`model.safetensors` or `pytorch_model.bin`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_specdec.io.hf import _export_tensor
from jax_specdec.io.hf_config import config_from_hf, config_to_hf
from jax_specdec.io.layout import Entry, _Entries, _llama_entries
from jax_specdec.io.weights import check_weights_file, open_safetensors
from jax_specdec.nn.config import TransformerConfig
from jax_specdec.nn.eagle3 import Eagle3Config, Eagle3Head

__all__ = [
    "check_target",
    "is_eagle3_release",
    "is_speculators",
    "load_eagle3",
    "read_eagle3_config",
    "save_speculators",
]

CONFIG, WEIGHTS, BIN = "config.json", "model.safetensors", "pytorch_model.bin"
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


def _config_json(path) -> dict[str, Any] | None:
    file = Path(path) / CONFIG
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def is_speculators(path: str | os.PathLike) -> bool:
    """A directory whose config.json names a `speculators_model_type`."""
    data = _config_json(path)
    return isinstance(data, dict) and "speculators_model_type" in data


def is_eagle3_release(path: str | os.PathLike) -> bool:
    """A directory in the original EAGLE-3 release layout: an architecture named
    ...Eagle3 (e.g. LlamaForCausalLMEagle3), or a `draft_vocab_size` without
    `speculators_model_type`."""
    data = _config_json(path)
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


def _speculators_config(data: dict[str, Any], where: str, dtype: str) -> Eagle3Config:
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


def _release_config(data: dict[str, Any], where: str, dtype: str, vocab: int | None):
    """The release's Llama config; `vocab` (t2d's length, when present) is the target's."""
    tl = {k: v for k, v in data.items() if k not in ("architectures", "draft_vocab_size")}
    tl["model_type"] = "llama"
    if vocab is not None:
        tl["vocab_size"] = vocab
    layer, style = _layer_config(tl, where, dtype)
    return _eagle3_config(data, where, layer, style)


def read_eagle3_config(path: str | os.PathLike, *, dtype: str = "float32") -> Eagle3Config:
    """The `Eagle3Config` of a `speculators` or release directory (the weights' headers
    tell whether it stores an embedding and, in a release, the target's vocabulary)."""
    directory = Path(path)
    data = _config_json(directory)
    if data is None:
        raise FileNotFoundError(f"{directory} has no {CONFIG}")
    where = str(directory / CONFIG)
    if not (is_speculators(directory) or is_eagle3_release(directory)):
        raise ValueError(
            f"{where} is no EAGLE-3 head's: it has neither speculators_model_type nor "
            "draft_vocab_size (nor an ...Eagle3 architecture)"
        )
    shapes = _shapes(directory)
    if is_speculators(directory):
        config = _speculators_config(data, where, dtype)
    else:
        vocab = shapes["t2d"][0] if "t2d" in shapes else None
        config = _release_config(data, where, dtype, vocab)
    return config.replace(has_embed="embed_tokens.weight" in shapes)


# ------------------------------------------------------------------------ weights


def _entries(config: Eagle3Config) -> list[Entry]:
    """Every `speculators` tensor of the head but d2t/t2d, with its shape and our path."""
    c = config.layer
    D, F, K, n = c.d_model, config.features_size, config.draft_vocab_size, config.num_aux
    entries = _Entries()
    if config.has_embed:
        entries.add("embed_tokens.weight", (c.vocab_size, D), ("embed",))
    if config.norm_before_fc:
        entries.add("input_norm.weight", (F,), ("input_norm", "scale"))
    for j in range(n if config.fc_norm else 0):
        entries.add(f"fc_norm.{j}.weight", (F // n,), ("fc_norm", j, "scale"))
    entries.add("fc.weight", (D, F), ("fc", "kernel"), transpose=True)
    first_qkv = {f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"}
    for name, shape, convert in _llama_entries(c):  # the decoder layers' own tensors
        if name.startswith("model.layers."):
            if name in first_qkv:  # the first layer's attention reads [embedding; hidden]
                shape = (shape[0], 2 * D)
            entries.append((name[len("model.") :], shape, _renamed(convert)))
    entries.add("layers.0.hidden_norm.weight", (D,), ("layers", 0, "hidden_norm", "scale"))
    for i in range(c.num_layers if config.style == "qwen3" else 0):
        for name in ("q_norm", "k_norm"):
            path = ("layers", i, "attn", name, "scale")
            entries.add(f"layers.{i}.self_attn.{name}.weight", (c.head_dim,), path)
    entries.add("norm.weight", (D,), ("norm", "scale"))
    entries.add("lm_head.weight", (K, D), ("lm_head",), transpose=True)
    return entries


def _renamed(convert):
    """A layout entry's conversion with our Transformer's ("blocks", i) as ("layers", i)."""
    return lambda a: {("layers", *path[1:]): x for path, x in convert(a).items()}


def _weights_file(directory: Path) -> Path:
    for name in (WEIGHTS, BIN):
        if (directory / name).is_file():
            return directory / name
    if list(directory.glob("*.index.json")):
        raise ValueError(f"{directory}: sharded head checkpoints are not supported")
    raise FileNotFoundError(f"{directory} has no {WEIGHTS} (nor {BIN})")


def _release_name(name: str) -> str:
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the head's weights file, by its `speculators` name."""
    file = _weights_file(directory)
    if file.name == BIN:
        return {_release_name(k): v for k, v in _torch_bin(file).items()}
    with open_safetensors(file) as f:
        return {_release_name(name): f.get(name) for name in f.keys()}  # noqa: SIM118


def _shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    file = _weights_file(directory)
    if file.name == BIN:
        return {k: v.shape for k, v in _read_tensors(directory).items()}
    with open_safetensors(file) as f:
        return {_release_name(name): f.shape(name) for name in f.keys()}  # noqa: SIM118


def _torch_bin(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{file}: reading pytorch_model.bin needs torch installed") from None
    state = torch.load(check_weights_file(file), map_location="cpu", weights_only=True)
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def _vocab_map(tensors, config: Eagle3Config, where: str) -> np.ndarray:
    """The draft tokens' target ids from d2t, checked (in range, distinct, as t2d says)."""
    K, V = config.draft_vocab_size, config.vocab_size
    if "d2t" not in tensors:
        if K != V:
            raise ValueError(f"{where}: d2t is missing (draft_vocab_size {K} < vocabulary {V})")
        return np.arange(K, dtype=np.int32)
    d2t = np.asarray(tensors["d2t"])
    if d2t.shape != (K,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"{where}: d2t must be [{K}] integers, got {d2t.dtype} {d2t.shape}")
    ids = np.arange(K, dtype=np.int64) + d2t
    if ids.min() < 0 or ids.max() >= V:
        raise ValueError(
            f"{where}: d2t points outside the target's vocabulary [0, {V}): target ids "
            f"d + d2t[d] lie in [{ids.min()}, {ids.max()}]"
        )
    if len(np.unique(ids)) != K:
        raise ValueError(f"{where}: d2t maps two draft tokens to one target token")
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"]).astype(bool)
        if t2d.shape != (V,) or t2d.sum() != K or not t2d[ids].all():
            raise ValueError(f"{where}: t2d [{V}] does not mark exactly d2t's {K} target ids")
    return ids.astype(np.int32)


def load_eagle3(path: str | os.PathLike, param_dtype: str | None = None, **overrides) -> Eagle3Head:
    """An `Eagle3Head` from a `speculators` or release directory; every tensor checked.

    Weights keep their stored type (bfloat16 heads compute in bfloat16, float16 ones
    in float32 with float16 weights), or take `param_dtype` if given. `overrides` replace
    `Eagle3Config` fields the files do not say (a release names no verifier, target
    layers or `norm_before_residual`), e.g. aux_layer_ids=(2, 16, 29).
    """
    directory = Path(path)
    tensors = _read_tensors(directory)
    fc = tensors.get("fc.weight")
    stored = fc.dtype.name if fc is not None else "float32"
    dtype = "bfloat16" if stored == "bfloat16" else "float32"
    config = read_eagle3_config(directory, dtype=dtype)
    if overrides:
        try:
            config = config.replace(**overrides)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{directory}: {e}") from None
    if param_dtype is not None or stored in ("float16", "bfloat16"):
        config = config.replace(layer=config.layer.replace(param_dtype=param_dtype or stored))
    where = str(_weights_file(directory))
    entries = _entries(config)
    _check_names(tensors, {name for name, _, _ in entries}, where)
    vocab_map = _vocab_map(tensors, config, where)
    abstract = nnx.eval_shape(lambda: Eagle3Head(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(state))
    for name, shape, convert in entries:
        array = tensors[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(array.shape)}, expected {shape}")
        for param_path, value in convert(array).items():
            leaf = targets[param_path]
            leaf.set_value(jnp.asarray(value, leaf.get_value().dtype))
    targets[("vocab_map",)].set_value(jnp.asarray(vocab_map))
    return nnx.merge(graphdef, state)


def _check_names(tensors, wanted: set[str], where: str) -> None:
    ignored = {"d2t", "t2d", "verifier_lm_head.weight", "verifier_norm.weight"}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {missing}")
    unexpected = sorted(set(tensors) - wanted - ignored)
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor(s) {unexpected} for this config")


# ---------------------------------------------------------------------- checking


def check_target(config: Eagle3Config, target: TransformerConfig, name: str = "the target"):
    """Refuses a head that cannot draft for `target`: another hidden size or vocabulary,
    target layers it does not have, draft tokens outside its vocabulary (the last is
    checked at load against the head's own vocabulary size, which must be the target's).
    """
    hidden = config.target_hidden_size or config.d_model
    if hidden != target.d_model:
        raise ValueError(
            f"the EAGLE-3 head reads features of hidden size {hidden} (verifier "
            f"{config.verifier or 'unnamed'}); {name}'s hidden size is {target.d_model}"
        )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"the EAGLE-3 head's vocabulary is {config.vocab_size}; {name}'s is {target.vocab_size}"
        )
    ids = config.aux_layer_ids
    if ids and max(ids) > target.num_layers:
        raise ValueError(
            f"the EAGLE-3 head reads layers {list(ids)}; {name} has {target.num_layers}"
        )


# ------------------------------------------------------------------------ writing


def _config_dict(config: Eagle3Config) -> dict[str, Any]:
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


def save_speculators(
    head: Eagle3Head, path: str | os.PathLike, *, verifier: str | None = None, dtype=None
) -> None:
    """Writes `config.json` and `model.safetensors` in the `speculators` format into
    `path` (created), the weights in their own type or in `dtype` ("float16",
    "bfloat16", "float32"; recorded as the config's `dtype`). `verifier` (a Hugging Face
    id or directory) replaces the target the head names: `speculators` reads that
    target's config (and, for weights a head does not store, its weights) when it loads
    a head.
    """
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"head must be an Eagle3Head, got {type(head).__name__}")
    config = head.config if verifier is None else head.config.replace(verifier=verifier)
    params = {p: np.asarray(leaf.get_value()) for p, leaf in nnx.to_flat_state(nnx.state(head))}
    vocab_map = params.pop(("vocab_map",)).astype(np.int64)
    if dtype is not None:
        layer = config.layer.replace(param_dtype=dtype)  # checks the name
        config = config.replace(layer=layer)
        params = {p: jnp.asarray(a).astype(layer.jnp_param_dtype) for p, a in params.items()}
        params = {p: np.asarray(a) for p, a in params.items()}
    tensors = {
        name: _export_tensor(name, shape, convert, params)
        for name, shape, convert in _entries(config)
    }
    K, V = config.draft_vocab_size, config.vocab_size
    if K != V or not np.array_equal(vocab_map, np.arange(K)):
        if K == V:
            raise ValueError("a head drafting the whole vocabulary must keep its ids in order")
        tensors["d2t"] = vocab_map - np.arange(K, dtype=np.int64)
        t2d = np.zeros((V,), bool)
        t2d[vocab_map] = True
        tensors["t2d"] = t2d
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    text = json.dumps(_config_dict(config), indent=2, sort_keys=True)
    (directory / CONFIG).write_text(text + "\n")
