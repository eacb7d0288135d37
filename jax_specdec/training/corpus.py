"""The training corpus and tokenizer of the shipped models.

Corpus: the Python standard library's own source files, available offline on every
machine that runs Python. Which files (and the Python version) is recorded in the
model card, since another Python release ships different sources. Files are split
into train and validation by a hash of their relative path, so the split does not
move when files are added or removed.

Tokenizer: a byte-level BPE trained with the `tokenizers` library.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys
import sysconfig
from typing import NamedTuple

import numpy as np

__all__ = [
    "Corpus",
    "stdlib_corpus",
    "train_tokenizer",
    "encode_files",
    "sample_windows",
]

_EXCLUDED_PARTS = {
    "test",
    "tests",
    "site-packages",
    "dist-packages",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "tkinter",
    "__pycache__",
}
_MAX_FILE_BYTES = 400_000  # very large generated tables teach little


class Corpus(NamedTuple):
    """Train and validation file lists (relative to `root`) and the Python version."""

    root: pathlib.Path
    train: list[str]
    validation: list[str]
    python_version: str

    def read(self, names: list[str]) -> list[str]:
        return [(self.root / n).read_text(encoding="utf-8", errors="replace") for n in names]


def _is_validation(name: str, fraction: float) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def stdlib_corpus(validation_fraction: float = 0.05, root: str | None = None) -> Corpus:
    """The standard library's .py files (tests, IDLE, tkinter and vendored code excluded)."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {base}")
    names = sorted(
        str(p.relative_to(base))
        for p in base.rglob("*.py")
        if not (_EXCLUDED_PARTS & set(p.relative_to(base).parts))
        and p.stat().st_size <= _MAX_FILE_BYTES
    )
    validation = [n for n in names if _is_validation(n, validation_fraction)]
    train = [n for n in names if not _is_validation(n, validation_fraction)]
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(base, train, validation, version)


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) with an `<|endoftext|>` token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_files(tokenizer, texts: list[str]) -> np.ndarray:
    """One int32 token stream: each file's tokens followed by `<|endoftext|>` (id 0)."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    pieces = []
    for enc in tokenizer.encode_batch(texts):
        pieces.append(np.asarray(enc.ids, np.int32))
        pieces.append(np.array([eot], np.int32))
    return np.concatenate(pieces)


def sample_windows(stream: np.ndarray, *, batch: int, length: int, seed: int, step: int):
    """Batch `step` of random windows [batch, length + 1]; depends only on (seed, step).

    So a resumed run sees exactly the batches an uninterrupted one would.
    """
    if stream.size <= length + 1:
        raise ValueError(
            f"token stream of {stream.size} tokens is too short for windows of {length}"
        )
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - length - 1, size=batch)
    return np.stack([stream[s : s + length + 1] for s in starts])
