"""`Auto`: the draft width chosen every round from this machine's measured round costs."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.decode.tree import Tree
from jax_specdec.schedules.base import ScheduleStats
from jax_specdec.schedules.cost_model import CostModel, fastest

__all__ = ["UNLISTED", "Auto", "AutoInputs"]

# The cost given to widths off the menu: never chosen, finite (0 rounds × it stays 0).
UNLISTED = 1e30


class AutoInputs(NamedTuple):
    """What `Auto` reads from the program's inputs (not compiled into it).

    Attributes:
      costs: [max_gamma + 1] float32 seconds per round of each width (`UNLISTED` off the
        menu).
      alpha: [max_gamma] float32 the prior's mean acceptance of each draft position
        (given the drafts before it were accepted).
      ramp: [] bool, widen at most one width of the menu past the deepest draft
        position tried so far (False: any width, as the measuring runs need).
      tree_cost: [] float32 seconds per tree round (`UNLISTED` without a tree).
      tree_alpha: [D] float32 the prior's mean acceptance of the walk's step i (given
        the steps before it were taken) in a tree round ([0] without a tree).
    """

    costs: jax.Array
    alpha: jax.Array
    ramp: jax.Array
    tree_cost: jax.Array
    tree_alpha: jax.Array


@dataclasses.dataclass(frozen=True)
class Auto:
    """`schedule="auto"`: every round, the width among `widths` (0: no drafting, a plain
    target step) that minimises the expected time until the batch is done, by
    `CostModel`'s rule, from

    - **round costs measured here**: the seconds of a whole round of each width (draft,
      verify, acceptance, bookkeeping) on this device, for this model, drafter, batch
      and cache length. `Generator` measures them with the call's own compiled program
      (each width forced in turn, a few short runs; `decode.auto_costs`) and keeps them
      on disk, so the next call of that shape measures nothing. They are an input of
      the program, not part of it: measuring adds no compile, and new costs do not
      recompile.
    - **acceptance observed online**: each row's acceptance per draft position, from a
      Beta prior of `prior_weight` rounds at the acceptance per position the measuring
      runs saw (kept with the costs; `prior_alpha` where none was measured), as
      `CostModel`. A prior from measurement matters: positions a narrow round never
      drafts are never observed, so a low guess for them would keep rounds narrow.
    - **widened step by step**: a round takes at most the first width of the menu past
      the deepest draft position some row has tried, the next position judged by the
      measured prior. `explore` > 0 (`CostModel`'s upper confidence bound, 0 by default)
      plans with the tried positions and the next one that many posterior standard
      deviations higher; as the bonus compounds over positions it favours wide rounds
      (measured: with the shipped SmolLM2 head, explore 1 took γ 6 in most rounds where
      γ 4 was faster).

    Where drafting does not pay (a slow verify, a drafter that misses) the rounds become
    plain steps, so speculation switches itself off. The output is exact whatever is
    chosen; at temperature > 0 which tokens a seed gives depends on the widths chosen,
    hence on the costs: pass `round_costs` (seconds per round of each of `widths`) to fix
    them, e.g. to reproduce a run on another machine.

    `tree` (a `decode.tree.Tree` of depth at most the widest width, with a drafter that
    builds trees) adds a tree round to the menu, chosen for the whole batch when its
    expected time is the least: its tokens per round are modelled as a chain's, from
    the acceptance of each step of the walk in the tree rounds seen (a prior measured
    with the costs), apart from the chains' positions. `round_costs` then holds one
    more cost, the tree round's, last.

    Each width on the menu (and the tree) is a branch of the round's switch, compiled
    with the program.

    `fallback`: where the first round would not draft for any row (`drafts_first`: the
    measured costs and prior say no shape pays), the call runs autoregressive decoding's
    program instead, with no drafter (no draft prefill, no round switch); in auto's own
    program such a call would run plain steps only, since no row then shows any
    acceptance. False keeps auto's own program.
    """

    widths: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8)
    round_costs: tuple[float, ...] | None = None
    prior_alpha: float = 0.6
    prior_weight: float = 4.0
    explore: float = 0.0
    tree: Tree | None = None
    fallback: bool = True

    min_gamma = 0

    def __post_init__(self):
        widths = tuple(self.widths)
        ok = all(isinstance(w, int) and not isinstance(w, bool) for w in widths)
        if not ok or widths != tuple(sorted(set(widths))) or widths[:1] != (0,) or len(widths) < 2:
            raise ValueError(
                "Auto.widths must be increasing ints starting at 0 (no drafting) with at "
                f"least one width >= 1, got {self.widths!r}"
            )
        object.__setattr__(self, "widths", widths)
        if self.tree is not None and (
            not isinstance(self.tree, Tree) or self.tree.depth > widths[-1]
        ):
            raise ValueError(
                f"Auto.tree must be a Tree of depth at most the widest width ({widths[-1]}), "
                f"got {self.tree!r}"
            )
        if self.round_costs is not None:
            costs = tuple(float(c) for c in self.round_costs)
            if len(costs) != self.entries or not all(0 < c < math.inf for c in costs):
                raise ValueError(
                    f"Auto.round_costs must hold one finite cost > 0 per width {widths}"
                    f"{' and one for the tree' if self.tree else ''}, got {self.round_costs!r}"
                )
            object.__setattr__(self, "round_costs", costs)
        self.model()  # checks the prior and explore

    @property
    def max_gamma(self) -> int:
        return self.widths[-1]

    @property
    def entries(self) -> int:
        """Shapes on the menu: the widths, and the tree if any."""
        return len(self.widths) + (self.tree is not None)

    @property
    def tree_choice(self) -> int:
        """What a row's γ is when the round is the tree's: max_gamma + 1."""
        return self.max_gamma + 1

    @property
    def tree_depth(self) -> int:
        return 0 if self.tree is None else self.tree.depth

    def model(self) -> CostModel:
        """The `CostModel` whose rule this follows (its own costs unused)."""
        return CostModel(
            draft_cost=0.0,
            verify_costs=(1.0,) * (self.max_gamma + 1),
            prior_alpha=self.prior_alpha,
            prior_weight=self.prior_weight,
            explore=self.explore,
        )

    def inputs(self, per_width, alpha=None, tree_alpha=None) -> AutoInputs:
        """The program's input: `per_width` (seconds per round of each shape of the
        menu: its widths, then the tree) at its widths, `UNLISTED` elsewhere; `alpha` the
        prior acceptance per draft position and `tree_alpha` per step of the tree's walk
        (None: `prior_alpha`)."""
        per_width = np.asarray(per_width, np.float32)
        costs = np.full(self.max_gamma + 1, UNLISTED, np.float32)
        costs[list(self.widths)] = per_width[: len(self.widths)]
        tree_cost = per_width[-1] if self.tree is not None else np.float32(UNLISTED)

        def prior(values, size):
            given = self.prior_alpha if values is None or np.size(values) == 0 else values
            return np.broadcast_to(np.float32(given), (size,)).astype(np.float32)

        return AutoInputs(
            costs,
            prior(alpha, self.max_gamma),
            np.bool_(True),
            np.float32(tree_cost),
            prior(tree_alpha, self.tree_depth),
        )

    def forcing(self, width: int) -> AutoInputs:
        """Inputs under which every round runs at `width` (`tree_choice`: the tree's)."""
        shapes = self.widths + ((self.tree_choice,) if self.tree is not None else ())
        if width not in shapes:
            raise ValueError(f"Auto.forcing: {width} is not on the menu {shapes}")
        per_width = [1.0 if shape == width else UNLISTED for shape in shapes]
        return self.inputs(per_width, alpha=0.5, tree_alpha=0.5)._replace(ramp=np.bool_(False))

    def drafts_first(self, inputs: AutoInputs, budgets) -> bool:
        """Whether the first round drafts for some row: this schedule's choice before
        any round, from `inputs` (the prior's acceptance) with each row of `budgets`
        [B] (max_new_tokens) having its first token. Where it does not, no row shows any
        acceptance, so only the rows' remaining work could change the choice later: the
        `Generator` then runs autoregressive decoding's program for the call."""
        auto = AutoInputs(*(jnp.asarray(a) for a in inputs))
        stats = ScheduleStats.first(budgets, self.max_gamma, self.tree_depth, auto)
        chosen = np.broadcast_to(np.asarray(self(stats)), stats.active.shape)
        return bool(np.any(chosen[stats.active] > 0))

    def __call__(self, stats: ScheduleStats) -> jax.Array:
        if stats.auto is None:
            raise ValueError(
                "Auto needs its costs as the program's input: run it through Generator, "
                "which measures them (or pass Auto(round_costs=...))"
            )
        depth = _depth(stats.accepted_at, stats.rejected_at)
        costs = jnp.where(self._reachable(stats, depth), stats.auto.costs, UNLISTED)
        optimism = jnp.arange(self.max_gamma) <= depth  # the tried positions and the next
        model = self.model()
        if self.tree is None:
            return model.choose(stats, costs, prior=stats.auto.alpha, optimism=optimism)
        chains = model.rounds(stats, stats.auto.alpha, optimism) * costs
        tree = self._tree_rounds(stats) * stats.auto.tree_cost  # its choice: max_gamma + 1
        return fastest(jnp.concatenate([chains, tree[None]]), stats)

    def _tree_rounds(self, stats: ScheduleStats) -> jax.Array:
        """[] expected rounds until the batch is done, every round the tree's: its walk's
        steps modelled as a chain's positions, from the tree rounds' own counters."""
        seen = stats._replace(
            accepted_at=stats.tree_accepted_at, rejected_at=stats.tree_rejected_at
        )
        depth = _depth(stats.tree_accepted_at, stats.tree_rejected_at)
        model = dataclasses.replace(self.model(), verify_costs=(1.0,) * (self.tree.depth + 1))
        optimism = jnp.arange(self.tree.depth) <= depth
        return model.rounds(seen, stats.auto.tree_alpha, optimism)[-1]

    def _reachable(self, stats: ScheduleStats, depth=None) -> jax.Array:
        """[max_gamma + 1] the widths this round may take: up to the first width of the
        menu past the deepest draft position any row has tried (from the first on), so
        that a width is widened step by step as the positions before it are observed
        (an optimistic guess for unobserved positions would jump to the widest)."""
        depth = _depth(stats.accepted_at, stats.rejected_at) if depth is None else depth
        widths = jnp.asarray(self.widths, jnp.int32)
        step = jnp.minimum(jnp.searchsorted(widths, depth, side="right"), len(self.widths) - 1)
        gammas = jnp.arange(self.max_gamma + 1, dtype=jnp.int32)
        return (gammas <= widths[step]) | ~stats.auto.ramp


def _depth(accepted_at, rejected_at) -> jax.Array:
    """[] how many draft positions, from the first on, some row has tried."""
    tried = jnp.sum(accepted_at + rejected_at, axis=0) > 0
    return jnp.sum(jnp.cumprod(tried.astype(jnp.int32)))
