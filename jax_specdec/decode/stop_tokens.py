"""Stop sequences inside the program: a row ends as soon as its generated tokens end with
one of its stop sequences (token ids; the tokenization of a stop string, say), in
whichever round, at whichever position of the round's accepted tokens the sequence
completes; its tokens after that position are dropped, as after an EOS.

A row's sequences travel with its sampling setting (`RowSampling.stop_tokens`, [B, S, M]
int32, each sequence right-aligned with -1 before it; a row with fewer sequences pads
with rows of -1), so they follow the row into any slot. The text is not the program's
concern: a stop string may also arise from other tokens than its own tokenization, so
the caller still cuts the decoded text at the string (`jax_specdec.stop_strings`); the
program only saves the rounds after the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["first_stop", "per_row", "stop_array"]


def _is_ids(x) -> bool:
    return isinstance(x, Sequence) and all(isinstance(t, (int, np.integer)) for t in x)


def per_row(stop_sequences, batch: int) -> list[list[list[int]]]:
    """`stop_sequences` as B rows of sequences: one list of (non-empty) token-id sequences
    for every row, or one such list per row (a row's may be empty); [] is none."""
    if isinstance(stop_sequences, (str, bytes)) or not isinstance(stop_sequences, Sequence):
        raise TypeError(
            "stop_sequences must be a list of token-id lists, or one such list per prompt, got "
            f"{type(stop_sequences).__name__}"
        )
    if len(stop_sequences) == 0:
        return [[] for _ in range(batch)]
    if all(_is_ids(seq) and len(seq) for seq in stop_sequences):
        return [list(map(list, stop_sequences))] * batch
    if len(stop_sequences) != batch or not all(
        isinstance(row, Sequence) and all(_is_ids(seq) for seq in row) for row in stop_sequences
    ):
        raise ValueError(
            "stop_sequences must be a list of token-id lists, or one such list per prompt "
            f"([B] = [{batch}] lists)"
        )
    return [list(map(list, row)) for row in stop_sequences]


def stop_array(
    rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, shape: tuple[int, int] | None = None
) -> np.ndarray:
    """[B, S, M] int32 of each row's stop sequences (S the most of any row, M the longest
    sequence, or `shape`'s (S, M) where given, to keep one shape over several calls),
    right-aligned, padded with -1."""
    rows = [[list(seq) for seq in row] for row in rows]
    for b, row in enumerate(rows):
        for seq in row:
            if not seq:
                raise ValueError(f"row {b}: a stop sequence needs at least one token")
            bad = [
                t for t in seq if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size
            ]
            if bad:
                raise ValueError(
                    f"row {b}: stop token ids must lie in [0, {vocab_size}), got {bad}"
                )
    count = max((len(row) for row in rows), default=0)
    longest = max((len(seq) for row in rows for seq in row), default=0)
    if shape is not None:
        if count > shape[0] or longest > shape[1]:
            raise ValueError(f"stop sequences of ({count}, {longest}) exceed the shape {shape}")
        count, longest = shape
    out = np.full((len(rows), max(count, 1), max(longest, 1)), -1, np.int32)
    for b, row in enumerate(rows):
        for s, seq in enumerate(row):
            out[b, s, longest - len(seq) :] = seq
    return out


def first_stop(tokens, start, prompt_lengths, width: int, stops) -> tuple[jax.Array, jax.Array]:
    """Where a stop sequence first completes among the `width` tokens written at
    start[b] … of `tokens` [B, L]: (hit [B] bool, its index in [0, width) [B] int32).
    A sequence matches only within the generated tokens (at or after prompt_lengths)."""
    batch, length = tokens.shape
    longest = stops.shape[2]
    ends = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]  # [B, W]
    at = ends[:, :, None] - longest + 1 + jnp.arange(longest, dtype=jnp.int32)  # [B, W, M]
    window = jnp.take_along_axis(tokens, jnp.clip(at, 0, length - 1).reshape(batch, -1), axis=1)
    window = window.reshape(batch, width, 1, longest)
    pad = stops[:, None] < 0  # [B, 1, S, M]
    generated = (at >= prompt_lengths[:, None, None])[:, :, None]  # [B, W, 1, M]
    same = pad | ((window == stops[:, None]) & generated)
    real = jnp.any(~pad, axis=-1)  # [B, 1, S]: rows of -1 are no sequence
    hits = jnp.any(jnp.all(same, axis=-1) & real, axis=-1)  # [B, W]
    return jnp.any(hits, axis=1), jnp.argmax(hits, axis=1).astype(jnp.int32)
