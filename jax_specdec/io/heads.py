"""A feature head as a directory a user can read: `head_config.json` (the
`FeatureHeadConfig`) and `model.safetensors` (its weights and `vocab_map`, the kept
token ids). `is_feature_head(path)` tells such a directory from a model directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_specdec.io.head_acceptance import ACCEPTANCE, read_tree_acceptance
from jax_specdec.io.hub import hub_snapshot, is_hub_id
from jax_specdec.io.weights import open_safetensors
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig

__all__ = [
    "check_tokenizer",
    "is_feature_head",
    "load_head",
    "load_head_config",
    "save_head",
    "tokenizer_sha256",
]

CONFIG = "head_config.json"
WEIGHTS = "model.safetensors"


def is_feature_head(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG).is_file()


def _flat(state: nnx.State) -> dict[str, object]:
    return {".".join(map(str, path)): leaf for path, leaf in nnx.to_flat_state(state)}


def save_head(head: FeatureHead, path: str | os.PathLike, dtype: str | None = None) -> None:
    """Writes `head_config.json` and `model.safetensors` into `path` (created), and
    removes a `tree_acceptance.json` there (measured with the weights it replaces).

    `dtype` ("float16", "float32"; None keeps each tensor's own) stores the floating
    weights in that type, e.g. to halve a shipped head, and records it as the config's
    `param_dtype`, so `load_head` keeps them in that type (a float16 head computes in
    float32 with its weights widened inside the products: half the bytes read per draft
    step, the same results). `vocab_map` stays int32.
    """
    if not isinstance(head, FeatureHead):
        raise TypeError(f"head must be a FeatureHead, got {type(head).__name__}")
    if dtype not in (None, "float16", "float32"):
        raise ValueError(f"dtype must be None, 'float16' or 'float32', got {dtype!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config
    if dtype is not None:
        config = dataclasses.replace(config, layer=config.layer.replace(param_dtype=dtype))
    flat = _flat(nnx.state(head))
    tensors = {name: np.asarray(leaf.get_value()) for name, leaf in flat.items()}
    if dtype is not None:
        tensors = {
            name: t.astype(dtype) if np.issubdtype(t.dtype, np.floating) else t
            for name, t in tensors.items()
        }
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "jax_specdec.feature_head"})
    (directory / ACCEPTANCE).unlink(missing_ok=True)  # measured with the weights replaced
    (directory / CONFIG).write_text(config.to_json() + "\n")


def load_head_config(path: str | os.PathLike) -> FeatureHeadConfig:
    """The `FeatureHeadConfig` of the head saved in `path` (its weights not read)."""
    directory = Path(path)
    if not is_feature_head(directory):
        raise FileNotFoundError(f"{directory} is not a feature head directory (no {CONFIG})")
    try:
        return FeatureHeadConfig.from_dict(json.loads((directory / CONFIG).read_text()))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{directory / CONFIG} is not a valid head config: {error}") from error


def load_head(path: str | os.PathLike, param_dtype: str | None = None):
    """The head saved in `path`; every tensor checked against the config first.

    `path` is a feature head's directory (`save_head`: a `FeatureHead`), or an EAGLE-3
    head's in the `speculators` format or the original EAGLE-3 release layout (an
    `Eagle3Head`, `jax_specdec.io.speculators`); or a Hub id of either (`io.hub`).

    Its weights take the config's `param_dtype` (that of the saved tensors, for a head
    written by `save_head`), or `param_dtype` ("float32", "float16", "bfloat16") if
    given: e.g. "float32" to train it further.
    """
    directory = Path(path)
    if not directory.exists() and is_hub_id(str(path)):  # org/name[@revision]
        directory = hub_snapshot(str(path), "path")
    if not is_feature_head(directory):
        from jax_specdec.io import speculators

        if speculators.is_speculators(directory) or speculators.is_eagle3_release(directory):
            return speculators.load_eagle3(directory, param_dtype)
    config = load_head_config(directory)
    config = dataclasses.replace(config, tree_acceptance=read_tree_acceptance(directory))
    if param_dtype is not None:
        layer = config.layer.replace(param_dtype=param_dtype)  # checks the name
        config = dataclasses.replace(config, layer=layer)
    abstract = nnx.eval_shape(lambda: FeatureHead(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    wanted = _flat(state)
    with open_safetensors(directory / WEIGHTS) as f:
        names = set(f.keys())  # noqa: SIM118 (not a mapping)
        if names != set(wanted):
            missing, extra = sorted(set(wanted) - names), sorted(names - set(wanted))
            raise ValueError(f"{directory / WEIGHTS}: missing {missing}, unexpected {extra}")
        for name, leaf in wanted.items():
            array = f.get(name)
            expected = leaf.get_value()
            if array.shape != expected.shape:
                raise ValueError(
                    f"{directory / WEIGHTS}: {name} has shape {array.shape}, the config "
                    f"implies {expected.shape}"
                )
            if name == "vocab_map":
                _check_vocab_map(directory / WEIGHTS, array, config.vocab_size)
            leaf.set_value(jnp.asarray(array, expected.dtype))
    return nnx.merge(graphdef, state)


def _check_vocab_map(file: Path, ids: np.ndarray, vocab_size: int) -> None:
    """The kept ids: integers in [0, vocab_size), each once (a duplicate would count one
    token's draft probability twice)."""
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{file}: vocab_map must hold integer token ids, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"{file}: vocab_map ids lie in [{ids.min()}, {ids.max()}], outside [0, {vocab_size})"
        )
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{file}: vocab_map lists token {int(unique[counts > 1][0])} more than once "
            f"({int((counts > 1).sum())} duplicated id(s))"
        )


def check_tokenizer(head, tokenizer) -> None:
    """Refuses a feature head trained with another tokenizer than `tokenizer` (the
    target's), where the head names its tokenizer (`tokenizer_sha256`); other heads
    and `tokenizer=None` pass."""
    config = head.config
    if tokenizer is None or not isinstance(head, FeatureHead) or not config.tokenizer_sha256:
        return
    if tokenizer_sha256(tokenizer) != config.tokenizer_sha256:
        name = f"the feature head (trained for {config.target or 'an unnamed target'})"
        raise ValueError(f"{name} was trained with another tokenizer than the target's")


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 of a `tokenizers.Tokenizer`'s JSON (how a head names its tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return hashlib.sha256(backend.to_str().encode()).hexdigest()
