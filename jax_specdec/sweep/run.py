"""The schedule sweep: draft-length schedules × γ × temperature × batch on one pair.

For every batch size and temperature it calibrates a `CostModel` from whole rounds
timed in the loop (γ = 0 … max_gamma on the batch's prompt groups), then times the
autoregressive baseline and each schedule, one compiled program each, interleaved
pass by pass (medians of `repeats` runs, compilation apart): constant γ for each γ in
the grid, the heuristic, the confidence threshold, the cost model (and, with
`explore` > 0, the same cost model planning on optimistic acceptance, side by side) and
the n-gram proposer. It also times a dynamic schedule that always asks for γ = 2
against constant γ = 2 (greedy, so both emit the same tokens in the same rounds): the
price of choosing γ inside the program.

`run_sweep` returns a JSON-able dict; `write_report` writes it with PNG plots and a
markdown table.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_specdec.bench import (
    calibrate_costs,
    calibrate_round_costs,
    drop_programs_if_crowded,
    expected_tokens_per_round,
    measure,
)
from jax_specdec.decode import GenerationStats, Generator, NGram
from jax_specdec.decode.drafters.feature_head import AttachedHead
from jax_specdec.decode.tree import Tree
from jax_specdec.nn import Transformer
from jax_specdec.sampling import SamplingConfig
from jax_specdec.schedules import (
    Confidence,
    Constant,
    Custom,
    Heuristic,
)

__all__ = ["run_sweep"]


def _always_two(stats):
    return 2


def _groups(prompts, batch, min_rows):
    """Batches of `batch` prompts (cycling) covering at least `min_rows` rows, as
    equally padded arrays so they share one compiled program."""
    width = max(len(p) for p in prompts)
    calls = -(-min_rows // batch)
    out = []
    for c in range(calls):
        rows = [prompts[(c * batch + i) % len(prompts)] for i in range(batch)]
        array = np.zeros((batch, width), np.int32)
        for i, r in enumerate(rows):
            array[i, : len(r)] = r
        out.append((array, np.array([len(r) for r in rows], np.int32)))
    return out


class _Run:
    """One generator's calls (one per prompt group): time as a sum of medians, stats
    merged over the groups."""

    def __init__(self, measured):
        outs = [m.output for m in measured]
        self.seconds = sum(m.seconds for m in measured)
        self.compile = measured[0].timing.compile
        self.stats = GenerationStats.merge([o.stats for o in outs])
        self.stats = self.stats.replace(target_calls=sum(int(o.stats.target_calls) for o in outs))
        self.lengths = np.concatenate([np.asarray(o.lengths) for o in outs])
        self.tokens = np.concatenate([np.asarray(o.tokens) for o in outs])
        self.rounds = int(self.stats.target_calls) - len(outs)  # prefills not counted


def _run_interleaved(generators, groups, key, max_new_tokens, repeats) -> list[_Run]:
    """Each generator bound to every prompt group, all timed interleaved (`measure`), so
    a slow spell of the machine hits every schedule alike and the speedups, ratios
    within one pass, stay honest. One `_Run` per generator."""
    runs = [
        g.bind(array, key=key, max_new_tokens=max_new_tokens, prompt_lengths=lengths)
        for g in generators
        for array, lengths in groups
    ]
    measured = measure(runs, repeats)
    n = len(groups)
    out = [_Run(measured[i * n : (i + 1) * n]) for i in range(len(generators))]
    # Each program holds its compiled code; XLA:CPU maps memory for every kernel, and a
    # grid of dozens of programs would exhaust the process's maps.
    drop_programs_if_crowded()
    return out


def _schedules(gammas, max_gamma, threshold, cost_model, draft, explore: float):
    """(name, γ or None, drafts with NGram, schedule) for one setting. A feature head
    has no confidence schedule (the Generator refuses it), so none is timed; the
    exploring cost model only where `explore` > 0."""
    rows = [("constant", g, False, Constant(g)) for g in gammas]
    rows += [
        ("heuristic", None, False, Heuristic(initial=min(4, max_gamma), max_gamma=max_gamma)),
        ("confidence", None, False, Confidence(threshold=threshold, max_gamma=max_gamma)),
        ("cost_model", None, False, cost_model),
        ("cost_model_explore", None, False, dataclasses.replace(cost_model, explore=explore)),
        ("ngram", None, True, Heuristic(initial=min(2, max_gamma), max_gamma=max_gamma)),
    ]
    skip = {"confidence"} if isinstance(draft, AttachedHead) else set()
    if not explore:
        skip.add("cost_model_explore")
    return [r for r in rows if r[0] not in skip]


def _generator(target, draft, ngram, schedule, sampling) -> Generator:
    """A setting's generator; a `Tree` setting drafts trees of its depth."""
    if isinstance(schedule, Tree):
        return Generator(target, draft, schedule=schedule.depth, tree=schedule, sampling=sampling)
    return Generator(target, NGram() if ngram else draft, schedule=schedule, sampling=sampling)


def _row(name, gamma, ngram, out: _Run, ar: _Run, cost, parts) -> dict:
    """One schedule's figures, with the speedup predicted from the calibrated costs and
    the rounds this run made (the draft's costs count only where a draft model ran)."""
    s = out.stats
    widths = np.asarray(s.gamma_rounds)
    round_cost = np.asarray(cost.costs())
    cost_rounds = round_cost[: len(widths)]
    if ngram:  # no draft model: a round is a verify of that width
        cost_rounds = np.asarray(parts.verify_costs)[: len(widths)]
        cost_rounds = cost_rounds * round_cost[0] / cost_rounds[0]
    row = {
        "schedule": name,
        "gamma": gamma,
        "seconds": out.seconds,
        "compile_seconds": out.compile,
        "speedup": ar.seconds / out.seconds,
        "predicted_speedup": ar.rounds * cost.verify_costs[0] / float(widths @ cost_rounds),
        "alpha": s.alpha,
        "tokens_per_round": s.tokens_per_round(out.lengths),
        "acceptance_at": [None if np.isnan(a) else a for a in s.acceptance_at()],
        "conditional_acceptance_at": [
            None if np.isnan(a) else a for a in s.conditional_acceptance_at()
        ],
        "gamma_rounds": widths.tolist(),
        "mean_gamma": float(widths @ np.arange(len(widths)) / max(widths.sum(), 1)),
        "same_tokens_as_autoregressive": bool(np.array_equal(out.tokens, ar.tokens)),
    }
    if gamma is not None:
        row["iid_predicted_speedup"] = (
            expected_tokens_per_round(s.alpha, gamma)
            * cost.verify_costs[0]
            / float(round_cost[gamma])
        )
    return row


def _temperature(target, draft, groups, temperature, parts, sweep: dict) -> tuple[dict, list]:
    """At one batch size and temperature: the round calibration, then every schedule
    and the autoregressive baseline timed interleaved. Returns (costs, rows)."""
    sampling = SamplingConfig(temperature)
    # The cost model runs on whole rounds measured in the loop at this batch and
    # temperature, on all the prompt groups timed below (a small batch is not calibrated
    # on one prompt alone); the standalone parts are kept for comparison.
    (array, lengths), n = groups[0], sweep["max_new_tokens"]
    cost = calibrate_round_costs(
        target,
        draft,
        array,
        prompt_lengths=lengths,
        sampling=sampling,
        max_gamma=sweep["max_gamma"],
        max_new_tokens=n,
        repeats=sweep["repeats"],
        more_batches=groups[1:],
    )
    costs = {
        f"round_ms_t{temperature:g}": [1e3 * c for c in cost.verify_costs],
        f"prior_alpha_t{temperature:g}": cost.prior_alpha,
    }
    settings = _schedules(
        sweep["gammas"], sweep["max_gamma"], sweep["threshold"], cost, draft, sweep["explore"]
    )
    trees = [Tree(**t) for t in sweep["trees"]]
    settings += [(f"tree {t.label}", None, False, t) for t in trees]
    generators = [Generator(target, sampling=sampling)]
    generators += [_generator(target, draft, *setting[2:], sampling) for setting in settings]
    key = jax.random.key(sweep["seed"])
    ar, *outs = _run_interleaved(generators, groups, key, n, sweep["repeats"])
    rows = [
        _row(name, gamma, ngram, out, ar, cost, parts)
        for (name, gamma, ngram, _), out in zip(settings, outs, strict=True)
    ]
    for row, (_, _, _, schedule) in zip(rows, settings, strict=True):
        if isinstance(schedule, Tree):  # the calibration holds chains' rounds only
            row["predicted_speedup"] = None
    rows.append(
        {
            "schedule": "autoregressive",
            "gamma": 0,
            "seconds": ar.seconds,
            "compile_seconds": ar.compile,
            "speedup": 1.0,
        }
    )
    return costs, rows


def _switch(target, draft, groups, batch, sweep: dict) -> dict:
    """The price of a dynamic γ: always 2, chosen inside the program, vs constant 2."""
    schedules = (Constant(2), Custom(_always_two, max_gamma=sweep["max_gamma"]))
    generators = [Generator(target, draft, schedule=s) for s in schedules]  # greedy
    key = jax.random.key(sweep["seed"])
    constant, dynamic = _run_interleaved(
        generators, groups, key, sweep["max_new_tokens"], sweep["repeats"]
    )
    return {
        "batch": batch,
        "constant_seconds": constant.seconds,
        "dynamic_seconds": dynamic.seconds,
        "rounds": [constant.rounds, dynamic.rounds],
        "dynamic_over_constant": (dynamic.seconds / dynamic.rounds)
        / (constant.seconds / constant.rounds),
    }


def run_sweep(
    target: Transformer,
    draft,
    prompts: list[list[int]],
    *,
    batches=(1, 8, 32, 64),
    temperatures=(0.0, 1.0),
    gammas=(1, 2, 3, 4, 6),
    max_gamma: int = 6,
    max_new_tokens: int = 64,
    threshold: float = 0.4,
    repeats: int = 3,
    seed: int = 0,
    min_rows: int = 8,
    explore: float = 0.0,
    trees=(),
    progress: bool = True,
) -> dict:
    """Times every schedule against autoregressive decoding; see the module docstring.

    `draft` is a draft model or a feature head attached to the target (`attach`; it has
    no confidence schedule). Rows of a batch cycle through `prompts`; batches smaller
    than `min_rows` are run on several prompt groups (batch 1 on `min_rows` prompts)
    and their times summed. `explore` > 0 also times the cost model with
    `CostModel.explore` set to it, interleaved with the rest; each of `trees` (a
    `decode.tree.Tree`; the draft a feature head) is timed as one more setting.
    Returns a dict with the settings, one row per (batch, temperature, schedule) and
    the γ = 2 switch check per batch.
    """
    from tqdm.auto import tqdm

    _check(prompts, gammas, max_gamma, explore)
    sweep = {
        "batches": list(batches),
        "temperatures": list(temperatures),
        "gammas": list(gammas),
        "max_gamma": max_gamma,
        "max_new_tokens": max_new_tokens,
        "threshold": threshold,
        "repeats": repeats,
        "prompts": len(prompts),
        "min_rows": min_rows,
        "seed": seed,
        "explore": explore,
        "trees": [dataclasses.asdict(t) for t in trees],
    }
    results = {
        "target": dataclasses.asdict(target.config),
        "draft": dataclasses.asdict(draft.config),
        "settings": sweep,
        "backend": jax.default_backend(),
        "rows": [],
        "switch": [],
        "costs": [],
    }
    # Steps per batch: the parts, each temperature, then the γ = 2 switch check.
    bar = tqdm(total=len(batches) * (len(temperatures) + 2), desc="sweep", disable=not progress)
    for batch in batches:
        _batch(target, draft, _groups(prompts, batch, min_rows), batch, results, bar)
    bar.close()
    return results


def _check(prompts, gammas, max_gamma: int, explore: float) -> None:
    if not prompts:
        raise ValueError("prompts is empty")
    if max(gammas) > max_gamma:
        raise ValueError(f"gammas ({max(gammas)}) exceed max_gamma ({max_gamma})")
    if not 0.0 <= explore < float("inf"):
        raise ValueError(f"explore must be finite and >= 0, got {explore}")


def _batch(target, draft, groups, batch: int, results: dict, bar) -> None:
    """One batch size: the standalone parts, each temperature, the switch check."""
    sweep = results["settings"]
    context = int(groups[0][1].max()) + sweep["max_new_tokens"] // 2
    bar.set_postfix(batch=batch, step="calibrate")
    parts = calibrate_costs(
        target,
        draft,
        batch=batch,
        context=context,
        max_gamma=sweep["max_gamma"],
        repeats=sweep["repeats"],
    )
    costs = {
        "batch": batch,
        "context": context,
        "draft_step_ms": 1e3 * parts.draft_cost,
        "verify_ms": [1e3 * c for c in parts.verify_costs],
    }
    bar.update()
    for temperature in sweep["temperatures"]:
        bar.set_postfix(batch=batch, t=temperature, step="schedules")
        more, rows = _temperature(target, draft, groups, temperature, parts, sweep)
        costs.update(more)
        results["rows"] += [{"batch": batch, "temperature": temperature, **r} for r in rows]
        bar.update()
    results["costs"].append(costs)
    bar.set_postfix(batch=batch, step="switch")
    results["switch"].append(_switch(target, draft, groups, batch, sweep))
    bar.update()
