"""The drafter protocol: how a round gets its proposed tokens.

A drafter is a frozen, hashable object (a static part of `LoopConfig`); the model it
drafts with, if any, is passed to its methods as an argument. Each round calls:

1. `prepare(model, cache, inputs, config)` once, before the round's `lax.switch`
   over widths: bring its cache up to date, or draft at the widest γ if the drafter
   decides itself how far to draft (n-gram lookup, early exit). It returns the cache,
   whatever `propose` needs, and `cap` [B], the most tokens each row can propose
   (None: as many as the schedule asks).
2. `propose(model, cache, inputs, prepared, width, config)` inside the switch, at a
   static width w >= 0: up to w tokens per row with their q (None for deterministic
   proposers), and the cache entries to write after the round. It only reads the
   cache: a cache that is an output of a conditional would be copied by XLA.
3. `commit(cache, prepared, entries, before, after, width, config)` after the switch:
   writes the entries, and sets the cache's valid length from the round's outcome.

With slots (`num_slots`), a slot whose row has finished takes the next prompt inside
the loop: `load(model, cache, slot, prompt, prompt_length, config)` resets row `slot`
of the cache to that one prompt ([1, P], length [1]), as `init` would have made it.

A drafter whose `reads_features` attribute is true also gets the target's features
(its top layer's hidden states after the final norm, `Transformer.decode_entries(...,
features=True)`): `init(..., features=[B, P, D])` and `load(..., features=[1, P, D])`
for the prompt, and `commit(..., features=[B, γ_max + 1, D])` for the positions
`before - 1 …` the round verified (the first `after - before + 1` are the accepted ones
and the position of the correction). When every active row is given γ = 0 the loop
runs plain target steps instead of rounds, and after each one
`absorb(model, cache, tokens, before, after, features)` takes the feature [B, 1, D] of
position `before - 1` (the rows' lengths went from `before` to `after`). A drafter
whose `feature_layers` is a tuple of layer ids gets those layers' hidden states
concatenated instead ([…, n·D], as an EAGLE-3 head reads them; `target_features`).

A drafter that builds token trees (`Generator(tree=...)`) also has
`propose_tree(model, cache, inputs, prepared, tree, config)`, returning a
`decode.tree.TreeProposal` (nodes, parents, validity, and q per node for a sampled
tree), and may refuse a shape it cannot fill in `check_tree(tree)`.

`TreeDrafter` and `FeatureDrafter` below spell these optional parts out. The draft model,
its early-exit form (`Confidence`), the n-gram proposer and the heads are drafters; so is
any object of yours with these methods (`Generator` passes it through unchanged; see
`decode.drafters.resolve`). A schedule only picks γ.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from jax_specdec.sampling import RowSampling

__all__ = [
    "DraftInputs",
    "Drafter",
    "FeatureDrafter",
    "Proposal",
    "TreeDrafter",
    "reads_features",
    "target_features",
]


def reads_features(drafter) -> bool:
    """Whether the drafter takes the target's features (see the module docstring)."""
    return bool(getattr(drafter, "reads_features", False))


def target_features(drafter):
    """What the target's calls return for the drafter (`Transformer.decode_entries`'s
    `features`): False, True (the top layer after the final norm) or layer ids."""
    if not reads_features(drafter):
        return False
    return getattr(drafter, "feature_layers", None) or True


class DraftInputs(NamedTuple):
    """What a drafter sees of the loop.

    Attributes:
      tokens: [B, L] int32, each row's prompt + generated tokens.
      lengths: [B] int32, valid tokens per row (the last one pending).
      done: [B] bool, finished rows (their proposals are ignored).
      keys: [B, γ_max] one key per draft step (int32 zeros under greedy decoding).
      want: [] int32, the widest γ the schedule asked of an active row this round.
      sampling: each row's sampling setting (`RowSampling`), which q is computed with.
    """

    tokens: jax.Array
    lengths: jax.Array
    done: jax.Array
    keys: jax.Array
    want: jax.Array
    sampling: RowSampling


class Proposal(NamedTuple):
    """A round's proposal at static width w.

    Attributes:
      tokens: [B, w] int32 proposed tokens.
      probs: [B, w, V] float32 q, the distribution each token was drawn from (after the
        target's sampling transforms), or None: q is one-hot on the token.
      bad: [B] bool, the drafter met NaN/inf logits.
      entries: the drafter's new cache entries, handed to `commit` (None if none).
    """

    tokens: jax.Array
    probs: jax.Array | None
    bad: jax.Array
    entries: Any = None


class Drafter(Protocol):
    """See the module docstring. `cache` is any pytree (None for a stateless drafter)."""

    def init(self, model, prompts, prompt_lengths, config) -> Any:
        """The drafter's cache after the prompts [B, P] (lengths [B])."""

    def prepare(self, model, cache, inputs: DraftInputs, config) -> tuple[Any, Any, Any]:
        """(cache, prepared, cap [B] or None), before the round's switch."""

    def propose(self, model, cache, inputs: DraftInputs, prepared, width: int, config) -> Proposal:
        """Up to `width` tokens per row, on a read-only cache."""

    def commit(self, cache, prepared, entries, before, after, width, config) -> Any:
        """The cache after the round: `before` and `after` are the rows' lengths [B],
        `width` [] the round's width (0: nothing was drafted)."""

    def load(self, model, cache, slot, prompt, prompt_length, config) -> Any:
        """The cache with row `slot` ([] int32) holding only `prompt` [1, P]."""


class TreeDrafter(Drafter, Protocol):
    """A drafter that also builds token trees."""

    def propose_tree(self, model, cache, inputs: DraftInputs, prepared, tree, config) -> Any:
        """A `decode.tree.TreeProposal` of `tree.nodes` nodes up to `tree.depth` deep."""

    def check_tree(self, tree) -> None:
        """Optional: a ValueError for a tree shape the drafter cannot fill."""


class FeatureDrafter(Drafter, Protocol):
    """A drafter that reads the target's features (`reads_features = True`; the
    `features=` arguments of the module docstring)."""

    reads_features: bool
    feature_layers: tuple[int, ...] | None  # None or (): the top layer after the final norm

    def init(self, model, prompts, prompt_lengths, config, *, features) -> Any:
        """As `Drafter.init`, with the prompts' features [B, P, D]."""

    def load(self, model, cache, slot, prompt, prompt_length, config, *, features) -> Any:
        """As `Drafter.load`, with the prompt's features [1, P, D]."""

    def commit(self, cache, prepared, entries, before, after, width, config, *, features) -> Any:
        """As `Drafter.commit`, with the verified positions' features [B, γ_max + 1, D]."""

    def absorb(self, model, cache, tokens, before, after, features) -> Any:
        """After a plain target step: the feature [B, 1, D] of position `before - 1`."""
