"""Calibrating a `CostModel`: its costs measured on this machine, at this batch size.

`calibrate_costs` times model calls apart (one draft step, target calls on 1 …
max_gamma + 1 tokens per row); `calibrate_round_costs` times whole rounds inside the
compiled loop, so sampling, acceptance and the loop's bookkeeping are included.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jax_specdec.schedules.cost_model import CostModel

__all__ = ["calibrate_costs", "calibrate_round_costs"]


def calibrate_costs(
    target,
    draft,
    *,
    batch: int,
    context: int,
    max_gamma: int,
    cache_len: int | None = None,
    repeats: int = 5,
    prior_alpha: float = 0.6,
) -> CostModel:
    """A `CostModel` from measured costs at this batch size and context: one draft step,
    and a target call on k = 1 … max_gamma + 1 tokens per row."""
    from jax_specdec.bench.timing import decode_step_time

    cache_len = context + max_gamma + 2 if cache_len is None else cache_len

    def step(model, tokens):
        return decode_step_time(
            model,
            batch=batch,
            tokens_per_call=tokens,
            context=context,
            cache_len=cache_len,
            repeats=repeats,
        ).median

    return CostModel(
        draft_cost=step(draft, 1),
        verify_costs=tuple(step(target, k + 1) for k in range(max_gamma + 1)),
        prior_alpha=prior_alpha,
    )


def calibrate_round_costs(
    target,
    draft,
    prompts,
    *,
    max_gamma: int,
    prompt_lengths=None,
    sampling=None,
    max_new_tokens: int = 48,
    repeats: int = 5,
    prior_alpha: float | tuple[float, ...] | None = None,
    more_batches: Sequence[tuple[object, object]] = (),
) -> CostModel:
    """A `CostModel` from whole rounds timed inside the compiled loop: autoregressive
    decoding (γ = 0) and constant γ = 1 … max_gamma on `prompts` with `sampling`
    (default greedy), each minus its prefill (a 1-token run), per round. All
    2 (max_gamma + 1) runs per batch are timed interleaved (`bench.measure`).

    `more_batches`: further `(prompts, prompt_lengths)` batches, timed and counted with
    the first (seconds and rounds summed over the batches), so a small batch is not
    calibrated on one prompt alone.

    `prior_alpha` None: the acceptance of each draft position (given the drafts before
    it were accepted) that those constant-γ runs measured, the model's starting belief.
    It only learns from rounds that draft, so a wrong prior that picks γ = 0 would
    never be corrected.
    """
    from jax_specdec.bench.timing import drop_programs_if_crowded, measure
    from jax_specdec.decode import Generator

    batches = [(prompts, prompt_lengths), *more_batches]
    for b in batches[1:]:
        if not (isinstance(b, tuple) and len(b) == 2):
            raise ValueError(
                f"more_batches must hold (prompts, prompt_lengths) tuples, got {type(b).__name__}"
            )
    generators = [Generator(target, sampling=sampling)]
    generators += [
        Generator(target, draft, schedule=g, sampling=sampling) for g in range(1, max_gamma + 1)
    ]
    runs = [
        gen.bind(p, key=jax.random.key(0), max_new_tokens=n, prompt_lengths=lengths)
        for gen in generators
        for p, lengths in batches
        for n in (1, max_new_tokens)
    ]
    measured = measure(runs, repeats)
    drop_programs_if_crowded()
    costs, measured_alpha = _tally(measured, len(batches), max_gamma)
    prior_alpha = measured_alpha if prior_alpha is None else prior_alpha
    return CostModel(draft_cost=0.0, verify_costs=tuple(costs), prior_alpha=prior_alpha)


def _tally(measured, num_batches: int, max_gamma: int):
    """Seconds per round of each width (the long run minus the 1-token run, summed over
    batches) and the acceptance per draft position pooled over the constant-γ runs."""
    costs, accepted, rejected = [], np.zeros(max_gamma), np.zeros(max_gamma)
    for g in range(max_gamma + 1):
        seconds, rounds = 0.0, 0
        for b in range(num_batches):
            short, full = measured[2 * (g * num_batches + b) : 2 * (g * num_batches + b) + 2]
            seconds += max(full.seconds - short.seconds, 1e-9)
            rounds += int(full.stats.target_calls) - 1
            if g > 0:
                accepted[:g] += np.asarray(full.stats.accepted_at).sum(0)
                rejected[:g] += np.asarray(full.stats.rejected_at).sum(0)
        costs.append(seconds / rounds)
    overall = accepted.sum() / max(accepted.sum() + rejected.sum(), 1)
    tried = accepted + rejected
    alpha = np.where(tried > 0, accepted / np.maximum(tried, 1), overall)
    return costs, tuple(float(a) for a in np.clip(alpha, 0.01, 0.99))
