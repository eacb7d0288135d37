"""Where a model named on the command line or in the Python API lives on disk."""

from __future__ import annotations

import os
import pathlib

__all__ = ["locate"]

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


def locate(text: str | os.PathLike, which: str) -> pathlib.Path:
    """The model directory or file `text` names: a zoo name (`smollm2-135m`, fetched on
    first use) or a .gguf file as is; a directory as given, else relative to the
    installed checkout (so `models/...` works from anywhere).

    Raises ValueError naming `which` (the flag or argument, e.g. "target") when `text`
    is no model directory (no config.json, no head config)."""
    from jax_specdec.io import zoo
    from jax_specdec.io.hf import is_gguf

    text = os.fspath(text)
    if text in zoo.MODELS or is_gguf(text):
        return pathlib.Path(zoo.resolve(text))
    path = pathlib.Path(text)
    if not path.is_dir() and (CHECKOUT / text).is_dir():
        path = CHECKOUT / text
    if not (path / "config.json").is_file() and not (path / "head_config.json").is_file():
        raise ValueError(f"--{which}: {text} is not a model directory (no config.json)")
    return path
