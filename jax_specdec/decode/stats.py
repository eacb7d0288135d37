"""What a generation call returns: the tokens, their lengths and per-row statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
    "ROW_FIELDS",
    "GenerationOutput",
    "GenerationStats",
    "init_stats",
    "nonfinite",
    "take_rows",
]

# The per-row counters of `GenerationStats` (the others count the whole batch).
ROW_FIELDS = (
    "rounds",
    "drafted",
    "accepted",
    "rejected",
    "drafted_at",
    "accepted_at",
    "rejected_at",
    "tree_accepted_at",
    "tree_rejected_at",
    "rank_tested",
    "rank_kept",
    "nonfinite",
)


@struct.dataclass
class GenerationStats:
    """Per-row counters of one generation call (arrays on device).

    Attributes:
      rounds: [B] rounds (target calls after the prefill) in which the row was active.
      target_calls: [] target forward calls of the whole batch, prefill included.
      drafted: [B] drafted tokens.
      accepted: [B] drafted tokens accepted.
      rejected: [B] rounds that ended with a drafted token rejected.
      drafted_at: [B, γ_max] rounds in which the row drafted a token at position i
        (0-based); the acceptance rate at position i is accepted_at / drafted_at.
      accepted_at: [B, γ_max] rounds in which draft position i was accepted.
      rejected_at: [B, γ_max] rounds whose first rejection was at draft position i, so
        the acceptance of position i given that the drafts before it were accepted is
        accepted_at / (accepted_at + rejected_at). The three are empty for
        autoregressive decoding.
      tree_accepted_at, tree_rejected_at: [B, D] as accepted_at and rejected_at, for
        the tree rounds of `schedules.Auto` with a tree in its menu (D its depth; the
        walk's step i); [B, 0] otherwise. Those rounds are counted here, not in the
        chains' positions.
      gamma_rounds: [γ_max + 1] rounds of the whole batch run with each draft width
        (0: a plain target step); one more, last, for the tree rounds of `Auto` with a
        tree in its menu.
      rank_tested, rank_kept: [B, D, K] for tree rounds (a fixed tree, or `Auto`'s
        menu tree; K its branch): at the walk's step d, how often the child of rank j
        (its place among its siblings, for a sampled tree the drawing order) was tested,
        and kept (`decode.tree.rank_counts`); [B, 0, 0] without trees.
        `rank_acceptance` is their ratio, what a sampled tree's shape is grown from
        (`decode.tree_accept.static_shape`).
      nonfinite: [B] whether the row ever met a NaN/inf logit (its tokens are then not
        to be trusted; a warning is raised too).
      slot_rounds: [] rows of the batch times rounds run (the work the rows could have
        done); `occupancy` is the fraction of it that generated.
    """

    rounds: jax.Array
    target_calls: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    drafted_at: jax.Array
    accepted_at: jax.Array
    rejected_at: jax.Array
    tree_accepted_at: jax.Array
    tree_rejected_at: jax.Array
    rank_tested: jax.Array
    rank_kept: jax.Array
    gamma_rounds: jax.Array
    nonfinite: jax.Array
    slot_rounds: jax.Array

    @property
    def occupancy(self) -> float:
        """Fraction of row-rounds in which the row was active: 1 when no row of the
        batch (or no slot) ever waits for the others."""
        return float(jnp.sum(self.rounds) / jnp.maximum(self.slot_rounds, 1))

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted, over the whole batch.

        It falls with γ even at a constant per-token acceptance, since drafts after a
        rejection count as drafted; `alpha` does not.
        """
        return float(jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.drafted), 1))

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability α (the i.i.d. model of docs/design.md), estimated as
        accepted / (accepted + rejections): each round tests drafts up to its first
        rejection, if any (the maximum-likelihood estimate for geometric run lengths).
        """
        if self.accepted_at.shape[1] == 0:
            return float("nan")
        accepted = jnp.sum(self.accepted)
        return float(accepted / jnp.maximum(accepted + jnp.sum(self.rejected), 1))

    def tokens_per_round(self, lengths: jax.Array) -> float:
        """Mean tokens emitted per round (the prefill's first token not counted)."""
        return float(jnp.sum(lengths - 1) / jnp.maximum(jnp.sum(self.rounds), 1))

    def acceptance_at(self) -> np.ndarray:
        """[γ_max] acceptance rate of each draft position over the batch (NaN if unused)."""
        return _share(jnp.sum(self.accepted_at, axis=0), jnp.sum(self.drafted_at, axis=0))

    def conditional_acceptance_at(self) -> np.ndarray:
        """[γ_max] acceptance of each draft position given that the drafts before it were
        accepted, over the batch (NaN if never reached). Constant under the i.i.d. model
        of docs/design.md; it is what `schedules.CostModel` estimates per row."""
        accepted = jnp.sum(self.accepted_at, axis=0)
        return _share(accepted, accepted + jnp.sum(self.rejected_at, axis=0))

    def rank_acceptance(self) -> np.ndarray:
        """[D, K] over the batch: the chance that a tree node at depth d keeps its child
        of rank j once it has rejected the ones before it (NaN where never tested)."""
        return _share(jnp.sum(self.rank_kept, axis=0), jnp.sum(self.rank_tested, axis=0))

    @staticmethod
    def merge(stats: Sequence[GenerationStats]) -> GenerationStats:
        """The counters of several calls as one (rows concatenated, batch counts summed)."""
        if not stats:
            raise ValueError("merge needs at least one GenerationStats")
        if len({s.tree_accepted_at.shape[-1] for s in stats}) > 1:
            raise ValueError(
                "merge: the calls' menus differ (a tree on auto's menu in some of them): "
                "their rounds per width do not add up"
            )
        if len({s.rank_tested.shape[1:] for s in stats}) > 1:
            raise ValueError("merge: the calls' trees differ in depth or branch")
        fields = {k: jnp.concatenate([getattr(s, k) for s in stats]) for k in ROW_FIELDS}
        fields["target_calls"] = sum(s.target_calls for s in stats)
        fields["slot_rounds"] = sum(s.slot_rounds for s in stats)
        width = max(s.gamma_rounds.shape[0] for s in stats)
        fields["gamma_rounds"] = sum(
            jnp.pad(s.gamma_rounds, (0, width - s.gamma_rounds.shape[0])) for s in stats
        )
        return GenerationStats(**fields)


def _share(part, whole) -> np.ndarray:
    """part / whole elementwise, as float64; NaN where whole is 0 (nothing counted)."""
    part, whole = np.asarray(part, np.float64), np.asarray(whole, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(whole > 0, part / whole, np.nan)


class GenerationOutput(NamedTuple):
    """What a generation call returns.

    Attributes:
      tokens: [B, max_new_tokens] int32 generated tokens, `pad_token_id` after each
        row's end.
      lengths: [B] int32 generated tokens per row (max_new_tokens unless the row hit EOS,
        which is included).
      stats: `GenerationStats`.
      logprobs: the tokens' log-probabilities (`decode.logprobs.Logprobs`, [B,
        max_new_tokens], values after each row's end undefined) when asked for; else None.
    """

    tokens: jax.Array
    lengths: jax.Array
    stats: GenerationStats
    logprobs: Any = None


def init_stats(
    batch: int,
    gamma_max: int,
    nonfinite_rows: jax.Array,
    tree_depth: int = 0,
    ranks: tuple[int, int] = (0, 0),
) -> GenerationStats:
    """Counters before the first round: one target call (the prefill) and its NaN flags;
    `tree_depth`: the depth of a tree in `Auto`'s menu (0: none); `ranks`: (depth,
    branch) of the rounds' tree, fixed or on the menu ((0, 0): none)."""
    zeros = jnp.zeros((batch,), jnp.int32)
    per_position = jnp.zeros((batch, gamma_max), jnp.int32)
    per_depth = jnp.zeros((batch, tree_depth), jnp.int32)
    return GenerationStats(
        rounds=zeros,
        target_calls=jnp.ones((), jnp.int32),
        drafted=zeros,
        accepted=zeros,
        rejected=zeros,
        drafted_at=per_position,
        accepted_at=per_position,
        rejected_at=per_position,
        tree_accepted_at=per_depth,
        tree_rejected_at=per_depth,
        rank_tested=jnp.zeros((batch, *ranks), jnp.int32),
        rank_kept=jnp.zeros((batch, *ranks), jnp.int32),
        gamma_rounds=jnp.zeros((gamma_max + 1 + (tree_depth > 0),), jnp.int32),
        nonfinite=nonfinite_rows,
        slot_rounds=jnp.zeros((), jnp.int32),
    )


def nonfinite(logits: jax.Array) -> jax.Array:
    """[B] whether a row's logits [B, ...] hold a NaN or inf."""
    return ~jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


def take_rows(out: GenerationOutput, rows: jax.Array) -> GenerationOutput:
    """The output's rows `rows` [R] (tokens, lengths, log-probabilities and the per-row
    counters)."""
    stats = out.stats.replace(**{f: getattr(out.stats, f)[rows] for f in ROW_FIELDS})
    logprobs = None if out.logprobs is None else jax.tree.map(lambda a: a[rows], out.logprobs)
    return GenerationOutput(out.tokens[rows], out.lengths[rows], stats, logprobs)


def finish_reasons(out: GenerationOutput, budgets, stop_ids, stop_sequences=None) -> list[str]:
    """Why each row ended (host side): "eos" when its last token is one of `stop_ids` (a
    stop id ends a row and is kept), "stop" when its tokens end with one of its own
    `stop_sequences` (one list per row, `Generator(stop_sequences=...)`), else "length"
    (its budget, an int or one per row)."""
    lengths, tokens = np.asarray(out.lengths), np.asarray(out.tokens)
    budgets = np.broadcast_to(np.asarray(budgets), lengths.shape)
    stops = set(stop_ids or ())
    sequences = [()] * len(lengths) if stop_sequences is None else stop_sequences
    reasons = []
    for row, n, budget, own in zip(tokens, lengths, budgets, sequences, strict=True):
        ids = row[:n].tolist()
        if ids and ids[-1] in stops:
            reasons.append("eos")
        elif any(len(s) <= n and ids[n - len(s) :] == list(s) for s in own):
            reasons.append("stop")
        else:
            reasons.append("eos" if n < budget else "length")
    return reasons
