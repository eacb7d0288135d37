"""Windows of text the target writes itself: a prompt (`training.prompts`) followed by the
target's continuation of it, greedy or sampled as the prompt says, cut to one length.

Generation is the slow part on a CPU, so it runs in batches, each saved to
`directory/parts/` as it is done; a run started again skips the batches on
disk. Batch i's sampling key is `fold_in(key(seed), i)`, so the windows do not depend on
where a run was interrupted.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import jax
import numpy as np

from jax_specdec.training.prompts import Prompt

__all__ = ["Windows", "generate_windows", "tokenize_prompts"]


class Windows(NamedTuple):
    """[N, T] tokens (prompt then continuation) and [N] the first continuation position."""

    tokens: np.ndarray
    start: np.ndarray


def tokenize_prompts(tokenizer, prompts: list[Prompt], longest: int) -> list[tuple[list, bool]]:
    """(token ids, greedy) of each prompt of at most `longest` tokens (longer ones left out)."""
    encoded = [(tokenizer.encode(p.text).ids, p.greedy) for p in prompts]
    return [(ids, greedy) for ids, greedy in encoded if 1 <= len(ids) <= longest]


def generate_windows(
    target,
    prompts: list[tuple[list, bool]],
    seq_len: int,
    directory,
    *,
    temperature: float = 0.8,
    batch: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> Windows:
    """Windows [N, seq_len] of each prompt (token ids, greedy) and the target's
    continuation (sampled at `temperature` where not greedy), in the prompts' order.

    Every call generates `seq_len` minus the shortest prompt's length per row, from
    prompts padded to the longest one, under one sampling plan: one compiled program
    for the whole run (a row's tokens past `seq_len` are dropped)."""
    from tqdm.auto import tqdm

    from jax_specdec.decode import Generator
    from jax_specdec.sampling import RowSampling, SamplingConfig, SamplingPlan

    if not prompts:
        raise ValueError("no prompts to continue")
    lengths = np.array([len(ids) for ids, _ in prompts])
    if lengths.max() >= seq_len:
        raise ValueError(f"every prompt must be shorter than seq_len {seq_len}")
    settings = [SamplingConfig(temperature=0.0 if g else temperature) for _, g in prompts]
    plan = SamplingPlan.of(settings)
    padded = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, (ids, _) in enumerate(prompts):
        padded[row, : len(ids)] = ids
    parts = pathlib.Path(directory) / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    generator = Generator(target)
    starts = range(0, len(prompts), batch)
    for n, begin in enumerate(
        tqdm(starts, desc="continuations", unit="batch", disable=not progress)
    ):
        file = parts / f"{begin:08d}.npz"
        rows = np.arange(begin, begin + batch) % len(prompts)  # the last batch wraps round
        if file.exists():
            _check(file, padded[rows], lengths[rows])
            continue
        out = generator(
            padded[rows],
            prompt_lengths=lengths[rows],
            key=jax.random.fold_in(jax.random.key(seed), n),
            max_new_tokens=seq_len - int(lengths.min()),
            sampling=RowSampling.of([settings[r] for r in rows], plan),
        )
        new = np.asarray(out.tokens)
        tokens = np.stack(
            [
                np.concatenate([padded[r, : lengths[r]], t])[:seq_len]
                for r, t in zip(rows, new, strict=True)
            ]
        )
        tmp = file.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=tokens.astype(np.int32), start=lengths[rows].astype(np.int32))
        tmp.rename(file)
    loaded = [np.load(parts / f"{b:08d}.npz") for b in starts]
    windows = (np.concatenate([p[k] for p in loaded])[: len(prompts)] for k in Windows._fields)
    return Windows(*windows)


def _check(file: pathlib.Path, prompts: np.ndarray, lengths: np.ndarray) -> None:
    with np.load(file) as part:
        same = np.array_equal(part["start"], lengths) and all(
            np.array_equal(part["tokens"][j, :n], prompts[j, :n]) for j, n in enumerate(lengths)
        )
    if not same:
        raise ValueError(
            f"{file} holds other prompts than the ones asked for: the directory belongs to "
            "another data setting; use a new directory"
        )
