"""Closed-form output distributions of the acceptance step, in float64 NumPy.

`one_position(p, q)` is the balance of one drafted position (docs/design.md, §1): the
mass emitted by accepted proposals, min(p, q), plus the rejected mass
1 - sum(min(p, q)) spread over norm(max(0, p - q)), adds up to p exactly. The
*wrong* correction that resamples a rejection from plain p does not.

`round_distribution(ps, qs)` enumerates every outcome of one round of γ drafted
positions with fixed per-position p_i and q_i: it is what the statistical tests
compare Monte Carlo frequencies against.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

__all__ = ["Balance", "one_position", "round_distribution", "check_distribution"]

_SUM_TOLERANCE = 1e-6


class Balance(NamedTuple):
    """The balance of one position; every field is a float64 vector over the vocabulary
    except `rejected_mass`.

    Attributes:
      accepted: min(p, q), the mass emitted by accepted proposals.
      rejected_mass: 1 - sum(accepted), the probability of a rejection.
      residual: norm(max(0, p - q)), where a rejection's correction is drawn from
        (p itself when p == q, where no rejection happens).
      output: accepted + rejected_mass * residual; equals p.
      wrong_output: accepted + rejected_mass * p, the result of resampling from plain p.
    """

    accepted: np.ndarray
    rejected_mass: float
    residual: np.ndarray
    output: np.ndarray
    wrong_output: np.ndarray


def check_distribution(x, name: str) -> np.ndarray:
    """Returns x as a float64 vector, or raises ValueError unless it is a distribution."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty vector, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} has non-finite entries: {arr.tolist()}")
    if np.any(arr < 0):
        raise ValueError(f"{name} has negative entries: {arr.tolist()}")
    if abs(arr.sum() - 1.0) > _SUM_TOLERANCE:
        raise ValueError(
            f"{name} must sum to 1 (within {_SUM_TOLERANCE}), sums to {float(arr.sum()):.6g}"
        )
    return arr


def one_position(p, q) -> Balance:
    """The closed-form output distribution of one drafted position.

    Args:
      p: the target's distribution, a probability vector.
      q: the draft's distribution over the same vocabulary.

    Returns:
      A `Balance` in float64.
    """
    p = check_distribution(p, "p")
    q = check_distribution(q, "q")
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same length, got {p.size} and {q.size}")
    accepted = np.minimum(p, q)
    rejected_mass = float(max(0.0, 1.0 - accepted.sum()))
    excess = np.maximum(p - q, 0.0)
    residual = excess / excess.sum() if excess.sum() > 0 else p.copy()
    return Balance(
        accepted=accepted,
        rejected_mass=rejected_mass,
        residual=residual,
        output=accepted + rejected_mass * residual,
        wrong_output=accepted + rejected_mass * p,
    )


def round_distribution(ps, qs) -> dict[tuple[int, ...], float]:
    """Exact probability of every outcome of one round, with fixed per-position p and q.

    Args:
      ps: [γ+1, V] target distributions p_1..p_{γ+1}.
      qs: [γ, V] draft distributions q_1..q_γ (drafts are sampled x_i ~ q_i).

    Returns:
      {(x_1, .., x_n, y): probability} where x_1..x_n are the accepted drafted tokens
      (n = num_accepted) and y the emitted correction or bonus token; only outcomes
      with positive probability are listed; the values sum to 1.
    """
    ps = np.asarray(ps, dtype=np.float64)
    qs = np.asarray(qs, dtype=np.float64).reshape(-1, ps.shape[-1])
    gamma, vocab = qs.shape
    if ps.shape != (gamma + 1, vocab):
        raise ValueError(f"ps must be [γ+1, V] = [{gamma + 1}, {vocab}], got {ps.shape}")
    for i, row in enumerate(ps):
        check_distribution(row, f"ps[{i}]")
    for i, row in enumerate(qs):
        check_distribution(row, f"qs[{i}]")
    outcomes: dict[tuple[int, ...], float] = {}
    for n in range(gamma + 1):
        final = ps[gamma] if n == gamma else one_position(ps[n], qs[n]).residual
        stop = 1.0 if n == gamma else one_position(ps[n], qs[n]).rejected_mass
        for prefix in itertools.product(range(vocab), repeat=n):
            mass = np.prod([min(ps[i][x], qs[i][x]) for i, x in enumerate(prefix)]) * stop
            for y in range(vocab):
                prob = mass * final[y]
                if prob > 0:
                    outcomes[(*prefix, y)] = float(prob)
    return outcomes
