"""Drafting with an EAGLE-3 head (`nn.eagle3`) inside the loop.

The head drafts as a feature head does (`decode.drafters.feature_head`, whose pending-token
convention, chunk of waiting features, γ = 0 steps, slots and trees it shares): only
the features differ. The target's calls (prefill, verify, plain steps) return the
hidden states of the head's target layers concatenated, [B, T, n·H]
(`Transformer.decode_entries(..., features=layer_ids)`), from the same pass and
without copying a cache. The head fuses them (`fc`) for the entries of verified
positions; from the second draft step on it is fed its own output hidden state, as
EAGLE-3 does.

q is the softmax over the K draft tokens' logits scattered to their target ids
(d + d2t[d]), -inf elsewhere, after each row's sampling transforms, so the acceptance
stays exact.
"""

from __future__ import annotations

import dataclasses
import os

from jax_specdec.decode.drafters.feature_head import AttachedHead, HeadDrafter, check_vocab_map
from jax_specdec.io.heads import load_head
from jax_specdec.io.speculators import check_target
from jax_specdec.nn import Transformer
from jax_specdec.nn.eagle3 import Eagle3Head, default_aux_layer_ids

__all__ = ["Eagle3Drafter", "attach_eagle3", "is_eagle3"]


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(HeadDrafter):
    """The drafter protocol for an `AttachedHead` holding an `Eagle3Head`: a
    `HeadDrafter` that asks the target for the layers `feature_layers`."""

    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.feature_layers:
            raise ValueError("Eagle3Drafter needs the target layers the head reads")


def is_eagle3(draft) -> bool:
    """Whether `draft` is an EAGLE-3 head, attached or not."""
    head = draft.head if isinstance(draft, AttachedHead) else draft
    return isinstance(head, Eagle3Head)


def attach_eagle3(
    head: Eagle3Head | AttachedHead | str | os.PathLike, target: Transformer
) -> tuple[Eagle3Drafter, AttachedHead]:
    """`head` (an `Eagle3Head`, one already attached, or a speculators-format or
    EAGLE-3 release directory to load) checked against `target`
    (`io.speculators.check_target`: hidden size, vocabulary, layers; ValueError naming
    the field) and attached to the token embedding it reads: its own when it stores
    one, else the target's (shared, not copied). Returns (drafter, attached head)."""
    if isinstance(head, AttachedHead):
        head = head.head
    if not isinstance(head, Eagle3Head):
        path = head
        head = load_head(path)
        if not isinstance(head, Eagle3Head):
            raise ValueError(f"{path} holds a {type(head).__name__}, not an EAGLE-3 head")
    config = head.config
    check_target(config, target.config)
    layers = config.aux_layer_ids or default_aux_layer_ids(target.config.num_layers)
    check_vocab_map(head, target.config.vocab_size, "the EAGLE-3 head")
    embed = head.embed[...] if head.embed is not None else target.embed.get_value()
    return Eagle3Drafter(feature_layers=tuple(layers)), AttachedHead(head, embed)
