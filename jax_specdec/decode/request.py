"""Input checks on the host: prompts, keys and budgets become one frozen `Request`.

Every public entry point validates here, before anything is traced, so bad input fails
with a `ValueError` or `TypeError` naming the argument, never an XLA shape error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.sampling import RowSampling, SamplingConfig

__all__ = [
    "INT32_MAX",
    "Request",
    "check_int",
    "longest_first",
    "make_request",
    "queue_rows",
    "seed_key_data",
]

#: the largest count, budget or length the compiled program holds (int32).
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One generation's validated inputs, on the host.

    Attributes:
      prompts: [B, P] int32, right-padded with zeros: P is the width of an array of
        prompts as given (so arrays of one shape share one compiled program), the
        longest prompt for a list.
      prompt_lengths: [B] int32, each >= 1.
      keys: [B] jax key array, one key per row.
      budgets: [B] int32, tokens to generate per row (fewer if the row emits EOS).
      sampling: each row's sampling setting (`RowSampling` of numpy arrays [B]).
    """

    prompts: np.ndarray
    prompt_lengths: np.ndarray
    keys: jax.Array
    budgets: np.ndarray
    sampling: RowSampling

    @property
    def max_new_tokens(self) -> int:
        """The largest budget: the width of the output."""
        return int(self.budgets.max())

    @property
    def batch(self) -> int:
        return self.prompts.shape[0]

    @property
    def longest(self) -> int:
        return int(self.prompt_lengths.max())

    def trimmed(self) -> Request:
        """The same request with the prompts' padding cut to the longest prompt."""
        return dataclasses.replace(self, prompts=self.prompts[:, : self.longest])


def stop_ids(eos_token_id, vocab_size: int) -> tuple[int, ...] | None:
    """`eos_token_id` (None, an id, or a sequence of ids) as a sorted tuple of distinct
    ids in [0, vocab_size), or None; a ValueError naming it otherwise."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, (int, np.integer)) else eos_token_id
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(
            f"eos_token_id must be an id or a list of ids, got {eos_token_id!r}"
        ) from None
    if not ids:
        raise ValueError("eos_token_id is an empty list: give None for no EOS")
    for i in ids:
        if not 0 <= check_int("eos_token_id", i, 0) < vocab_size:
            raise ValueError(f"eos_token_id must lie in [0, {vocab_size}), got {i}")
    return tuple(sorted({int(i) for i in ids}))


def check_int(name: str, value, low: int, high: int = INT32_MAX) -> int:
    """`value` as an int in [low, high] (by default within int32, checked before any
    cast: a larger value would wrap around), else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if value > high:
        raise ValueError(f"{name} must be at most {high}, got {value!r}")
    return int(value)


def make_request(
    prompts, prompt_lengths, key, max_new_tokens, sampling, *, vocab_size: int
) -> Request:
    """Validates the inputs of a generation call (token ids must lie in [0, vocab_size));
    `max_new_tokens` is one int or one per prompt, `sampling` one `SamplingConfig` or
    one per prompt."""
    rows = _rows(prompts, prompt_lengths)
    budgets = _budgets(max_new_tokens, len(rows))
    settings = _settings(sampling, len(rows))
    lengths = np.array([row.size for row in rows], np.int32)
    width = prompts.shape[1] if isinstance(prompts, (jax.Array, np.ndarray)) else lengths.max()
    for b, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompts[{b}] is empty: every prompt needs at least one token")
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(
                f"prompts[{b}] has token ids outside [0, {vocab_size}): "
                f"min {int(row.min())}, max {int(row.max())}"
            )
    outside = np.flatnonzero((settings.bias_ids >= vocab_size).any(axis=-1))
    if outside.size:
        b = int(outside[0])
        ids = sorted(int(i) for i in settings.bias_ids[b] if i >= vocab_size)
        raise ValueError(
            f"sampling[{b}].logit_bias names token ids outside the vocabulary "
            f"[0, {vocab_size}): {ids}"
        )
    padded = np.zeros((len(rows), int(width)), np.int32)
    for b, row in enumerate(rows):
        padded[b, : row.size] = row
    return Request(padded, lengths, _row_keys(key, len(rows)), budgets, settings)


def _settings(sampling, batch: int) -> RowSampling:
    """[B] rows of sampling settings from one `SamplingConfig`, a sequence of B, or a
    `RowSampling` of B rows (built under a chosen plan, `RowSampling.of`)."""
    if isinstance(sampling, SamplingConfig):
        return RowSampling.of([sampling] * batch)
    if isinstance(sampling, RowSampling):
        if np.shape(sampling.temperature) != (batch,):
            raise ValueError(
                f"sampling must hold [B] = [{batch}] rows, got {np.shape(sampling.temperature)}"
            )
        return jax.tree.map(np.asarray, sampling)
    if isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence):
        raise TypeError(
            f"sampling must be a SamplingConfig or one per prompt, got {type(sampling).__name__}"
        )
    if len(sampling) != batch:
        raise ValueError(
            f"sampling must be one SamplingConfig or [B] = [{batch}] of them, got {len(sampling)}"
        )
    return RowSampling.of(sampling)


def _budgets(max_new_tokens, batch: int) -> np.ndarray:
    """[B] int32 budgets from one int or a sequence of B ints, each >= 1."""
    if isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool):
        return np.full(batch, check_int("max_new_tokens", max_new_tokens, 1), np.int32)
    if isinstance(max_new_tokens, (str, bytes)) or not isinstance(
        max_new_tokens, (Sequence, np.ndarray, jax.Array)
    ):
        raise ValueError(
            f"max_new_tokens must be an integer >= 1 or one per prompt, got {max_new_tokens!r}"
        )
    values = np.asarray(max_new_tokens)
    if values.shape != (batch,) or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"max_new_tokens must be one integer or [B] = [{batch}] integers, got "
            f"{values.dtype} {values.shape}"
        )
    if values.min() < 1:
        raise ValueError(
            f"max_new_tokens must be >= 1 for every prompt, got {int(values.min())} at "
            f"prompt {int(np.argmin(values))}"
        )
    if values.max() > INT32_MAX:  # checked before the cast, which would wrap around
        raise ValueError(
            f"max_new_tokens must be at most {INT32_MAX} for every prompt, got "
            f"{int(values.max())} at prompt {int(np.argmax(values))}"
        )
    return values.astype(np.int32)


def _rows(prompts, prompt_lengths) -> list[np.ndarray]:
    """The prompts as a list of 1-D integer arrays (ragged), checked for shape and type."""
    if isinstance(prompts, (jax.Array, np.ndarray)):
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise ValueError(f"prompts array must be [B, P], got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"prompts must hold integer token ids, got dtype {array.dtype}")
        lengths = _array_lengths(array, prompt_lengths)
        rows = [array[b, : lengths[b]] for b in range(array.shape[0])]
    else:
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for an array of prompts, not a list")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of token-id lists or an int array [B, P]")
        rows = []
        for b, row in enumerate(prompts):
            arr = np.asarray(row)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise TypeError(f"prompts[{b}] must be a flat list of integer token ids")
            rows.append(arr)
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    return rows


def _array_lengths(array: np.ndarray, prompt_lengths) -> np.ndarray:
    if prompt_lengths is None:
        return np.full(array.shape[0], array.shape[1], np.int64)
    lengths = np.asarray(prompt_lengths)
    if lengths.shape != (array.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            f"prompt_lengths must be [B] = [{array.shape[0]}] integers, "
            f"got {lengths.dtype} {lengths.shape}"
        )
    if np.any(lengths > array.shape[1]):
        raise ValueError(f"prompt_lengths exceed the prompts' width {array.shape[1]}")
    if np.any(lengths < 1):  # a negative length would slice from the end
        b = int(np.argmin(lengths))
        raise ValueError(f"prompt_lengths[{b}] must be >= 1, got {int(lengths[b])}")
    return lengths


def _row_keys(key, batch: int) -> jax.Array:
    """One key per row: fold_in(key, b) from a single key, or the B keys given."""
    if not isinstance(key, jax.Array):
        raise TypeError("key must be a jax.random.key(...) or an array of B keys")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape == ():
            return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
        if key.shape == (batch,):
            return key
    elif key.dtype == jnp.uint32 and key.shape == (2,):
        return _row_keys(jax.random.wrap_key_data(key), batch)
    elif key.dtype == jnp.uint32 and key.shape == (batch, 2):
        return jax.random.wrap_key_data(key)
    raise ValueError(
        f"key must be one key (shape []) or one key per row (shape [{batch}]), "
        f"got dtype {key.dtype} shape {key.shape}"
    )


def longest_first(budgets: np.ndarray) -> np.ndarray:
    """The queue order of slots: largest budget first (ties in the given order), so the
    longest rows do not start last and run on alone at the end. Tokens do not depend on
    it (a row's tokens depend only on its prompt and key)."""
    return np.argsort(-budgets, kind="stable")


def queue_rows(arrays, num_slots: int):
    """Prompts, lengths, keys, budgets and sampling padded to S·2^k rows for `num_slots`
    = S (so a different number of prompts in the same bucket reuses the program): padding
    rows have a one-token prompt, budget 0 (never loaded) and the last row's sampling."""
    prompts, lengths, keys, budgets, sampling = arrays
    rows = num_slots * 2 ** math.ceil(math.log2(prompts.shape[0] / num_slots))
    extra = rows - prompts.shape[0]
    if extra == 0:
        return arrays
    return (
        np.pad(prompts, ((0, extra), (0, 0))),
        np.pad(lengths, (0, extra), constant_values=1),
        jnp.concatenate([keys, jax.random.split(keys[0], extra)]),
        np.pad(budgets, (0, extra)),
        jax.tree.map(
            lambda a: np.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1), mode="edge"), sampling
        ),
    )


def seed_key_data(seed: int) -> np.ndarray:
    """The threefry key of a 63-bit seed: [seed >> 32, seed & 0xffffffff], which is
    `jax.random.key(seed)` for seeds below 2**32 (JAX without x64 keeps only the low
    32 bits of larger ones)."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
