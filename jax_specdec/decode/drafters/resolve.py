"""What kind of draft a value is, decided in one place: `as_drafter`.

A `Generator`'s `draft` may be a draft model (`nn.Transformer`), a feature head or an
EAGLE-3 head (attached to the target here, once), a drafter object of the protocol
(`NGram()`, or a user's own, passed through unchanged), a `(drafter, model)` pair for
a user's drafter that drafts with a model of its own, or a path or name that
`io.draft.load_draft` loads ("ngram", a model or head directory, a .gguf file, a zoo
name).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from jax_specdec.decode.drafters.draft_model import DraftModel, EarlyExit
from jax_specdec.decode.drafters.eagle3 import attach_eagle3, is_eagle3
from jax_specdec.decode.drafters.feature_head import AttachedHead, HeadDrafter, attach_head
from jax_specdec.decode.request import check_int
from jax_specdec.nn import Transformer
from jax_specdec.nn.eagle3 import Eagle3Head
from jax_specdec.nn.feature_head import FeatureHead
from jax_specdec.schedules import Confidence, Constant

__all__ = ["Drafting", "as_drafter", "drafting_model", "is_drafter"]

PROTOCOL = ("init", "prepare", "propose", "commit", "load")


class Drafting(NamedTuple):
    """How a Generator drafts: the drafter (static, hashable), the model it drafts with
    (None for a model-free drafter), the vocabulary target and drafter share, and the
    schedule (a `Confidence` becomes the constant γ of an `EarlyExit` drafter)."""

    drafter: Any
    model: Any
    vocab_size: int
    schedule: Any


def is_drafter(value) -> bool:
    """Whether `value` implements the drafter protocol (`drafters.base.Drafter`)."""
    return all(callable(getattr(value, name, None)) for name in PROTOCOL)


def as_drafter(draft, target: Transformer, *, schedule, vocab_size=None) -> Drafting:
    """The `Drafting` for `draft` (see the module docstring) drafting for `target` under
    `schedule`; `vocab_size` is only for a draft model whose vocabulary is padded.

    Raises TypeError for a value of no known kind, ValueError for a draft that does not
    fit the target or the schedule (naming the argument)."""
    if isinstance(draft, str | os.PathLike):
        from jax_specdec.io.draft import load_draft

        draft = load_draft(draft, target)
    threshold = None
    if isinstance(schedule, Confidence):  # a way of drafting: γ_max, cut short per row
        threshold, schedule = schedule.threshold, Constant(schedule.max_gamma)
    if isinstance(draft, Transformer):
        vocab = _shared_vocab(target, draft, vocab_size)
        catch_up = schedule.min_gamma == 0  # γ = 0 rounds: the draft cache may lag
        drafter = DraftModel(catch_up) if threshold is None else EarlyExit(catch_up, threshold)
        return Drafting(drafter, draft, vocab, schedule)
    if vocab_size is not None:
        raise ValueError("vocab_size is only for a draft model (a Transformer)")
    if threshold is not None:
        raise ValueError(
            f"Confidence needs a draft model's probabilities; the draft "
            f"({type(draft).__name__}) has none (use an int γ, Heuristic, CostModel or Custom)"
        )
    drafter, model = _drafter_and_model(draft, target)
    return Drafting(drafter, model, target.config.vocab_size, schedule)


def drafting_model(draft, target: Transformer):
    """The model `draft` drafts with for `target` (a head attached to it, a draft model as
    it is), or `draft` itself for a model-free drafter: what the benchmarks time."""
    model = as_drafter(draft, target, schedule=Constant(1)).model
    return draft if model is None else model


def _drafter_and_model(draft, target):
    if isinstance(draft, FeatureHead | AttachedHead | Eagle3Head):
        if is_eagle3(draft):
            return attach_eagle3(draft, target)
        if isinstance(draft, FeatureHead):
            draft = attach_head(draft, target)
        return HeadDrafter(), draft
    model = None
    if isinstance(draft, tuple) and len(draft) == 2 and is_drafter(draft[0]):
        draft, model = draft
    if not is_drafter(draft):
        raise TypeError(
            "draft must be a draft model (jax_specdec.nn.Transformer), a feature or EAGLE-3 "
            "head, a drafter with the methods " + ", ".join(PROTOCOL) + " (such as NGram()), "
            f"a (drafter, model) pair, or a path; got {type(draft).__name__}"
        )
    try:
        hash(draft)
    except TypeError:
        raise TypeError(
            f"a drafter is a static part of the compiled program and must be hashable (a "
            f"frozen dataclass, say); {type(draft).__name__} is not"
        ) from None
    return draft, model


def _shared_vocab(target, draft, vocab_size) -> int:
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vocab_size is None:
        if vt != vd:
            raise ValueError(
                f"target and draft vocabularies differ ({vt} vs {vd}); if one is only padded "
                "beyond the tokenizer's vocabulary, pass vocab_size=<the tokenizer's size>"
            )
        return vt
    vocab_size = check_int("vocab_size", vocab_size, 1)
    if vocab_size > min(vt, vd):
        raise ValueError(f"vocab_size ({vocab_size}) exceeds a model's vocabulary ({vt}, {vd})")
    return vocab_size
