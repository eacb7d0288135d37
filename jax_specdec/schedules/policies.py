"""The simple policies: constant γ, the +2/−1 heuristic, early exit on confidence, and
the user's own function."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.schedules.base import ScheduleStats, check_gamma

__all__ = ["Confidence", "Constant", "Custom", "Heuristic", "as_schedule"]


@dataclasses.dataclass(frozen=True)
class Constant:
    """γ tokens every round, for every row (per row, trivially)."""

    gamma: int = 4

    def __post_init__(self):
        check_gamma("Constant.gamma", self.gamma)

    @property
    def max_gamma(self) -> int:
        return self.gamma

    @property
    def min_gamma(self) -> int:
        return self.gamma

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        return jnp.full(stats.active.shape, self.gamma, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Heuristic:
    """+`increase` after a fully accepted round, −`decrease` otherwise, within
    [min_gamma, max_gamma], starting at `initial`; per row. (Hugging Face's assisted
    generation uses +2 / −1 this way.)"""

    initial: int = 4
    min_gamma: int = 1
    max_gamma: int = 8
    increase: int = 2
    decrease: int = 1

    def __post_init__(self):
        check_gamma("Heuristic.max_gamma", self.max_gamma)
        check_gamma("Heuristic.min_gamma", self.min_gamma)
        check_gamma("Heuristic.increase", self.increase, 0)
        check_gamma("Heuristic.decrease", self.decrease, 0)
        if self.min_gamma > self.max_gamma:
            raise ValueError(
                f"Heuristic.min_gamma ({self.min_gamma}) exceeds max_gamma ({self.max_gamma})"
            )
        if not self.min_gamma <= check_gamma("Heuristic.initial", self.initial) <= self.max_gamma:
            raise ValueError(
                f"Heuristic.initial ({self.initial}) must lie in [min_gamma, max_gamma] = "
                f"[{self.min_gamma}, {self.max_gamma}]"
            )

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        full = stats.last_accepted >= stats.last_gamma
        step = jnp.where(full, self.increase, -self.decrease)
        gamma = jnp.where(stats.round == 0, self.initial, stats.last_gamma + step)
        return jnp.clip(gamma, self.min_gamma, self.max_gamma).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Confidence:
    """A way of drafting, given as `schedule=`: draft up to `max_gamma` tokens, but stop a
    row's drafting after a token to which the draft gave probability below `threshold`
    (that token is still verified); per row. Needs a draft model.

    The stop is decided inside the round, so the draft runs as an early-exit loop
    (`decode.drafters.draft_model.EarlyExit`) and the verify as wide as the longest draft among
    active rows. Exact: whether position i+1 is drafted depends only on tokens already
    drafted, each verified against the q it was drawn from.
    """

    threshold: float = 0.4
    max_gamma: int = 8

    def __post_init__(self):
        check_gamma("Confidence.max_gamma", self.max_gamma)
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"Confidence.threshold must be a number in [0, 1], got {t!r}")


@dataclasses.dataclass(frozen=True)
class Custom:
    """A user's schedule: `fn(stats: ScheduleStats) -> γ` ([B] or a scalar int array),
    pure and jit-traceable; values are clipped to [0, max_gamma].

    Example, draft more as the row's acceptance grows:
        Custom(lambda s: 2 + 4 * (s.accepted > 2 * s.rejected), max_gamma=6)
    """

    fn: Callable[[ScheduleStats], jax.Array]
    max_gamma: int = 8

    min_gamma = 0

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Custom.fn must be callable, got {type(self.fn).__name__}")
        check_gamma("Custom.max_gamma", self.max_gamma)

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        gamma = jnp.asarray(self.fn(stats))
        if not jnp.issubdtype(gamma.dtype, jnp.integer):
            raise TypeError(f"Custom.fn must return integers, got dtype {gamma.dtype}")
        gamma = jnp.broadcast_to(gamma, stats.active.shape)
        return jnp.clip(gamma, 0, self.max_gamma).astype(jnp.int32)


def as_schedule(value):
    """An int γ >= 1 as `Constant(γ)`; a schedule checked for what the loop needs of it:
    callable, hashable, integer `max_gamma` >= 1 and `min_gamma` in [0, max_gamma]."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return Constant(check_gamma("schedule", int(value)))
    hi, lo = getattr(value, "max_gamma", None), getattr(value, "min_gamma", None)
    ok = callable(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in (hi, lo))
    if not ok or not 0 <= lo <= hi or hi < 1:
        raise TypeError(
            "schedule must be an int γ >= 1 or a schedule (Constant, Heuristic, Confidence, "
            "CostModel, Custom, or a callable with int max_gamma >= 1 and min_gamma in "
            f"[0, max_gamma]), got {type(value).__name__}"
        )
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"schedule must be hashable (a frozen dataclass), got {value!r}") from None
    return value
