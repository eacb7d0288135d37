"""Opening a weights file, safetensors or GGUF, with one-line errors that name it.

Every loader reads weights through here (`open_safetensors`, and `check_weights_file`
inside `jax_specdec.io.gguf_file.open_gguf`), so a missing, empty, truncated or corrupt
file, or a git-lfs pointer left where the weights should be, is one `ValueError` (or
`FileNotFoundError`) naming the file, never a reader's traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import numpy as np

__all__ = ["WeightsError", "brief", "check_weights_file", "file_sha256", "open_safetensors"]

Path_ = str | os.PathLike
_LFS_POINTER = b"version https://git-lfs"


class WeightsError(ValueError):
    """A weights file that cannot be read; the message names the file."""


def brief(e: Exception) -> str:
    """`Type: first line` of an exception, for one-line messages."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def file_sha256(path: Path_) -> str:
    """The SHA-256 of the file at `path`, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_weights_file(path: Path_, what: str = "weights file") -> Path:
    """`path` as a Path, once it is known to be a non-empty file that is not a git-lfs
    pointer; else a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(len(_LFS_POINTER))
    if not head:
        raise WeightsError(f"{path}: the {what} is empty")
    if head == _LFS_POINTER:
        raise WeightsError(
            f"{path} is a git-lfs pointer, not the weights: fetch them with `git lfs pull`"
        )
    return path


class SafetensorsFile:
    """An open safetensors file: `keys()`, `shape(name)` and `get(name)`, each failing
    with one line naming the file (and the tensor)."""

    def __init__(self, path: Path, handle):
        self.path, self._handle = path, handle

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self._handle.get_slice(name).get_shape())
        except Exception as e:
            raise WeightsError(f"{self.path}: tensor {name} is unreadable ({brief(e)})") from e

    def get_slice(self, name: str, index: tuple) -> np.ndarray:
        """Tensor `name` at `index` (a tuple of slices), reading only those bytes."""
        try:
            return self._handle.get_slice(name)[index]
        except Exception as e:
            raise WeightsError(f"{self.path}: tensor {name} is unreadable ({brief(e)})") from e

    def get(self, name: str) -> np.ndarray:
        try:
            return self._handle.get_tensor(name)
        except Exception as e:  # an unsupported dtype, or data the header does not match
            raise WeightsError(f"{self.path}: tensor {name} is unreadable ({brief(e)})") from e


@contextlib.contextmanager
def open_safetensors(path: Path_):
    """A `SafetensorsFile` on `path` (memory-mapped), or a one-line error naming it."""
    from safetensors import safe_open

    path = check_weights_file(path, "safetensors file")
    try:
        handle = safe_open(str(path), framework="np")
    except Exception as e:  # SafetensorError for a truncated or corrupt header
        raise WeightsError(
            f"{path}: not a readable safetensors file, truncated or corrupt ({brief(e)})"
        ) from e
    with handle:
        yield SafetensorsFile(path, handle)
