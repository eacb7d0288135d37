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

A schedule is any frozen, hashable callable with two integer attributes:
`max_gamma` (the widest round it asks for) and `min_gamma` (the least; 0 means it may
skip drafting, and the draft model then starts without a prefill: its cache is filled
by the same catch-up that follows γ = 0 rounds). `min_gamma == max_gamma` is a
constant γ, which runs without a switch.

Per row or per batch:
- `Constant`, `Heuristic` and the drafters' own stops (`Confidence`, n-gram lookup)
  decide per row from the row's own history, so a row's tokens depend only on its key
  and prompt, never on its batch neighbours.
- `CostModel` decides per batch: the whole batch pays for the round's widest γ and
  waits for its slowest row, so it minimises the expected time until the batch is
  done. A row's tokens then depend on its neighbours through the chosen γ (their
  distribution never does).
- `Auto` (the default with a drafter) decides per batch as `CostModel` does, from round
  costs measured on this machine for the call's shapes (an input of the program,
  measured by `Generator` with the program itself) over a menu of widths.
- `Custom`: whatever the user's function does.

`Confidence` is not a draft length but a way of drafting (stop a row's draft below a
threshold); passed as `schedule=` it means "up to max_gamma tokens, stopping early".

Every schedule is a frozen dataclass, hashable, so it is a static argument of the
compiled program: changing the schedule recompiles, changing its inputs does not.
`CostModel`'s costs are measured by `jax_specdec.bench.calibrate_costs` and
`calibrate_round_costs`.
"""

from jax_specdec.schedules.auto import Auto
from jax_specdec.schedules.base import ScheduleStats
from jax_specdec.schedules.cost_model import CostModel
from jax_specdec.schedules.policies import Confidence, Constant, Custom, Heuristic, as_schedule

Schedule = Auto | Constant | Heuristic | Confidence | CostModel | Custom

__all__ = [
    "Auto",
    "Confidence",
    "Constant",
    "CostModel",
    "Custom",
    "Heuristic",
    "Schedule",
    "ScheduleStats",
    "as_schedule",
]
