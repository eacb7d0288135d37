"""Orbax checkpoints of a `Transformer`: a directory with `config.json` and `state/`.

Restore builds the model abstractly (`nnx.eval_shape`), restores the parameters into
that abstract state (optionally sharded) and merges: no random initialisation, no
second copy of the weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jax_specdec.nn import Transformer, TransformerConfig

_CONFIG = "config.json"
_STATE = "state"

ShardingSpec = jax.sharding.Sharding | Callable[[tuple, jax.ShapeDtypeStruct], Any] | Any


def save_checkpoint(model: Transformer, directory: str | os.PathLike) -> Path:
    """Save `model` as `directory/config.json` + `directory/state` (orbax).

    An existing checkpoint in `directory` is overwritten.

    Returns:
        The absolute checkpoint directory.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a Transformer, got {type(model).__name__}")
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / _STATE, state, force=True)
    checkpointer.wait_until_finished()
    (directory / _CONFIG).write_text(model.config.to_json() + "\n")
    return directory


def restore_checkpoint(
    directory: str | os.PathLike, *, sharding: ShardingSpec | None = None
) -> Transformer:
    """Restore a model saved by `save_checkpoint`.

    Args:
        directory: the checkpoint directory.
        sharding: where to place the parameters. None: the default device. A
            `jax.sharding.Sharding`: every parameter. A callable: called as
            `sharding(path, abstract_leaf)` per parameter (path is a tuple such as
            `("blocks", 0, "attn", "q", "kernel")`), returning a Sharding. Otherwise a
            pytree of Shardings with the structure of `nnx.state(model)`.

    Raises:
        FileNotFoundError: the directory, its config.json or its state is missing.
        ValueError: config.json or the state is corrupt or does not match.
    """
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    config_file, state_dir = directory / _CONFIG, directory / _STATE
    if not config_file.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {_CONFIG}")
    if not state_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {directory} has no {_STATE}/ directory")
    try:
        config = TransformerConfig.from_dict(json.loads(config_file.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {config_file} is not a valid TransformerConfig: {e}") from e

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    abstract_state = _with_sharding(abstract_state, sharding)
    try:
        state = ocp.StandardCheckpointer().restore(state_dir, abstract_state)
    except Exception as e:  # orbax raises many types for a damaged or foreign directory
        raise ValueError(f"cannot restore checkpoint state from {state_dir}: {e}") from e
    return nnx.merge(graphdef, state)


def _with_sharding(abstract_state: nnx.State, sharding: ShardingSpec | None) -> nnx.State:
    if sharding is None:
        return abstract_state
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_state,
        )
    if callable(sharding):
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=sharding(_plain_path(path), leaf)
            ),
            abstract_state,
        )
    return jax.tree.map(
        lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
        abstract_state,
        sharding,
    )


def _plain_path(path) -> tuple:
    keys = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
        keys.append(key)
    # Drop the trailing ".value" that Variables add to the path.
    return tuple(k for k in keys if k != "value")
