"""Where a model named on the command line or in the Python API lives on disk: a local
directory or file, a zoo name, or a Hugging Face Hub id (`org/name`, optionally
`@revision`), fetched into the user's Hugging Face cache (`io.hub`)."""

from __future__ import annotations

import os
import pathlib

from jax_specdec.io.hub import hub_snapshot, is_hub_id

__all__ = ["locate"]

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


def locate(text: str | os.PathLike, which: str) -> pathlib.Path:
    """The model directory or file `text` names: a zoo name (`smollm2-135m`, fetched on
    first use) or a .gguf file as is; a directory as given, else relative to the
    installed checkout (so `models/...` works from anywhere); else a Hub id, its files
    fetched into the Hugging Face cache (`hub_snapshot`).

    Raises ValueError naming `which` (the flag or argument, e.g. "target") when `text`
    is no model directory (no config.json, no head config) and no Hub id."""
    from jax_specdec.io import zoo
    from jax_specdec.io.hf import is_gguf

    text = os.fspath(text)
    if text in zoo.MODELS or is_gguf(text):
        return pathlib.Path(zoo.resolve(text))
    path = pathlib.Path(text)
    if not path.exists() and (CHECKOUT / text).is_dir():
        path = CHECKOUT / text
    if not path.exists() and is_hub_id(text):
        path = hub_snapshot(text, which)
    if not (path / "config.json").is_file() and not (path / "head_config.json").is_file():
        raise ValueError(f"--{which}: {text} is not a model directory (no config.json)")
    return path
