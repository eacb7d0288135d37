"""A memory plan before compiling: what one device holds for a call.

Parameters per device come from the arrays' own shardings (a weight split over the
model axis counts its shard); KV caches from their shapes (rows × positions × layers ×
KV heads × head_dim, keys and values) split as the program places them (rows over
`data`, heads over `model`); the drafter's state likewise; a working margin for a
round's logits and probabilities ([rows, verify width, vocabulary] float32, a few
copies) and the log-probabilities the program keeps, where asked for; and, in its
place while the prompts are prefilled, the prefill's temporaries (one layer's
attention scores, [rows, heads, prompt, prompt] float32, and MLP intermediates, and
every layer's new keys and values): a whole batch's grows with the square of the
prompt up to `BATCH_CHUNK` positions and runs in chunks of those past it, a slot's is
one row's chunk of `PREFILL_CHUNK` queries (a head's, as the batch's). Against the
device's memory where the backend reports it (`Device.memory_stats()["bytes_limit"]`
on GPU and TPU; a CPU reports none), or a stated `device_memory`, a plan that cannot
fit is refused in one line that gives the figures and the settings to change, before
anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jax_specdec.decode import prefill
from jax_specdec.nn import Transformer, init_cache
from jax_specdec.nn.attention import live_sizes
from jax_specdec.sharding import cache_spec

__all__ = ["CallShape", "MemoryPlan", "device_memory", "plan_memory"]

WORKING_COPIES = 4  # logits, probabilities, the residual and the draft's q of a round
SCORE_COPIES = 3  # a prefill's attention scores and their copies (2.5 measured on XLA:CPU)
MLP_COPIES = 3  # a prefill's MLP intermediates (gate, up, their product)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device holds for a call (the largest share, on a mesh)."""

    parameters: int
    caches: int
    drafter: int
    working: int
    available: int | None  # None: the backend reports no limit
    rows: int
    cache_len: int
    prefill: int = 0  # one layer's temporaries while prefilling, in the working's place

    @property
    def total(self) -> int:
        return self.parameters + self.caches + self.drafter + max(self.working, self.prefill)

    def describe(self) -> str:
        parts = (
            f"parameters {_gib(self.parameters)}, KV caches {_gib(self.caches)} "
            f"({self.rows} rows × {self.cache_len} positions), drafter {_gib(self.drafter)}, "
            f"working {_gib(self.working)}, prefill {_gib(self.prefill)}"
        )
        limit = "no limit reported" if self.available is None else f"of {_gib(self.available)}"
        return f"memory plan: {_gib(self.total)} a device ({parts}), {limit}"

    def check(self) -> None:
        """ValueError, in one line with the figures and what to change, when it does not
        fit the device."""
        if self.available is not None and self.total > self.available:
            raise ValueError(
                f"the call does not fit the device: {self.describe()}; use fewer rows or "
                "num_slots, a smaller max_new_tokens or shorter prompts, a mesh with more "
                "devices, or bfloat16 weights (dtype)"
            )


def device_memory() -> int | None:
    """The memory of this process's first device, as its backend reports it (None on a
    CPU, whose backend reports none)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


@dataclasses.dataclass(frozen=True)
class CallShape:
    """What a call runs, as the plan counts it.

    Attributes:
      rows: rows the program runs (slots, or the padded batch).
      cache_len: positions per row of every cache.
      width: tokens a target call scores per row at most (γ_max + 1, or a tree's
        nodes + 1).
      vocab_size: the vocabulary the round's distributions span.
      prompt: the padded prompt width.
      slots: whether prompts are prefilled one row at a time (slots) rather than the
        whole batch at once.
      kept: bytes of what the program keeps besides the caches (log-probabilities),
        counted with the working margin.
      features: bytes of one prompt position's target features, where the drafter reads
        them (a head): held for the whole prompt while prefilling, with a shifted copy.
    """

    rows: int
    cache_len: int
    width: int
    vocab_size: int
    prompt: int = 0
    slots: bool = False
    kept: int = 0
    features: int = 0


def plan_memory(states, models, call: CallShape, *, mesh, available) -> MemoryPlan:
    """The `MemoryPlan` of `call`.

    Args:
      states: the models' parameter states (target first), placed as the program gets them.
      models: the models that keep a KV cache (target first): transformers, prefilled
        through slots in chunks of `PREFILL_CHUNK`, or heads, which load a slot's row as
        the whole batch's prompts are loaded; each `config` has
        `num_layers`, `num_kv_heads`, `head_dim` and `dtype`.
      mesh: the mesh, or None.
      available: bytes a device holds, or None: no check.
    """
    parameters = sum(_on_device(leaf) for state in states for leaf in jax.tree.leaves(state))
    caches = [_cache_bytes(m.config, call.rows, call.cache_len, mesh) for m in models]
    data = 1 if mesh is None else mesh.shape["data"]
    rows = math.ceil(call.rows / data)
    working = WORKING_COPIES * rows * call.width * call.vocab_size * 4 + call.kept
    prefill = max(_call_bytes(*c, mesh) for c in _prefill_calls(models, call))
    prefill += 2 * (1 if call.slots else rows) * call.prompt * call.features
    return MemoryPlan(
        parameters=parameters,
        caches=caches[0],
        drafter=sum(caches[1:]),
        working=working,
        available=available,
        rows=call.rows,
        cache_len=call.cache_len,
        prefill=prefill + call.kept,
    )


def _on_device(leaf) -> int:
    """Bytes of one device's shard of `leaf`."""
    if not hasattr(leaf, "shape"):
        return 0
    shape = leaf.shape
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * leaf.dtype.itemsize


def _prefill_calls(models, call: CallShape):
    """(config, rows, queries, keys) of each model's widest prefill call
    (`decode.prefill`): the whole batch's prompt at once, or past `BATCH_CHUNK`
    positions in even calls of at most that many over the cache; through slots one row's, in chunks
    of `PREFILL_CHUNK` into a cache of its own for a transformer (whose loop keeps its
    widest attention branch) and as the whole batch's for a head; and a draft model's
    catch-up, every row's chunk over its whole cache."""
    prompt, cache_len = call.prompt, call.cache_len
    calls = []
    for i, model in enumerate(models):
        config, chunks = model.config, isinstance(model, Transformer)
        n, size = (1, prompt) if call.slots else (call.rows, cache_len)
        if call.slots and chunks:
            q = min(prefill.PREFILL_CHUNK, prompt)
            calls.append((config, 1, q, q + -(-prompt // q) * q))
        elif prompt > prefill.BATCH_CHUNK:
            q = prefill.batch_chunk(prompt)
            calls.append((config, n, q, q + size))
        else:
            calls.append((config, n, prompt, prompt + _smallest_live(config, n, size)))
        if i > 0 and chunks:
            q = min(prefill.PREFILL_CHUNK, cache_len)
            calls.append((config, call.rows, q, q + cache_len))
    return calls


def _smallest_live(config, rows: int, cache_len: int) -> int:
    """The smallest prefix of an empty cache that a call attends (`live_sizes`)."""
    kv = 2 * rows * getattr(config, "num_kv_heads", 0) * getattr(config, "head_dim", 0)
    return live_sizes(cache_len, position_bytes=kv * _itemsize(config))[0]


def _itemsize(config) -> int:
    return jnp.dtype(getattr(config, "dtype", "float32")).itemsize


def _call_bytes(config, rows: int, queries: int, keys: int, mesh) -> int:
    """A prefill call's temporaries (one device's share: rows over the data axis, heads
    and MLP columns over the model axis): one layer's attention scores and their
    copies, the keys and values they are scored against and its MLP's intermediates
    (float32), and every layer's new keys and values, held until they are written after
    the call."""
    data = 1 if mesh is None else mesh.shape.get("data", 1)
    split = 1 if mesh is None else mesh.shape.get("model", 1)
    rows = math.ceil(rows / data)
    heads, mlp, kv_heads = (
        math.ceil(getattr(config, name, 0) / split)
        for name in ("num_heads", "mlp_dim", "num_kv_heads")
    )
    layer = SCORE_COPIES * heads * keys + MLP_COPIES * mlp
    head_dim = getattr(config, "head_dim", 0)
    attended = 2 * keys * kv_heads * head_dim * 4
    entries = 2 * getattr(config, "num_layers", 1) * kv_heads * head_dim
    return rows * (queries * (4 * layer + entries * _itemsize(config)) + attended)


def _cache_bytes(config, rows: int, cache_len: int, mesh) -> int:
    """Bytes of one device's share of a model's KV cache (keys and values)."""
    cache = jax.eval_shape(lambda: init_cache(config, batch=rows, max_len=cache_len))
    spec = None if mesh is None else NamedSharding(mesh, cache_spec())
    total = 0
    for array in (*cache.keys, *cache.values):
        shape = array.shape if spec is None else spec.shard_shape(array.shape)
        total += math.prod(shape) * array.dtype.itemsize
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
