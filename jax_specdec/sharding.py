"""Placing a generation on a `jax.sharding.Mesh`: rows over the data axis, weights over
the model axis (tensor parallel: attention heads and MLP columns), caches with their
rows and heads. XLA's SPMD partitioner does the rest; it is still one program.

The layout (Megatron style) for a mesh with axes (data, model):
- q/k/v and MLP gate/up kernels [in, out]: columns split over `model` (whole heads);
  their biases likewise. Attention output and MLP down kernels: rows split over
  `model`. The embedding [V, D] and the untied head [D, V] split over the vocabulary
  (each logit is still computed whole on one device) where `model` divides it. Norms
  (Qwen3's per-head q/k norms [head_dim] too, the same for every head): replicated.
- A `model` axis wider than a model's key/value heads: each KV head is repeated over
  the devices whose query heads read it (`kv_repeats`; the model then has as many KV
  heads as the axis has devices, the same attention exactly).
- prompts, lengths, per-row keys: rows split over `data`.
- KV caches [B, K, S, hd]: rows over `data`, key/value heads over `model`.

Per-row keys travel with their rows, so the tokens do not depend on the mesh (up to
floating-point summation order across devices).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "cache_spec",
    "check_mesh",
    "kv_repeats",
    "param_sharding",
    "param_spec",
    "place_rows",
    "repeat_kv_heads",
    "sharding_of",
    "shard_state",
]

DATA, MODEL = "data", "model"
_COLUMNS = {"q", "k", "v", "gate", "up"}  # kernels [in, out] split by output columns
_ROWS = {"o", "down"}  # kernels [in, out] split by input rows


def check_mesh(mesh, configs, batch: int | None = None) -> Mesh:
    """A clear error unless `mesh` has `data` and `model` axes that divide the batch,
    the attention and key/value heads and the MLP width of every model."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    missing = {DATA, MODEL} - set(mesh.axis_names)
    if missing:
        raise ValueError(
            f"mesh needs axes named 'data' and 'model' (size 1 is fine); it has "
            f"{mesh.axis_names}, missing {sorted(missing)}"
        )
    data, model = mesh.shape[DATA], mesh.shape[MODEL]
    if batch is not None and batch % data:
        raise ValueError(
            f"the mesh's data axis ({data}) does not divide the batch ({batch}); pad the "
            "batch or choose another mesh"
        )
    for name, c in configs:
        for what, size in (
            ("num_heads", c.num_heads),
            ("num_kv_heads", c.num_kv_heads),
            ("mlp_dim", c.mlp_dim),
        ):
            if size % model:
                raise ValueError(
                    f"the mesh's model axis ({model}) does not divide the {name} model's "
                    f"{what} ({size})"
                )
    # The program places its arrays with sharding constraints, which need Auto axes
    # (jax.make_mesh makes Explicit ones by default): the same devices, Auto axes.
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if tuple(getattr(mesh, "axis_types", auto)) != auto:
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return mesh


def kv_repeats(config, model: int) -> int:
    """How many times each key/value head is repeated on a `model` axis of this size: 1
    when the axis divides the KV heads (or cannot be fitted: `check_mesh` refuses it),
    else model / num_kv_heads, when that is whole and the axis divides the query heads."""
    k = config.num_kv_heads
    if k % model == 0 or model % k or config.num_heads % model:
        return 1
    return model // k


def repeat_kv_heads(model, repeats: int):
    """`model` (a Transformer) with each key/value head repeated `repeats` times in a row:
    as many KV heads as a mesh's model axis has devices. Every query head reads the same
    keys and values as before, so the logits are the same; the KV cache grows by the
    factor overall, and holds one head per device."""
    from flax import nnx

    if repeats == 1:
        return model
    config = model.config
    wider = config.replace(num_kv_heads=config.num_kv_heads * repeats)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: type(model)(wider, rngs=nnx.Rngs(0))))
    values = dict(nnx.to_flat_state(nnx.state(model)))
    for path, leaf in nnx.to_flat_state(state):
        value = values[path].get_value()
        if len(path) >= 2 and path[-2] in ("k", "v"):  # [.., K * hd] columns, or a bias
            value = repeat_heads(value, config.head_dim, repeats)
        leaf.set_value(value)
    return nnx.merge(graphdef, state)


def repeat_heads(value, head_dim: int, repeats: int):
    """Columns (the last axis) [.., K * head_dim] -> [.., K * repeats * head_dim], each
    head's block repeated in place."""
    xp = np if isinstance(value, np.ndarray) else jax.numpy  # a host array stays on the host
    lead, k = value.shape[:-1], value.shape[-1] // head_dim
    heads = value.reshape(*lead, k, 1, head_dim)
    return xp.broadcast_to(heads, (*lead, k, repeats, head_dim)).reshape(
        *lead, k * repeats * head_dim
    )


def param_spec(path: tuple, shape: tuple | None = None, model: int = 1) -> P:
    """The PartitionSpec of one parameter, from its path in `nnx.state(model)`; the
    embedding and the untied head are split over the vocabulary when their `shape` is
    given and the `model` axis size divides it."""
    names = [str(p) for p in path]
    if names and names[-1] == "value":  # an nnx.Variable's own pytree key
        names = names[:-1]
    leaf, parent = names[-1], names[-2] if len(names) > 1 else ""
    if leaf in ("embed", "lm_head") and len(names) == 1 and shape is not None:
        vocab_axis = 0 if leaf == "embed" else 1
        if model > 1 and len(shape) == 2 and shape[vocab_axis] % model == 0:
            return P(MODEL, None) if leaf == "embed" else P(None, MODEL)
        return P()
    if parent in _COLUMNS:
        return P(None, MODEL) if leaf == "kernel" else P(MODEL)
    if parent in _ROWS and leaf == "kernel":
        return P(MODEL, None)
    return P()


def _global(x, sharding):
    """A global array with `sharding` from a value every process holds in full (works
    with one process and under `jax.distributed` with several)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_state(state, mesh: Mesh):
    """An `nnx.state` with every parameter placed by `param_spec` on `mesh` (a parameter
    already so placed is kept, not copied)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _global(x, sharding_of(mesh, path, np.shape(x))), state
    )


def sharding_of(mesh: Mesh, path: tuple, shape: tuple) -> NamedSharding:
    """The NamedSharding of the parameter at `path` (a pytree or flat-state path)."""
    return NamedSharding(mesh, param_spec(tuple(map(_key, path)), shape, mesh.shape[MODEL]))


def param_sharding(mesh: Mesh):
    """For `checkpoint.restore_checkpoint(sharding=...)`: restore straight into this
    layout with orbax (each process reads only its shards)."""
    return lambda path, leaf: sharding_of(mesh, path, leaf.shape)


def _key(entry):
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def place_rows(mesh: Mesh, *arrays):
    """Arrays with rows first, split over the data axis."""
    return tuple(
        _global(a, NamedSharding(mesh, P(DATA, *([None] * (np.ndim(a) - 1))))) for a in arrays
    )


def cache_spec() -> P:
    return P(DATA, MODEL, None, None)
