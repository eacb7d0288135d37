"""The schedule sweep: draft-length schedules × γ × temperature × batch on one pair.

For every batch size and temperature it calibrates a `CostModel` from whole rounds
timed in the loop (γ = 0 … max_gamma on the batch's first prompt group), then times
the autoregressive baseline and each schedule, one compiled program each, interleaved
pass by pass (medians of `repeats` runs, compilation apart): constant γ for each γ in
the grid, the heuristic, the confidence threshold, the cost model and the n-gram
proposer. It
also times a dynamic schedule that always asks for γ = 2 against constant γ = 2
(greedy, so both emit the same tokens in the same rounds): the price of choosing γ
inside the program.

`run_sweep` returns a JSON-able dict; `write_report` writes it with PNG plots and a
markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

from jax_specdec.bench import (
    calibrate_costs,
    calibrate_round_costs,
    expected_tokens_per_round,
    time_generations,
)
from jax_specdec.decode import GenerationStats, autoregressive_program, speculative_program
from jax_specdec.nn import Transformer
from jax_specdec.proposers import NGram
from jax_specdec.sampling import SamplingConfig
from jax_specdec.schedules import Confidence, Constant, Custom, Heuristic

__all__ = ["run_sweep", "summary", "markdown_table", "write_report"]


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
    """One schedule's calls (one per prompt group): time as a sum of medians, stats
    merged over the groups."""

    def __init__(self, timings, outs):
        self.seconds = sum(t.median for t in timings)
        self.compile = timings[0].compile
        self.stats = GenerationStats.merge([o.stats for o in outs])
        self.stats = self.stats.replace(target_calls=sum(int(o.stats.target_calls) for o in outs))
        self.lengths = np.concatenate([np.asarray(o.lengths) for o in outs])
        self.tokens = np.concatenate([np.asarray(o.tokens) for o in outs])
        self.rounds = int(self.stats.target_calls) - len(outs)  # prefills not counted


def _binder(target, proposer, schedule, common):
    """`(prompts, lengths) -> program`: autoregressive if proposer is None, else
    speculative with that draft model or proposer and schedule."""
    if proposer is None:
        return lambda a, n: autoregressive_program(target, a, prompt_lengths=n, **common)
    return lambda a, n: speculative_program(
        target, proposer, a, prompt_lengths=n, schedule=schedule, **common
    )


def _run_interleaved(makes, groups, repeats) -> list[_Run]:
    """Each `make(prompts, lengths)` bound to every prompt group, all timed interleaved
    (`time_interleaved`), so a slow spell of the machine hits every schedule alike and
    the speedups, ratios within one pass, stay honest. One `_Run` per make."""
    programs = [make(array, lengths) for make in makes for array, lengths in groups]
    timings, outputs = time_generations(programs, repeats)
    n = len(groups)
    runs = [
        _Run(timings[i * n : (i + 1) * n], outputs[i * n : (i + 1) * n]) for i in range(len(makes))
    ]
    # Each program holds its compiled code; XLA:CPU maps memory for every kernel, and a
    # grid of dozens of programs exhausts the process's maps.
    jax.clear_caches()
    return runs


def _schedules(gammas, max_gamma, threshold, cost_model):
    """(name, γ or None, proposer is NGram, schedule) for one setting."""
    rows = [("constant", g, False, Constant(g)) for g in gammas]
    rows += [
        ("heuristic", None, False, Heuristic(initial=min(4, max_gamma), max_gamma=max_gamma)),
        ("confidence", None, False, Confidence(threshold=threshold, max_gamma=max_gamma)),
        ("cost_model", None, False, cost_model),
        ("ngram", None, True, Heuristic(initial=min(2, max_gamma), max_gamma=max_gamma)),
    ]
    return rows


def run_sweep(
    target: Transformer,
    draft: Transformer,
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
    progress: bool = True,
) -> dict:
    """Times every schedule against autoregressive decoding; see the module docstring.

    Rows of a batch cycle through `prompts`; batches smaller than `min_rows` are run on
    several prompt groups (batch 1 on `min_rows` prompts) and their times summed.
    Returns a dict with the settings, one row per (batch, temperature, schedule) and
    the γ = 2 switch check per batch.
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("prompts is empty")
    if max(gammas) > max_gamma:
        raise ValueError(f"gammas ({max(gammas)}) exceed max_gamma ({max_gamma})")
    # Steps per batch: the parts, then per temperature the round calibration and the
    # interleaved schedules, then the γ = 2 switch check.
    total = len(batches) * (2 * len(temperatures) + 2)
    bar = tqdm(total=total, desc="sweep", disable=not progress)
    results = {
        "target": dataclasses.asdict(target.config),
        "draft": dataclasses.asdict(draft.config),
        "settings": {
            "batches": list(batches),
            "temperatures": list(temperatures),
            "gammas": list(gammas),
            "max_gamma": max_gamma,
            "max_new_tokens": max_new_tokens,
            "threshold": threshold,
            "repeats": repeats,
            "prompts": len(prompts),
            "min_rows": min_rows,
        },
        "backend": jax.default_backend(),
        "rows": [],
        "switch": [],
        "costs": [],
    }
    for batch in batches:
        groups = _groups(prompts, batch, min_rows)
        array, lengths = groups[0]
        context = int(lengths.max()) + max_new_tokens // 2
        bar.set_postfix(batch=batch, step="calibrate")
        parts = calibrate_costs(
            target, draft, batch=batch, context=context, max_gamma=max_gamma, repeats=repeats
        )
        results["costs"].append(
            {
                "batch": batch,
                "context": context,
                "draft_step_ms": 1e3 * parts.draft_cost,
                "verify_ms": [1e3 * c for c in parts.verify_costs],
            }
        )
        bar.update()
        key = jax.random.key(seed)
        for temperature in temperatures:
            sampling = SamplingConfig(temperature)
            # The cost model runs on whole rounds measured in the loop at this batch and
            # temperature, on all the prompt groups timed below (a small batch is not
            # calibrated on one prompt alone); the standalone parts above are kept for
            # comparison.
            bar.set_postfix(batch=batch, t=temperature, step="calibrate rounds")
            cost = calibrate_round_costs(
                target,
                draft,
                array,
                prompt_lengths=lengths,
                sampling=sampling,
                max_gamma=max_gamma,
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                more_batches=groups[1:],
            )
            results["costs"][-1][f"round_ms_t{temperature:g}"] = [
                1e3 * c for c in cost.verify_costs
            ]
            results["costs"][-1][f"prior_alpha_t{temperature:g}"] = cost.prior_alpha
            round_cost = np.asarray(cost.costs())
            bar.update()
            common = dict(key=key, max_new_tokens=max_new_tokens, sampling=sampling)
            settings = _schedules(gammas, max_gamma, threshold, cost)
            makes = [_binder(target, None, None, common)]
            makes += [
                _binder(target, NGram() if ngram else draft, schedule, common)
                for _, _, ngram, schedule in settings
            ]
            bar.set_postfix(batch=batch, t=temperature, step="schedules")
            ar, *outs = _run_interleaved(makes, groups, repeats)
            ar_rounds = ar.rounds
            for (name, gamma, ngram, _), out in zip(settings, outs, strict=True):
                s = out.stats
                widths = np.asarray(s.gamma_rounds)
                # Predicted from the calibrated costs and the rounds this run made
                # (the draft's costs count only where a draft model ran).
                cost_rounds = round_cost[: len(widths)]
                if ngram:  # no draft model: a round is a verify of that width
                    cost_rounds = np.asarray(parts.verify_costs)[: len(widths)]
                    cost_rounds = cost_rounds * round_cost[0] / cost_rounds[0]
                predicted = ar_rounds * cost.verify_costs[0] / float(widths @ cost_rounds)
                row = {
                    "batch": batch,
                    "temperature": temperature,
                    "schedule": name,
                    "gamma": gamma,
                    "seconds": out.seconds,
                    "compile_seconds": out.compile,
                    "speedup": ar.seconds / out.seconds,
                    "predicted_speedup": predicted,
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
                results["rows"].append(row)
            results["rows"].append(
                {
                    "batch": batch,
                    "temperature": temperature,
                    "schedule": "autoregressive",
                    "gamma": 0,
                    "seconds": ar.seconds,
                    "compile_seconds": ar.compile,
                    "speedup": 1.0,
                }
            )
            bar.update()
        # The price of a dynamic γ: always 2, chosen inside the program, vs constant 2.
        greedy = dict(key=key, max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0))
        bar.set_postfix(batch=batch, step="switch")
        constant, dynamic = _run_interleaved(
            [
                _binder(target, draft, schedule, greedy)
                for schedule in (Constant(2), Custom(_always_two, max_gamma=max_gamma))
            ],
            groups,
            repeats,
        )
        bar.update()
        results["switch"].append(
            {
                "batch": batch,
                "constant_seconds": constant.seconds,
                "dynamic_seconds": dynamic.seconds,
                "rounds": [constant.rounds, dynamic.rounds],
                "dynamic_over_constant": (dynamic.seconds / dynamic.rounds)
                / (constant.seconds / constant.rounds),
            }
        )
    bar.close()
    return results


def summary(results: dict) -> list[dict]:
    """Per (batch, temperature): the best constant γ and each dynamic schedule's speedup,
    and whether the cost model met its goals (never slower than autoregressive, within
    5% of the best constant γ)."""
    out = []
    keys = sorted({(r["batch"], r["temperature"]) for r in results["rows"]})
    for batch, temperature in keys:
        rows = [
            r for r in results["rows"] if r["batch"] == batch and r["temperature"] == temperature
        ]
        by = {r["schedule"]: r for r in rows if r["schedule"] != "constant"}
        best = max((r for r in rows if r["schedule"] == "constant"), key=lambda r: r["speedup"])
        cost = by["cost_model"]["speedup"]
        out.append(
            {
                "batch": batch,
                "temperature": temperature,
                "best_constant_gamma": best["gamma"],
                "best_constant": best["speedup"],
                "heuristic": by["heuristic"]["speedup"],
                "confidence": by["confidence"]["speedup"],
                "cost_model": cost,
                "cost_model_mean_gamma": by["cost_model"]["mean_gamma"],
                "ngram": by["ngram"]["speedup"],
                "cost_model_not_slower": cost >= 1.0,
                "cost_model_within_5pct": cost >= 0.95 * max(best["speedup"], 1.0),
            }
        )
    return out


def markdown_table(results: dict) -> str:
    lines = [
        "| batch | T | best constant γ | its speedup | heuristic | confidence | cost model "
        "(mean γ) | n-gram |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary(results):
        lines.append(
            f"| {s['batch']} | {s['temperature']:g} | {s['best_constant_gamma']} "
            f"| {s['best_constant']:.2f} | {s['heuristic']:.2f} | {s['confidence']:.2f} "
            f"| {s['cost_model']:.2f} ({s['cost_model_mean_gamma']:.1f}) | {s['ngram']:.2f} |"
        )
    lines += ["", "| batch | dynamic γ=2 round / constant γ=2 round |", "|---|---|"]
    for s in results["switch"]:
        lines.append(f"| {s['batch']} | {s['dynamic_over_constant']:.3f} |")
    return "\n".join(lines)


def write_report(results: dict, out_dir) -> list[pathlib.Path]:
    """Writes sweep.json, sweep.md and the PNG plots into out_dir; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown_table(results) + "\n")
    settings = results["settings"]
    temps, batches = settings["temperatures"], settings["batches"]
    rows = results["rows"]

    def pick(**match):
        return [r for r in rows if all(r.get(k) == v for k, v in match.items())]

    def save(fig, name):
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    # 1. Acceptance per draft position (largest constant γ, pooled rows of each batch).
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    g = max(settings["gammas"])
    for ax, t in zip(axes[0], temps, strict=True):
        for b in batches:
            for r in pick(temperature=t, batch=b, schedule="constant", gamma=g):
                acc = [np.nan if a is None else a for a in r["acceptance_at"]][:g]
                ax.plot(range(1, g + 1), acc, marker="o", label=f"batch {b}")
        ax.set(title=f"T = {t:g}, γ = {g}", xlabel="draft position", ylabel="acceptance rate")
        ax.set_ylim(0, 1)
        ax.legend()
    save(fig, "acceptance_per_position.png")

    # 2. Tokens per round vs γ, with the i.i.d. expectation at the measured α.
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for b in batches:
            cs = pick(temperature=t, batch=b, schedule="constant")
            ax.plot(
                [r["gamma"] for r in cs],
                [r["tokens_per_round"] for r in cs],
                "o-",
                label=f"batch {b}",
            )
            ax.plot(
                [r["gamma"] for r in cs],
                [expected_tokens_per_round(r["alpha"], r["gamma"]) for r in cs],
                ":",
                color=ax.lines[-1].get_color(),
            )
        ax.set(title=f"T = {t:g} (dotted: i.i.d. model)", xlabel="γ", ylabel="tokens / round")
        ax.legend()
    save(fig, "tokens_per_round.png")

    # 3. Speedup vs γ, dynamic schedules as markers at their mean γ.
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    markers = {"heuristic": "^", "confidence": "s", "cost_model": "*", "ngram": "x"}
    for ax, t in zip(axes[0], temps, strict=True):
        for b in batches:
            cs = pick(temperature=t, batch=b, schedule="constant")
            (line,) = ax.plot(
                [r["gamma"] for r in cs], [r["speedup"] for r in cs], "o-", label=f"batch {b}"
            )
            for name, m in markers.items():
                for r in pick(temperature=t, batch=b, schedule=name):
                    ax.plot(r["mean_gamma"], r["speedup"], m, color=line.get_color(), markersize=9)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            title=f"T = {t:g}  (^ heuristic, ■ confidence, * cost model, x n-gram)",
            xlabel="γ (mean γ for dynamic schedules)",
            ylabel="speedup vs autoregressive",
        )
        ax.title.set_fontsize(9)
        ax.legend()
    save(fig, "speedup_vs_gamma.png")

    # 4. Measured vs predicted speedup.
    fig, ax = plt.subplots(figsize=(4.8, 4.5))
    spec = [r for r in rows if r["schedule"] != "autoregressive"]
    for name in ("constant", *markers):
        rs = [r for r in spec if r["schedule"] == name]
        ax.plot(
            [r["predicted_speedup"] for r in rs],
            [r["speedup"] for r in rs],
            markers.get(name, "o"),
            label=name,
            alpha=0.8,
        )
    lim = max(max(r["speedup"] for r in spec), max(r["predicted_speedup"] for r in spec)) * 1.05
    ax.plot([0, lim], [0, lim], color="grey", lw=0.8)
    ax.set(
        xlabel="predicted (calibrated costs × rounds run)",
        ylabel="measured",
        title="speedup: measured vs predicted",
    )
    ax.legend()
    save(fig, "measured_vs_predicted.png")
    return paths
