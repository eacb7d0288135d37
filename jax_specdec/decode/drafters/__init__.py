"""Drafters: what proposes a round's tokens (the protocol in `base`).

- `base`: the `Drafter` protocol, its optional feature and tree parts, `DraftInputs`,
  `Proposal`.
- `draft_model`: `DraftModel` (a smaller model of the same tokenizer, sampled with its
  real q) and `EarlyExit` (it stops a row's drafting below a confidence threshold).
- `ngram`: `NGram`, prompt lookup without a model.
- `feature_head`: `HeadDrafter`, a head reading the target's top-layer features
  (`AttachedHead`, `attach_head`).
- `eagle3`: `Eagle3Drafter`, an EAGLE-3 head reading three target layers.
- `head_tree`: the token trees a head builds.
- `resolve`: `as_drafter`, the one place that decides what kind of draft a value is.
"""

from jax_specdec.decode.drafters.base import Drafter, DraftInputs, Proposal
from jax_specdec.decode.drafters.draft_model import DraftModel, EarlyExit
from jax_specdec.decode.drafters.eagle3 import Eagle3Drafter, attach_eagle3
from jax_specdec.decode.drafters.feature_head import AttachedHead, HeadDrafter, attach_head
from jax_specdec.decode.drafters.ngram import NGram
from jax_specdec.decode.drafters.resolve import Drafting, as_drafter, drafting_model, is_drafter

__all__ = [
    "AttachedHead",
    "DraftInputs",
    "DraftModel",
    "Drafting",
    "Drafter",
    "Eagle3Drafter",
    "EarlyExit",
    "HeadDrafter",
    "NGram",
    "Proposal",
    "as_drafter",
    "attach_eagle3",
    "attach_head",
    "drafting_model",
    "is_drafter",
]
