"""What every schedule shares: the statistics it sees, and the check the loop applies."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["ScheduleStats", "check_gamma"]


class ScheduleStats(NamedTuple):
    """What a schedule sees before each round (all on device).

    Attributes:
      round: [] int32, rounds run so far (0 at the first decision).
      active: [B] bool, rows still generating.
      generated: [B] int32, tokens generated so far (the prefill's first token counted).
      remaining: [B] int32, tokens the row may still generate (max_new_tokens −
        generated; 0 once done; an EOS may end it sooner).
      rounds: [B] int32, rounds in which the row was active.
      drafted: [B] int32, tokens the row drafted so far.
      accepted: [B] int32, drafted tokens accepted so far.
      rejected: [B] int32, rounds that ended in a rejection (the α estimate is
        accepted / (accepted + rejected)).
      accepted_at: [B, max_gamma] int32, rounds in which draft position i (0-based)
        was accepted.
      rejected_at: [B, max_gamma] int32, rounds whose first rejection was at position
        i; accepted_at / (accepted_at + rejected_at) estimates the acceptance of
        position i given the drafts before it were accepted.
      last_gamma: [B] int32, tokens the row drafted in the previous round (0 before
        the first round).
      last_accepted: [B] int32, how many of them were accepted.
      tree_accepted_at, tree_rejected_at: [B, D] the same for the tree rounds of
        `Auto` with a tree in its menu (D its depth; [B, 0] without).
      auto: what `Auto` chooses from (`schedules.auto.AutoInputs`: round costs and
        prior acceptance, an input of the program, not part of it); None for the other
        schedules.
    """

    round: jax.Array
    active: jax.Array
    generated: jax.Array
    remaining: jax.Array
    rounds: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    accepted_at: jax.Array
    rejected_at: jax.Array
    last_gamma: jax.Array
    last_accepted: jax.Array
    auto: Any = None
    tree_accepted_at: Any = None
    tree_rejected_at: Any = None

    @classmethod
    def first(cls, budgets, max_gamma: int, tree_depth: int = 0, auto=None) -> ScheduleStats:
        """What a schedule sees at the first round (host arrays): each row of `budgets`
        [B] (max_new_tokens) has its prefill's token and nothing else yet."""
        budgets = np.asarray(budgets, np.int32)
        zeros = np.zeros(budgets.shape, np.int32)
        generated = np.minimum(budgets, 1)
        positions = lambda size: np.zeros((budgets.size, size), np.int32)  # noqa: E731
        return cls(
            round=np.int32(0),
            active=budgets > generated,
            generated=generated,
            remaining=budgets - generated,
            rounds=zeros,
            drafted=zeros,
            accepted=zeros,
            rejected=zeros,
            accepted_at=positions(max_gamma),
            rejected_at=positions(max_gamma),
            last_gamma=zeros,
            last_accepted=zeros,
            auto=auto,
            tree_accepted_at=positions(tree_depth),
            tree_rejected_at=positions(tree_depth),
        )


def check_gamma(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value
