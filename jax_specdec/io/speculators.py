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

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_specdec.io.hf import export_tensor
from jax_specdec.io.layout import Entries, Entry, llama_entries
from jax_specdec.io.speculators_config import (
    CONFIG,
    config_dict,
    config_json,
    is_eagle3_release,
    is_speculators,
    release_config,
    speculators_config,
)
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

WEIGHTS, BIN = "model.safetensors", "pytorch_model.bin"


def read_eagle3_config(path: str | os.PathLike, *, dtype: str = "float32") -> Eagle3Config:
    """The `Eagle3Config` of a `speculators` or release directory (the weights' headers
    tell whether it stores an embedding and, in a release, the target's vocabulary)."""
    directory = Path(path)
    data = config_json(directory)
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
        config = speculators_config(data, where, dtype)
    else:
        vocab = shapes["t2d"][0] if "t2d" in shapes else None
        config = release_config(data, where, dtype, vocab)
    return config.replace(has_embed="embed_tokens.weight" in shapes)


# ------------------------------------------------------------------------ weights


def _entries(config: Eagle3Config) -> list[Entry]:
    """Every `speculators` tensor of the head but d2t/t2d, with its shape and our path."""
    c = config.layer
    D, F, K, n = c.d_model, config.features_size, config.draft_vocab_size, config.num_aux
    entries = Entries()
    if config.has_embed:
        entries.add("embed_tokens.weight", (c.vocab_size, D), ("embed",))
    if config.norm_before_fc:
        entries.add("input_norm.weight", (F,), ("input_norm", "scale"))
    for j in range(n if config.fc_norm else 0):
        entries.add(f"fc_norm.{j}.weight", (F // n,), ("fc_norm", j, "scale"))
    entries.add("fc.weight", (D, F), ("fc", "kernel"), transpose=True)
    first_qkv = {f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"}
    for name, shape, convert in llama_entries(c):  # the decoder layers' own tensors
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
        name: export_tensor(name, shape, convert, params)
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
    text = json.dumps(config_dict(config), indent=2, sort_keys=True)
    (directory / CONFIG).write_text(text + "\n")
