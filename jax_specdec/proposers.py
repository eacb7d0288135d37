"""Model-free proposers (kept for imports written before `jax_specdec.decode.ngram`)."""

from jax_specdec.decode.ngram import NGram

__all__ = ["NGram"]
