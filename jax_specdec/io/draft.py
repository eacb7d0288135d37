"""`load_draft`: a draft named by a path or a name, loaded for a target. The one place
that tells the kinds of draft files apart (the CLI, the batch job and `Generator` given
a path all come here); `decode.drafters.as_drafter` then attaches what it returns.
`load_pair` loads a target and its draft by name, as the commands do."""

from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

from jax_specdec.io.locate import locate

__all__ = ["Loaded", "context", "is_head", "load_draft", "load_pair"]


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


def load_draft(
    draft: str | os.PathLike,
    target,
    tokenizer=None,
    *,
    weights: bool = True,
    dtype=None,
    mesh=None,
):
    """The draft `draft` names, for `target`.

    Args:
      draft: "ngram" (prompt lookup, no model), a feature head's or an EAGLE-3 head's
        directory, or a draft model (a Hugging Face directory, a .gguf file, a zoo name).
      target: the target model (its config is what a head is checked against).
      tokenizer: the target's tokenizer, if known: a draft model's tokenizer and the one
        a feature head was trained with must be it.
      weights: False reads no draft model tensor (the model comes back abstract, as
        `io.hf.load_model(..., weights=False)`); heads, which are small, are read whole.
      dtype: a draft model's dtype (`io.hf.load_model`); heads keep their own.
      mesh: a draft model is loaded straight onto it (`io.hf.load_model`); a head, which
        is small, is placed by `Generator`.

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
    return load_model(path, weights=weights, dtype=dtype, mesh=mesh)


def _has_tokenizer(path: pathlib.Path) -> bool:
    return path.is_file() or (path / "tokenizer.json").is_file()


class Loaded(NamedTuple):
    """What `load_pair` loads: the target, the draft (`io.draft.load_draft`: a model, a
    feature or EAGLE-3 head, or `NGram`), the target's tokenizer and where the target was
    found."""

    target: Any
    draft: Any
    tokenizer: Any
    target_dir: pathlib.Path


def load_pair(target: str, draft: str, weights: bool = True, dtype=None, mesh=None) -> Loaded:
    """Loads --target and --draft (`io.draft.load_draft`: a model, a feature or EAGLE-3
    head's directory, or "ngram"), the draft checked against the target and its
    tokenizer. `weights=False` checks the same but reads no model tensor
    (`io.hf.load_model`): the models come back abstract (heads are read whole). `dtype`:
    the models' ("float32", "bfloat16"; None: `io.hf_config.default_dtype`). `mesh`: the models
    are loaded straight onto it (`io.onto_mesh`)."""
    from jax_specdec.io.hf import load_model, load_tokenizer

    target_dir = locate(target, "target")
    try:
        tokenizer = load_tokenizer(target_dir)
    except FileNotFoundError:
        raise ValueError(f"--target: {target_dir} has no tokenizer.json") from None
    model = load_model(target_dir, weights=weights, dtype=dtype, mesh=mesh)
    draft_model = load_draft(draft, model, tokenizer, weights=weights, dtype=dtype, mesh=mesh)
    return Loaded(model, draft_model, tokenizer, target_dir)


def context(target, draft) -> int:
    """The most tokens (prompt and generated) one row may hold: the smallest max_len of
    the target and of a draft that has one (a model or a head, not NGram)."""
    lengths = [target.config.max_len]
    config = getattr(draft, "config", None)
    config = getattr(config, "layer", config)  # a head's config holds its layer's
    if getattr(config, "max_len", None) is not None:
        lengths.append(config.max_len)
    return min(lengths)
