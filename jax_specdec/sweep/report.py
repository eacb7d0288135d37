"""The sweep's report: a summary per setting, a markdown table, and PNG plots saved next
to the JSON data."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jax_specdec.bench import expected_tokens_per_round
from jax_specdec.report import markdown_table

__all__ = ["markdown_summary", "summary", "write_report"]


def summary(results: dict) -> list[dict]:
    """Per (batch, temperature): the best constant γ and each dynamic schedule's speedup
    (confidence None where the drafter has none: a feature head), and whether the cost
    model met its goals (never slower than autoregressive, within 5% of the best
    constant γ); `cost_model_explore` where the sweep timed the exploring cost model."""
    out = []
    keys = sorted({(r["batch"], r["temperature"]) for r in results["rows"]})
    for batch, temperature in keys:
        rows = [
            r for r in results["rows"] if r["batch"] == batch and r["temperature"] == temperature
        ]
        by = {r["schedule"]: r for r in rows if r["schedule"] != "constant"}
        best = max((r for r in rows if r["schedule"] == "constant"), key=lambda r: r["speedup"])
        cost = by["cost_model"]["speedup"]
        explore = by.get("cost_model_explore")
        out.append(
            {
                "batch": batch,
                "temperature": temperature,
                "best_constant_gamma": best["gamma"],
                "best_constant": best["speedup"],
                "heuristic": by["heuristic"]["speedup"],
                "confidence": by["confidence"]["speedup"] if "confidence" in by else None,
                "cost_model": cost,
                "cost_model_mean_gamma": by["cost_model"]["mean_gamma"],
                "cost_model_explore": None if explore is None else explore["speedup"],
                "cost_model_explore_mean_gamma": None if explore is None else explore["mean_gamma"],
                "ngram": by["ngram"]["speedup"],
                "cost_model_not_slower": cost >= 1.0,
                "cost_model_within_5pct": cost >= 0.95 * max(best["speedup"], 1.0),
            }
        )
    return out


def markdown_summary(results: dict) -> str:
    """The summary as two markdown tables: speedups per setting, and the switch's price."""
    settings = summary(results)
    # The sweep times the exploring cost model in every setting or in none.
    explore = settings[0]["cost_model_explore"] is not None
    trees = sorted({r["schedule"] for r in results["rows"] if r["schedule"].startswith("tree")})
    rows = []
    for s in settings:
        row = [
            s["batch"],
            f"{s['temperature']:g}",
            s["best_constant_gamma"],
            f"{s['best_constant']:.2f}",
            f"{s['heuristic']:.2f}",
            "—" if s["confidence"] is None else f"{s['confidence']:.2f}",
            f"{s['cost_model']:.2f} ({s['cost_model_mean_gamma']:.1f})",
        ]
        if explore:
            row.append(f"{s['cost_model_explore']:.2f} ({s['cost_model_explore_mean_gamma']:.1f})")
        rows.append([*row, f"{s['ngram']:.2f}", *_tree_cells(results, s, trees)])
    header = [
        "batch",
        "T",
        "best constant γ",
        "its speedup",
        "heuristic",
        "confidence",
        "cost model (mean γ)",
        *(["exploring (mean γ)"] if explore else []),
        "n-gram",
        *(f"{name} (tokens/round)" for name in trees),
    ]
    switch = [[s["batch"], f"{s['dynamic_over_constant']:.3f}"] for s in results["switch"]]
    return (
        markdown_table(header, rows)
        + "\n\n"
        + markdown_table(["batch", "dynamic γ=2 round / constant γ=2 round"], switch)
    )


def _tree_cells(results: dict, setting: dict, trees: list[str]) -> list[str]:
    """Each tree's speedup and tokens per round at the setting's batch and temperature."""
    cells = []
    for name in trees:
        (row,) = [
            r
            for r in results["rows"]
            if r["schedule"] == name
            and r["batch"] == setting["batch"]
            and r["temperature"] == setting["temperature"]
        ]
        cells.append(f"{row['speedup']:.2f} ({row['tokens_per_round']:.2f})")
    return cells


def write_report(results: dict, out_dir) -> list[pathlib.Path]:
    """Writes sweep.json, sweep.md and the PNG plots into out_dir; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown_summary(results) + "\n")
    for name, plot in (
        ("acceptance_per_position.png", _acceptance_plot),
        ("tokens_per_round.png", _tokens_plot),
        ("speedup_vs_gamma.png", _speedup_plot),
        ("measured_vs_predicted.png", _predicted_plot),
    ):
        fig = plot(results, plt)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _pick(results, **match):
    return [r for r in results["rows"] if all(r.get(k) == v for k, v in match.items())]


def _panels(results, plt, width: float, height: float):
    """A figure with one panel per temperature: (fig, [(ax, temperature), ...])."""
    temps = results["settings"]["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(width * len(temps), height), squeeze=False)
    return fig, list(zip(axes[0], temps, strict=True))


def _acceptance_plot(results, plt):
    """Acceptance per draft position (largest constant γ, pooled rows of each batch)."""
    settings = results["settings"]
    fig, panels = _panels(results, plt, 5, 3.6)
    g = max(settings["gammas"])
    for ax, t in panels:
        for b in settings["batches"]:
            for r in _pick(results, temperature=t, batch=b, schedule="constant", gamma=g):
                acc = [np.nan if a is None else a for a in r["acceptance_at"]][:g]
                ax.plot(range(1, g + 1), acc, marker="o", label=f"batch {b}")
        ax.set(title=f"T = {t:g}, γ = {g}", xlabel="draft position", ylabel="acceptance rate")
        ax.set_ylim(0, 1)
        ax.legend()
    return fig


def _tokens_plot(results, plt):
    """Tokens per round vs γ, with the i.i.d. expectation at the measured α."""
    fig, panels = _panels(results, plt, 5, 3.6)
    for ax, t in panels:
        for b in results["settings"]["batches"]:
            cs = _pick(results, temperature=t, batch=b, schedule="constant")
            gammas = [r["gamma"] for r in cs]
            ax.plot(gammas, [r["tokens_per_round"] for r in cs], "o-", label=f"batch {b}")
            expected = [expected_tokens_per_round(r["alpha"], r["gamma"]) for r in cs]
            ax.plot(gammas, expected, ":", color=ax.lines[-1].get_color())
        ax.set(title=f"T = {t:g} (dotted: i.i.d. model)", xlabel="γ", ylabel="tokens / round")
        ax.legend()
    return fig


_MARKERS = {
    "heuristic": "^",
    "confidence": "s",
    "cost_model": "*",
    "cost_model_explore": "P",
    "ngram": "x",
}


def _speedup_plot(results, plt):
    """Speedup vs γ, dynamic schedules as markers at their mean γ."""
    fig, panels = _panels(results, plt, 5.5, 4)
    for ax, t in panels:
        for b in results["settings"]["batches"]:
            cs = _pick(results, temperature=t, batch=b, schedule="constant")
            (line,) = ax.plot(
                [r["gamma"] for r in cs], [r["speedup"] for r in cs], "o-", label=f"batch {b}"
            )
            for name, m in _MARKERS.items():
                for r in _pick(results, temperature=t, batch=b, schedule=name):
                    ax.plot(r["mean_gamma"], r["speedup"], m, color=line.get_color(), markersize=9)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            title=f"T = {t:g}  (^ heuristic, ■ confidence, * cost model, + exploring, x n-gram)",
            xlabel="γ (mean γ for dynamic schedules)",
            ylabel="speedup vs autoregressive",
        )
        ax.title.set_fontsize(9)
        ax.legend()
    return fig


def _predicted_plot(results, plt):
    """Measured vs predicted speedup."""
    fig, ax = plt.subplots(figsize=(4.8, 4.5))
    spec = [r for r in results["rows"] if r.get("predicted_speedup") is not None]
    for name in ("constant", *_MARKERS):
        rs = [r for r in spec if r["schedule"] == name]
        predicted, measured = [r["predicted_speedup"] for r in rs], [r["speedup"] for r in rs]
        ax.plot(predicted, measured, _MARKERS.get(name, "o"), label=name, alpha=0.8)
    lim = max(max(r["speedup"] for r in spec), max(r["predicted_speedup"] for r in spec)) * 1.05
    ax.plot([0, lim], [0, lim], color="grey", lw=0.8)
    ax.set(
        xlabel="predicted (calibrated costs × rounds run)",
        ylabel="measured",
        title="speedup: measured vs predicted",
    )
    ax.legend()
    return fig
