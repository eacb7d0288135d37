"""Loading a model straight onto a mesh: every parameter is created with its final
`NamedSharding` (`jax_specdec.sharding`), each device's slice read from the checkpoint
by slice, so no host and no device ever holds a sharded weight whole.

A safetensors tensor that maps onto one parameter (all of Llama's, Qwen's, Mistral's and
Gemma's) is read slice by slice (`safe_open(...).get_slice`), transposed where the
parameter is; under `jax.distributed` each process reads only the slices of its own
devices (`jax.make_array_from_callback` asks for no others). A tensor that feeds several
parameters (GPT-2's fused q/k/v) and GGUF's block-quantized tensors are read (and
dequantized) whole, one at a time, then placed by slices. A model axis wider than the
model's key/value heads repeats each KV head over the devices that share it
(`sharding.kv_repeats`): its slices are read from the checkpoint's one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx

from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.sharding import check_mesh, kv_repeats, sharding_of

__all__ = ["fit_config", "load_onto_mesh", "place_parts", "place_whole"]

# (hf name, index in the hf tensor, or None: all of it) -> a host array.
SliceReader = Callable[[str, tuple], np.ndarray]


def fit_config(config: TransformerConfig, mesh, name: str):
    """`config` as it is placed on `mesh` (KV heads repeated to a wider model axis), and
    the mesh as `Generator` uses it (`check_mesh`: Auto axes, so a Generator keeps the
    loaded arrays as they are); refused in one line (naming `name`) where the mesh does
    not fit the model."""
    repeats = kv_repeats(config, mesh.shape["model"]) if "model" in mesh.shape else 1
    fitted = config.replace(num_kv_heads=config.num_kv_heads * repeats)
    return fitted, check_mesh(mesh, [(name, fitted)])


def _abstract(config: TransformerConfig):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return graphdef, state, dict(nnx.to_flat_state(state))


def load_onto_mesh(
    config: TransformerConfig, entries, read_slice: SliceReader, mesh, name: str
) -> Transformer:
    """The model of `config` with every parameter read by `read_slice` straight into its
    sharding on `mesh`. `entries` are the checkpoint's (`layout.hf_entries`, of the
    unrepeated config): a `layout.Direct` entry is read by slices, any other whole."""
    from jax_specdec.io.layout import Direct

    fitted, mesh = fit_config(config, mesh, name)
    repeats = fitted.num_kv_heads // config.num_kv_heads
    graphdef, state, targets = _abstract(fitted)
    for hf_name, _, convert in entries:
        if isinstance(convert, Direct):
            leaf = targets[convert.path]
            shape = leaf.get_value().shape
            kv = repeats if convert.path[-2:-1] in (("k",), ("v",)) else 1
            read = _direct_reader(read_slice, hf_name, convert, (kv, config.head_dim), leaf)
            sharding = sharding_of(mesh, convert.path, shape)
            leaf.set_value(jax.make_array_from_callback(shape, sharding, read))
            continue
        whole = convert(read_slice(hf_name, None))
        _set_whole(targets, whole, mesh, repeats, config.head_dim)
    _check_covered(targets)
    return nnx.merge(graphdef, state)


def _direct_reader(read_slice, hf_name, direct, kv: tuple[int, int], leaf):
    """read(index): the parameter's slice at `index` from the HF tensor, as the dtype of
    `leaf` (its abstract value; stored [out, in] where the parameter is [in, out]; with
    `kv` = (repeats, head_dim), KV columns repeated `repeats` times)."""
    transpose, (repeats, head_dim) = direct.transpose, kv
    size, dtype = leaf.get_value().shape[-1], leaf.get_value().dtype  # the repeated axis

    def read(index):
        index = tuple(index)
        hf_index = index[::-1] if transpose else index
        if repeats > 1:
            rows = _repeated(hf_index[0], head_dim, repeats, size)
            part = np.concatenate(
                [read_slice(hf_name, (slice(a, b), *hf_index[1:])) for a, b in rows], axis=0
            )
        else:
            part = read_slice(hf_name, hf_index)
        part = part.T if transpose else part
        return np.ascontiguousarray(part.astype(dtype, copy=False))

    return read


def _repeated(rows: slice, head_dim: int, repeats: int, size: int) -> list[tuple[int, int]]:
    """The checkpoint's row ranges that make rows `rows` of the repeated layout (`size`
    rows; head h of it is the checkpoint's head h // repeats), as (start, stop) runs."""
    start, stop, _ = rows.indices(size)
    runs: list[tuple[int, int]] = []
    at = start
    while at < stop:
        head, offset = divmod(at, head_dim)
        end = min(stop, (head + 1) * head_dim)
        source = (head // repeats) * head_dim + offset
        runs.append((source, source + end - at))
        at = end
    return runs


def _set_whole(targets, parts: dict, mesh, repeats: int, head_dim: int) -> None:
    """Parameters given whole (host arrays) placed by slices."""
    from jax_specdec.sharding import repeat_heads

    for path, array in parts.items():
        if repeats > 1 and path[-2:-1] in (("k",), ("v",)):
            array = repeat_heads(np.asarray(array), head_dim, repeats)
        targets[path].set_value(place_whole(array, targets[path].get_value(), mesh, path))


def place_whole(array: np.ndarray, like, mesh, path: tuple) -> jax.Array:
    """A host array, cast to `like`'s dtype, placed on `mesh` by the parameter's
    sharding: each device receives only its slice."""
    array = np.asarray(array).astype(like.dtype, copy=False)
    sharding = sharding_of(mesh, path, array.shape)
    return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def _check_covered(targets) -> None:
    missing = [p for p, leaf in targets.items() if not isinstance(leaf.get_value(), jax.Array)]
    if missing:  # a mapping bug, not a user error
        raise AssertionError(f"unmapped parameters: {sorted(missing)[:8]}")


def place_parts(
    config: TransformerConfig, parts: Iterable[dict[tuple, np.ndarray]], mesh, name: str
) -> Transformer:
    """The model of `config` from host parts (as `layout.build_model` takes them, e.g.
    GGUF's dequantized tensors), each placed by slices on `mesh` as it arrives."""
    fitted, mesh = fit_config(config, mesh, name)
    repeats = fitted.num_kv_heads // config.num_kv_heads
    graphdef, state, targets = _abstract(fitted)
    for part in parts:
        _set_whole(targets, part, mesh, repeats, config.head_dim)
    _check_covered(targets)
    return nnx.merge(graphdef, state)
