"""Opening a GGUF file: a memory-mapped `gguf.GGUFReader` and its metadata fields, with
one-line errors that name the file. The model import (`jax_specdec.io.gguf`) and the
tokenizer import (`jax_specdec.io.gguf_tokenizer`) both read through it."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from jax_specdec.io.weights import WeightsError, brief, check_weights_file

__all__ = ["GGUFError", "brief", "field", "open_gguf"]

Path_ = str | os.PathLike


class GGUFError(WeightsError):
    """A GGUF file that cannot be read or is not supported; the message names the file."""


def open_gguf(path: Path_):
    """A `gguf.GGUFReader` on `path` (memory-mapped), or a one-line error naming the file.

    The last reader is reused while the file is unchanged (parsing the metadata of a
    50k-token vocabulary takes seconds; the model and its tokenizer both need it).
    """
    path = check_weights_file(path, "GGUF file")
    stat = path.stat()
    return _reader(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _reader(path: Path, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises assorted errors on corrupt input
        raise GGUFError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({brief(e)})"
        ) from e


def field(reader, key: str, default: Any = ...) -> Any:
    """The value of metadata field `key` (str, number, bool or list); `default` if absent."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GGUFError(f"{reader.data.filename}: metadata field {key!r} is missing")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise GGUFError(f"{reader.data.filename}: metadata field {key!r} is corrupt") from e
