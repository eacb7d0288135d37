"""Placing a generation on a `jax.sharding.Mesh`: rows over the data axis, weights over
the model axis (tensor parallel: attention heads and MLP columns), caches with their
rows and heads. XLA's SPMD partitioner does the rest; it is still one program.

The layout (Megatron style) for a mesh with axes (data, model):
- q/k/v and MLP gate/up kernels [in, out]: columns split over `model` (whole heads);
  their biases likewise. Attention output and MLP down kernels: rows split over
  `model`. Embedding, norms (Qwen3's per-head q/k norms [head_dim] too, the same
  for every head) and the untied head: replicated.
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
    "param_sharding",
    "param_spec",
    "place_rows",
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


def param_spec(path: tuple) -> P:
    """The PartitionSpec of one parameter, from its path in `nnx.state(model)`."""
    names = [str(p) for p in path]
    if names and names[-1] == "value":  # an nnx.Variable's own pytree key
        names = names[:-1]
    leaf, parent = names[-1], names[-2] if len(names) > 1 else ""
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
    """An `nnx.state` with every parameter placed by `param_spec` on `mesh`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _global(x, NamedSharding(mesh, param_spec(tuple(map(_key, path))))),
        state,
    )


def param_sharding(mesh: Mesh):
    """For `checkpoint.restore_checkpoint(sharding=...)`: restore straight into this
    layout with orbax (each process reads only its shards)."""
    return lambda path, _: NamedSharding(mesh, param_spec(tuple(map(_key, path))))


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
