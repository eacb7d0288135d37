"""CostModel.rounds (the normal approximation of the slowest row's rounds) against the
exact expectation (`bench.expected_batch_rounds`) on a grid of batch sizes, tokens to go,
acceptance (equal or spread across the rows) and two sets of round costs: the largest
and median relative error, how often the chosen γ differs, and the worst regret (exact
expected time of the chosen γ over that of the best). See docs/schedules.md.

  python scripts/cost_model_rounds_check.py
"""

import itertools

import jax.numpy as jnp
import numpy as np

from jax_specdec.bench.benchmark import expected_batch_rounds
from jax_specdec.schedules.base import ScheduleStats
from jax_specdec.schedules.cost_model import CostModel

G = 4


def stats(alphas, remaining, N=10**6):
    """Rows that met every position N times and accepted it with frequency alphas[b]."""
    a = np.asarray(alphas, np.float64)[:, None]
    i = np.arange(G)[None]
    acc = N * a ** (i + 1)
    rej = N * a**i * (1 - a)
    B = len(alphas)
    z = jnp.zeros((B,), jnp.int32)
    return ScheduleStats(
        round=jnp.int32(1),
        active=jnp.ones((B,), bool),
        generated=z,
        remaining=jnp.full((B,), remaining, jnp.int32),
        rounds=z,
        drafted=z,
        accepted=z,
        rejected=z,
        accepted_at=jnp.asarray(acc.round(), jnp.int32),
        rejected_at=jnp.asarray(rej.round(), jnp.int32),
        last_gamma=z,
        last_accepted=z,
    )


def main() -> None:
    """Prints the summary, then the worst cases by regret and by error."""
    costs = dict(
        cpu_b1=(0.07, (1.0, 1.1, 1.2, 1.3, 1.45)), cpu_b4=(0.09, (1.0, 1.25, 1.5, 1.8, 2.1))
    )
    rows = []
    for n, R, spread, alpha in itertools.product(
        (1, 4, 16), (16, 64, 128), (0.0, 0.2), (0.3, 0.5, 0.7, 0.9)
    ):
        alphas = (
            np.clip(alpha + spread * np.linspace(-1, 1, n), 0.02, 0.98)
            if n > 1
            else np.array([alpha])
        )
        st = stats(alphas, R)
        for name, (d, v) in costs.items():
            cm = CostModel(draft_cost=d, verify_costs=v, prior_weight=1e-3)
            approx = np.asarray(cm.rounds(st))
            exact = np.array([expected_batch_rounds(alphas, g, R) for g in range(G + 1)])
            c = np.asarray(cm.costs())
            ga, ge = int(np.argmin(approx * c)), int(np.argmin(exact * c))
            regret = exact[ga] * c[ga] / (exact[ge] * c[ge])
            rows.append(
                (n, R, spread, alpha, name, np.max(np.abs(approx / exact - 1)), ga, ge, regret)
            )
    err = np.array([r[5] for r in rows])
    reg = np.array([r[8] for r in rows])
    print(
        "cases",
        len(rows),
        "max rel err rounds",
        err.max().round(3),
        "median",
        np.median(err).round(3),
    )
    print("choice differs", sum(r[6] != r[7] for r in rows), "max regret", reg.max().round(4))
    for r in sorted(rows, key=lambda r: -r[8])[:8]:
        print(r[:5], round(r[5], 3), r[6], r[7], round(r[8], 4))
    for r in sorted(rows, key=lambda r: -r[5])[:6]:
        print("err", r[:5], round(r[5], 3))


if __name__ == "__main__":
    main()
