"""Draft-length schedules: how many tokens each row drafts in the next round.

A schedule is a pure function of the loop's statistics (`ScheduleStats`, arrays on
device) that returns the number of tokens to draft for every row, γ_b ∈ [0, max_gamma].
It runs inside the compiled loop once per round; nothing goes back to the host.

The round then runs with the widest γ of its active rows, chosen by `lax.switch` among
statically shaped rounds (γ = 0, 1, ..., max_gamma): a round where every row asked for
2 tokens costs a γ = 2 round, not a max_gamma one. A row that asked for fewer tokens
than the round drafts has its extra drafts ignored by the acceptance step (it gets
its bonus token from the target at its own γ_b), so the output stays exact. γ = 0 for
every active row is a plain target decode step (the draft model does not run; its
cache catches up in the next round that drafts).

Per row or per batch (`per_row`):
- `Constant`, `Heuristic`, `Confidence` and the n-gram proposer decide per row from
  the row's own history, so a row's tokens depend only on its key and prompt, never
  on its batch neighbours.
- `CostModel` decides per batch: the whole batch pays for the round's widest γ and
  waits for its slowest row, so it minimises the expected time until the batch is
  done. A row's tokens then depend on its neighbours through the chosen γ (their
  distribution never does).
- `Custom`: whatever the user's function does; it says so with `per_row`.

`can_skip` says whether a schedule may choose γ = 0 for the whole batch. Those that can
(`CostModel`, `Custom`) get no draft prefill up front: the draft cache is filled by the
same catch-up that follows γ = 0 rounds, the first time a round drafts, so a run where
speculation never pays costs what autoregressive decoding costs.

Every schedule is a frozen dataclass, hashable, so it is a static argument of the
compiled program: changing the schedule recompiles, changing its inputs does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Confidence",
    "Constant",
    "CostModel",
    "Custom",
    "Heuristic",
    "Schedule",
    "ScheduleStats",
]


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


def _check_gamma(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Constant:
    """γ tokens every round, for every row (per row, trivially)."""

    gamma: int = 4

    per_row = True
    can_skip = False
    threshold = None

    def __post_init__(self):
        _check_gamma("Constant.gamma", self.gamma)

    @property
    def max_gamma(self) -> int:
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

    per_row = True
    can_skip = False
    threshold = None

    def __post_init__(self):
        _check_gamma("Heuristic.max_gamma", self.max_gamma)
        _check_gamma("Heuristic.min_gamma", self.min_gamma)
        _check_gamma("Heuristic.increase", self.increase, 0)
        _check_gamma("Heuristic.decrease", self.decrease, 0)
        if self.min_gamma > self.max_gamma:
            raise ValueError(
                f"Heuristic.min_gamma ({self.min_gamma}) exceeds max_gamma ({self.max_gamma})"
            )
        if not self.min_gamma <= _check_gamma("Heuristic.initial", self.initial) <= self.max_gamma:
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
    """Draft up to `max_gamma` tokens, but stop a row's drafting after a token to which
    the draft gave probability below `threshold` (that token is still verified); per row.

    The stop is decided inside the round, so the draft runs as an early-exit loop and
    the verify as wide as the longest draft among active rows. Exact: whether position
    i+1 is drafted depends only on tokens already drafted, each verified against the q
    it was drawn from.
    """

    threshold: float = 0.4
    max_gamma: int = 8

    per_row = True
    can_skip = False

    def __post_init__(self):
        _check_gamma("Confidence.max_gamma", self.max_gamma)
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"Confidence.threshold must be a number in [0, 1], got {t!r}")

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        return jnp.full(stats.active.shape, self.max_gamma, jnp.int32)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per batch: the γ ∈ {0 … max_gamma} that minimises the expected time until the
    batch's last row finishes, were γ kept for the rest of the run; re-decided every
    round from what the rows have shown so far.

    - **Acceptance per position.** Row b accepts draft position i (given the drafts
      before it were accepted) with probability α_bi, estimated online as
      (accepted_at + a_i) / (accepted_at + rejected_at + a_i + b_i): a Beta prior of
      `prior_weight` rounds at mean `prior_alpha[i]` (one value: every position).
      Acceptance varies along the draft (in the sweep it falls at batch 1 and rises
      in large batches, whose rows that get far are the easy ones), which the i.i.d.
      model of DESIGN §2 misses.
    - **Tokens per round.** With c_k = α_b1 ⋯ α_bk the probability that the first k
      drafts are accepted (c_0 = 1), the tokens T of a γ round have mean
      μ = Σ_{k≤γ} c_k and E[T²] = Σ_{k≤γ} (2k + 1) c_k.
    - **Rounds until done.** A row with R tokens to go needs about R/μ rounds, with
      variance R·var(T)/μ³ (renewal theory), at least ⌈R/(γ + 1)⌉ and at most R. A
      batch runs until its slowest row is done: the model takes
      max_b (mean_b + z_n · sd_b), with z_n the expected maximum of n standard normals
      (Blom's approximation) over the n active rows. At batch 1 this is the
      tokens-per-cost optimum; in a large batch a row that falls behind costs every
      row its rounds, which favours narrower rounds and γ = 0 (whose rounds are
      certain). Approximations: with rows of unequal means the max_b overstates the
      expected maximum somewhat (against drafting), and the last round's overshoot
      is ignored.
    - **Cost.** A round of width γ costs γ·draft_cost + verify_costs[γ].
      `verify_costs[k]` is the time of a target call on k+1 tokens per row (k = 0: a
      plain decode step) and `draft_cost` one draft step, at the batch size and context
      used (`jax_specdec.bench.calibrate_costs`); or pass the measured cost of whole
      rounds of width k as `verify_costs[k]` with `draft_cost=0`
      (`jax_specdec.bench.calibrate_round_costs`, which also measures `prior_alpha` per
      position): that includes sampling, acceptance and the loop's bookkeeping.

    γ = 0 runs a plain decode step, so speculation switches itself off where it does
    not pay. α is only learned from rounds that draft: once γ = 0 is chosen it stays
    chosen unless the rows' remaining work changes the answer.
    """

    draft_cost: float
    verify_costs: tuple[float, ...]
    prior_alpha: float | tuple[float, ...] = 0.6
    prior_weight: float = 4.0

    per_row = False
    can_skip = True
    threshold = None

    def __post_init__(self):
        costs = tuple(float(c) for c in self.verify_costs)
        if len(costs) < 2:
            raise ValueError(
                "CostModel.verify_costs needs the cost of verifying 1..max_gamma+1 tokens "
                f"(at least 2 entries), got {len(costs)}"
            )
        if any(not 0 < c < math.inf for c in costs) or not 0 <= float(self.draft_cost) < math.inf:
            raise ValueError("CostModel costs must be finite and positive (draft_cost may be 0)")
        object.__setattr__(self, "verify_costs", costs)
        object.__setattr__(self, "draft_cost", float(self.draft_cost))
        prior = np.asarray(self.prior_alpha, np.float64)
        prior = (float(prior),) * self.max_gamma if prior.ndim == 0 else tuple(prior.ravel())
        if len(prior) != self.max_gamma or not all(0.0 < float(a) < 1.0 for a in prior):
            raise ValueError(
                f"CostModel.prior_alpha must be a number in (0, 1) or max_gamma = "
                f"{self.max_gamma} of them (one per draft position), got {self.prior_alpha!r}"
            )
        prior = tuple(float(a) for a in prior)
        object.__setattr__(self, "prior_alpha", prior[0] if len(set(prior)) == 1 else prior)
        if not 0 < self.prior_weight < math.inf:
            raise ValueError(
                f"CostModel.prior_weight must be finite and > 0, got {self.prior_weight}"
            )

    @property
    def max_gamma(self) -> int:
        return len(self.verify_costs) - 1

    def costs(self) -> jax.Array:
        """[max_gamma + 1] cost of a round with γ = 0 … max_gamma."""
        g = jnp.arange(self.max_gamma + 1, dtype=jnp.float32)
        return g * self.draft_cost + jnp.asarray(self.verify_costs, jnp.float32)

    def alpha(self, stats: ScheduleStats) -> jax.Array:
        """[B, max_gamma] each row's estimated acceptance of each draft position."""
        prior = jnp.broadcast_to(jnp.asarray(self.prior_alpha, jnp.float32), (self.max_gamma,))
        a = prior * self.prior_weight
        b = (1.0 - prior) * self.prior_weight
        accepted = stats.accepted_at.astype(jnp.float32)
        return (accepted + a) / (accepted + stats.rejected_at + a + b)

    def tokens(self, stats: ScheduleStats) -> tuple[jax.Array, jax.Array]:
        """Mean and variance of each row's tokens per round, [B, max_gamma + 1] by γ."""
        alpha = self.alpha(stats)
        reach = jnp.concatenate([jnp.ones_like(alpha[:, :1]), jnp.cumprod(alpha, axis=1)], 1)
        k = jnp.arange(self.max_gamma + 1, dtype=jnp.float32)
        mean = jnp.cumsum(reach, axis=1)
        return mean, jnp.maximum(jnp.cumsum((2 * k + 1) * reach, axis=1) - mean**2, 0.0)

    def rounds(self, stats: ScheduleStats) -> jax.Array:
        """[max_gamma + 1] expected rounds until the batch's last active row is done."""
        mean, var = self.tokens(stats)
        left = jnp.where(stats.active, stats.remaining, 0).astype(jnp.float32)[:, None]
        n = jnp.maximum(jnp.sum(stats.active), 1).astype(jnp.float32)
        z = jax.scipy.special.ndtri((n - 0.375) / (n + 0.25))  # E[max of n normals]
        rows = left / mean + z * jnp.sqrt(left * var / mean**3)
        # Each round gives a row at least 1 and at most γ + 1 tokens.
        widest = jnp.arange(self.max_gamma + 1, dtype=jnp.float32) + 1.0
        rows = jnp.clip(rows, jnp.ceil(left / widest), left)
        return jnp.max(jnp.where(stats.active[:, None], rows, 0.0), axis=0)

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        if stats.accepted_at.shape[-1] != self.max_gamma:
            raise ValueError(
                f"CostModel: stats are for max_gamma {stats.accepted_at.shape[-1]}, "
                f"the model for {self.max_gamma}"
            )
        best = jnp.argmin(self.rounds(stats) * self.costs()).astype(jnp.int32)
        return jnp.full(stats.active.shape, best, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Custom:
    """A user's schedule: `fn(stats: ScheduleStats) -> γ` ([B] or a scalar int array),
    pure and jit-traceable; values are clipped to [0, max_gamma].

    Example, draft more as the row's acceptance grows:
        Custom(lambda s: 2 + 4 * (s.accepted > 2 * s.rejected), max_gamma=6)
    """

    fn: Callable[[ScheduleStats], jax.Array]
    max_gamma: int = 8
    per_row: bool = True

    can_skip = True
    threshold = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Custom.fn must be callable, got {type(self.fn).__name__}")
        _check_gamma("Custom.max_gamma", self.max_gamma)

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        gamma = jnp.asarray(self.fn(stats))
        if not jnp.issubdtype(gamma.dtype, jnp.integer):
            raise TypeError(f"Custom.fn must return integers, got dtype {gamma.dtype}")
        gamma = jnp.broadcast_to(gamma, stats.active.shape)
        return jnp.clip(gamma, 0, self.max_gamma).astype(jnp.int32)


Schedule = Constant | Heuristic | Confidence | CostModel | Custom
SCHEDULES: Sequence[type] = (Constant, Heuristic, Confidence, CostModel, Custom)
