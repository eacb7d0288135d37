"""Training data of a feature head: windows of text with the frozen target's features.

For each window of tokens x_0 … x_{T-1} the target gives its features f_0 … f_{T-1}
(top layer, after the final norm) and its greedy next tokens g_0 … g_{T-1} (g_i, the
argmax of its logits at position i, is what a first draft at i must guess). The text
is either corpus text as it is, or the target's own greedy continuations of corpus
prompts (what it will verify at decoding time).

Extraction is slow on a CPU, so it is written to disk in parts (`parts/*.npz`) and
resumes where it stopped; `load_features` concatenates the parts.
"""

from __future__ import annotations

import functools
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "FeatureSet",
    "extract_features",
    "greedy_continuations",
    "kept_vocabulary",
    "load_features",
    "spread_windows",
    "windows_of",
]


class FeatureSet(NamedTuple):
    """Windows [N, T] of tokens, the target's features [N, T, D] (float16) and its
    greedy next tokens [N, T]; for an EAGLE-3 head also the hidden states of the layers
    it reads, concatenated [N, T, n·D] (float16); for prompted data the position of each
    window's first generated token [N] (entries before it are the prompt's).
    """

    tokens: np.ndarray
    features: np.ndarray
    greedy: np.ndarray
    aux: np.ndarray | None = None
    start: np.ndarray | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]


def windows_of(stream: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
    """Non-overlapping windows [N, length] of a token stream (at most `limit` tokens)."""
    stream = stream if limit is None else stream[:limit]
    count = stream.size // length
    if count < 1:
        raise ValueError(f"a stream of {stream.size} tokens has no window of {length}")
    return stream[: count * length].reshape(count, length).astype(np.int32)


def spread_windows(stream: np.ndarray, length: int, limit: int) -> np.ndarray:
    """max(1, `limit // length`) non-overlapping windows spaced evenly over the whole
    stream (every file region represented), or all of them if the stream is shorter."""
    windows = windows_of(stream, length)
    count = max(limit // length, 1)
    if count >= len(windows):
        return windows
    return windows[np.linspace(0, len(windows) - 1, count).round().astype(int)]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(graphdef, state, tokens, aux_layers):
    """(top-layer features after the final norm, greedy tokens, the `aux_layers`' hidden
    states concatenated or an empty array)."""
    model = nnx.merge(graphdef, state)
    top = model.config.num_layers
    logits, taken = model(tokens, features=(*aux_layers, top))
    width = model.config.d_model
    features = model.final_norm(taken[..., -width:])
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return features.astype(jnp.float16), greedy, taken[..., :-width].astype(jnp.float16)


def extract_features(
    target,
    windows: np.ndarray,
    directory,
    *,
    batch: int = 8,
    progress: bool = True,
    aux_layers: tuple[int, ...] = (),
    start: np.ndarray | None = None,
) -> FeatureSet:
    """Runs the frozen target over `windows` [N, T], `batch` at a time, saving each
    batch to `directory/parts/` (a part already there is not computed again); with
    `aux_layers` (layer ids, as `Transformer` takes them) their hidden states too, and
    with `start` [N] each window's first generated position."""
    if len(windows) < 1:
        raise ValueError("no windows to extract features from")
    from tqdm.auto import tqdm

    parts = pathlib.Path(directory) / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    graphdef, state = nnx.split(target)
    starts = range(0, len(windows), batch)  # the last batch may be smaller
    bar = tqdm(starts, desc="features", unit="batch", disable=not progress)
    for begin in bar:
        file = parts / f"{begin:08d}.npz"
        if file.exists():
            _check_part(file, windows[begin : begin + batch], bool(aux_layers))
            continue
        tokens = windows[begin : begin + batch]
        features, greedy, aux = _forward(graphdef, state, jnp.asarray(tokens), aux_layers)
        arrays = dict(tokens=tokens, features=np.asarray(features), greedy=np.asarray(greedy))
        if aux_layers:
            arrays["aux"] = np.asarray(aux)
        if start is not None:
            arrays["start"] = np.asarray(start[begin : begin + batch], np.int32)
        tmp = file.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.rename(file)  # a killed run leaves no half-written part
        bar.set_postfix(tokens=(begin + len(tokens)) * windows.shape[1])
    extra = {f.name for f in parts.glob("*[0-9].npz")} - {f"{s:08d}.npz" for s in starts}
    if extra:
        raise ValueError(
            f"{parts} holds {len(extra)} parts beyond the {len(windows)} windows asked for"
            + _OTHER_SETTING
        )
    return load_features(directory)


_OTHER_SETTING = ": the directory belongs to another data setting; use a new directory"


def _check_part(file: pathlib.Path, tokens: np.ndarray, aux: bool) -> None:
    with np.load(file) as part:
        if not np.array_equal(part["tokens"], tokens):
            raise ValueError(f"{file} holds other windows than the ones asked for" + _OTHER_SETTING)
        if aux != ("aux" in part.files):
            raise ValueError(
                f"{file} was extracted {'without' if aux else 'with'} the hidden states of an "
                f"EAGLE-3 head's layers" + _OTHER_SETTING
            )


def load_features(directory) -> FeatureSet:
    """The parts under `directory/parts`, concatenated in order."""
    files = sorted((pathlib.Path(directory) / "parts").glob("*[0-9].npz"))
    if not files:
        raise FileNotFoundError(f"no feature parts under {directory}/parts")
    loaded = [np.load(f) for f in files]
    fields = [k for k in FeatureSet._fields if k in loaded[0].files]
    return FeatureSet(**{k: np.concatenate([p[k] for p in loaded]) for k in fields})


def greedy_continuations(
    target, prompts: np.ndarray, new_tokens: int, *, batch: int = 16, progress: bool = True
) -> np.ndarray:
    """The target's greedy continuations: [N, P + new_tokens], each prompt [N, P]
    followed by what the target writes after it (autoregressive, no EOS)."""
    from tqdm.auto import tqdm

    from jax_specdec.decode import Generator

    generator = Generator(target)
    rows = []
    for start in tqdm(range(0, len(prompts), batch), desc="continuations", disable=not progress):
        chunk = prompts[start : start + batch]
        out = generator(chunk.tolist(), key=jax.random.key(0), max_new_tokens=new_tokens)
        rows.append(np.concatenate([chunk, np.asarray(out.tokens)], axis=1))
    return np.concatenate(rows).astype(np.int32)


def kept_vocabulary(data: FeatureSet, size: int, vocab_size: int) -> np.ndarray:
    """The `size` token ids most frequent among the windows' tokens and the target's
    greedy choices (ties to the lower id), sorted by id: a head's vocab_map."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"kept vocabulary size must lie in [1, {vocab_size}], got {size}")
    counts = np.bincount(data.tokens.reshape(-1), minlength=vocab_size)
    counts = counts + np.bincount(data.greedy.reshape(-1), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size]).astype(np.int32)
