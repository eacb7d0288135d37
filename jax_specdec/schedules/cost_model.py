"""`CostModel`: the γ that minimises the expected time until the batch is done."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.schedules.base import ScheduleStats

__all__ = ["CostModel", "fastest"]


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
      model of docs/design.md misses.
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
      used (`bench.calibrate_costs`); or pass the measured cost of whole
      rounds of width k as `verify_costs[k]` with `draft_cost=0`
      (`bench.calibrate_round_costs`, which also measures `prior_alpha` per
      position): that includes sampling, acceptance and the loop's bookkeeping.

    γ = 0 runs a plain decode step, so speculation switches itself off where it does
    not pay. α is only learned from rounds that draft: once γ = 0 is chosen it stays
    chosen unless the rows' remaining work changes the answer. So a few unlucky
    rejections early in a run can switch drafting off for good where it pays on
    average (with the batch-4 round costs of the SmolLM2 head's sweep,
    scripts/experiments/sweep_smollm2_head, and α ≈ 0.5, four
    misses in a row at one row's first position do it). `explore` > 0 plans with each
    α that many posterior standard deviations higher (an upper confidence bound,
    capped at 0.99, never below the mean): a row keeps drafting until the evidence
    against it is firm, then switches off as before. It is optimistic from the start
    too: with no rounds seen and a prior of weight 4, α ≈ 0.5 plans as ≈ 0.73 (at the
    batch-1 costs of the same sweep, a first round of γ 4 instead of 3). It is off by
    default; docs/schedules.md has what it was measured to do.
    """

    draft_cost: float
    verify_costs: tuple[float, ...]
    prior_alpha: float | tuple[float, ...] = 0.6
    prior_weight: float = 4.0
    explore: float = 0.0

    min_gamma = 0

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
        if not 0 <= self.explore < math.inf:
            raise ValueError(f"CostModel.explore must be finite and >= 0, got {self.explore}")

    @property
    def max_gamma(self) -> int:
        return len(self.verify_costs) - 1

    def costs(self) -> jax.Array:
        """[max_gamma + 1] cost of a round with γ = 0 … max_gamma."""
        g = jnp.arange(self.max_gamma + 1, dtype=jnp.float32)
        return g * self.draft_cost + jnp.asarray(self.verify_costs, jnp.float32)

    def alpha(self, stats: ScheduleStats, prior=None, optimism=None) -> jax.Array:
        """[B, max_gamma] each row's estimated acceptance of each draft position: the
        Beta posterior's mean, plus `explore` of its standard deviations (only at the
        positions where `optimism` [max_gamma] is True, if given). `prior`: the prior's
        mean per position (an array), instead of `prior_alpha`."""
        prior = self.prior_alpha if prior is None else prior
        prior = jnp.broadcast_to(jnp.asarray(prior, jnp.float32), (self.max_gamma,))
        a = prior * self.prior_weight
        b = (1.0 - prior) * self.prior_weight
        accepted = stats.accepted_at.astype(jnp.float32)
        seen = accepted + stats.rejected_at + a + b
        mean = (accepted + a) / seen
        if not self.explore:
            return mean
        sd = jnp.sqrt(mean * (1.0 - mean) / (seen + 1.0))  # the Beta posterior's
        hopeful = jnp.maximum(mean, jnp.minimum(mean + self.explore * sd, 0.99))
        return hopeful if optimism is None else jnp.where(optimism, hopeful, mean)

    def tokens(self, stats: ScheduleStats, prior=None, optimism=None):
        """Mean and variance of each row's tokens per round, [B, max_gamma + 1] by γ."""
        alpha = self.alpha(stats, prior, optimism)
        reach = jnp.concatenate([jnp.ones_like(alpha[:, :1]), jnp.cumprod(alpha, axis=1)], 1)
        k = jnp.arange(self.max_gamma + 1, dtype=jnp.float32)
        mean = jnp.cumsum(reach, axis=1)
        return mean, jnp.maximum(jnp.cumsum((2 * k + 1) * reach, axis=1) - mean**2, 0.0)

    def rounds(self, stats: ScheduleStats, prior=None, optimism=None) -> jax.Array:
        """[max_gamma + 1] expected rounds until the batch's last active row is done."""
        mean, var = self.tokens(stats, prior, optimism)
        left = jnp.where(stats.active, stats.remaining, 0).astype(jnp.float32)[:, None]
        n = jnp.maximum(jnp.sum(stats.active), 1).astype(jnp.float32)
        z = jax.scipy.special.ndtri((n - 0.375) / (n + 0.25))  # E[max of n normals]
        rows = left / mean + z * jnp.sqrt(left * var / mean**3)
        # Each round gives a row at least 1 and at most γ + 1 tokens.
        widest = jnp.arange(self.max_gamma + 1, dtype=jnp.float32) + 1.0
        rows = jnp.clip(rows, jnp.ceil(left / widest), left)
        return jnp.max(jnp.where(stats.active[:, None], rows, 0.0), axis=0)

    def choose(self, stats: ScheduleStats, costs: jax.Array, prior=None, optimism=None):
        """[B] the γ minimising expected rounds × `costs` [max_gamma + 1], every row alike
        (`prior`, `optimism`: as `alpha`'s)."""
        if stats.accepted_at.shape[-1] != self.max_gamma:
            raise ValueError(
                f"CostModel: stats are for max_gamma {stats.accepted_at.shape[-1]}, "
                f"the model for {self.max_gamma}"
            )
        return fastest(self.rounds(stats, prior, optimism) * costs, stats)

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        return self.choose(stats, self.costs())


def fastest(times: jax.Array, stats: ScheduleStats) -> jax.Array:
    """[B] the index of the least of `times` (expected seconds until the batch is done,
    one per choice), every row alike."""
    return jnp.full(stats.active.shape, jnp.argmin(times), jnp.int32)
