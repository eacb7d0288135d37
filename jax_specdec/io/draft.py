"""`load_draft`: a draft named by a path or a name, loaded for a target. The one place
that tells the kinds of draft files apart (the CLI, the batch job and `Generator` given
a path all come here); `decode.drafters.as_drafter` then attaches what it returns."""

from __future__ import annotations

import os
import pathlib

from jax_specdec.io.locate import locate

__all__ = ["is_head", "load_draft"]


def is_head(path: pathlib.Path) -> bool:
    """Whether `path` holds a head (a feature head, or an EAGLE-3 head in the
    speculators format or the EAGLE-3 release layout) rather than a model."""
    from jax_specdec.io import speculators
    from jax_specdec.io.heads import is_feature_head

    return path.is_dir() and (
        is_feature_head(path)
        or speculators.is_speculators(path)
        or speculators.is_eagle3_release(path)
    )


def load_draft(draft: str | os.PathLike, target, tokenizer=None, *, weights: bool = True):
    """The draft `draft` names, for `target`.

    Args:
      draft: "ngram" (prompt lookup, no model), a feature head's or an EAGLE-3 head's
        directory, or a draft model (a Hugging Face directory, a .gguf file, a zoo name).
      target: the target model (its config is what a head is checked against).
      tokenizer: the target's tokenizer, if known: a draft model's tokenizer and the one
        a feature head was trained with must be it.
      weights: False reads no draft model tensor (the model comes back abstract, as
        `io.hf.load_model(..., weights=False)`); heads, which are small, are read whole.

    Returns:
      `NGram()`, a `FeatureHead`, an `Eagle3Head` or a `Transformer`; `Generator` (through
      `decode.drafters.as_drafter`) attaches a head to the target.
    """
    if os.fspath(draft) == "ngram":
        from jax_specdec.decode.drafters.ngram import NGram

        return NGram()
    path = locate(draft, "draft")
    if is_head(path):
        from jax_specdec.io.heads import check_tokenizer, load_head

        head = load_head(path)
        check_tokenizer(head, tokenizer)
        return head
    from jax_specdec.io.hf import load_model, load_tokenizer

    if tokenizer is not None and _has_tokenizer(path):
        if load_tokenizer(path).to_str() != tokenizer.to_str():
            where = path if path.is_file() else path / "tokenizer.json"
            raise ValueError(f"the draft's tokenizer ({where}) differs from the target's")
    return load_model(path, weights=weights)


def _has_tokenizer(path: pathlib.Path) -> bool:
    return path.is_file() or (path / "tokenizer.json").is_file()
