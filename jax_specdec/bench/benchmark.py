"""The benchmark: speculative vs autoregressive decoding of the same target, side by side,
with the parts of a round measured apart and the cost-model prediction next to each
measurement (`python scripts/bench.py`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jax_specdec.bench import timing
from jax_specdec.nn import Transformer
from jax_specdec.report import markdown_table

__all__ = [
    "expected_batch_rounds",
    "expected_tokens_per_round",
    "markdown_report",
    "predicted_speedup",
    "run_benchmark",
]


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """(1 - α^(γ+1)) / (1 - α): tokens per round with i.i.d. acceptance α (docs/design.md)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_batch_rounds(alphas, gamma: int, tokens) -> float:
    """E[rounds until every row has its `tokens`] under the i.i.d. model, row b accepting
    each draft with its own alphas[b]: a round gives a row 1 + min(G, γ) tokens, G
    geometric. A batch runs as many rounds as its slowest row, so this exceeds
    tokens / `expected_tokens_per_round` whenever the rows' rounds vary. Exact: each
    row's distribution of rounds by convolution, then that of their maximum.

    Args:
      alphas: [B] per-row acceptance in [0, 1].
      gamma: drafts per round, >= 0.
      tokens: [B] (or one int) tokens each row must get from rounds.
    """
    alphas = np.clip(np.asarray(alphas, np.float64).reshape(-1), 0.0, 1.0)
    need = np.broadcast_to(np.asarray(tokens, np.int64), alphas.shape)
    if gamma < 0 or np.any(need < 0):
        raise ValueError(f"gamma ({gamma}) and tokens ({tokens}) must be >= 0")
    k = np.arange(gamma + 1)
    # P(a round gives k + 1 tokens): α^k (1 - α) below γ, α^γ at γ.
    per = alphas[:, None] ** k * np.where(k < gamma, 1.0 - alphas[:, None], 1.0)
    top = int(need.max(initial=0))
    short = np.zeros((alphas.size, top + 1))  # P(n tokens so far), n < need: not done
    short[:, 0] = 1.0
    done = np.arange(top + 1)[None] >= need[:, None]
    expected = 0.0
    for _ in range(top):
        short[done] = 0.0
        expected += 1.0 - np.prod(1.0 - short.sum(1))  # P(the slowest row is not done)
        moved = np.zeros_like(short)
        for j in k:
            moved[:, j + 1 :] += short[:, : top - j] * per[:, j : j + 1]
        short = moved
    return expected


def predicted_speedup(alpha: float, gamma: int, *, round_time: float, target_step: float) -> float:
    """Speculative vs autoregressive throughput predicted from measured parts.

    A round (γ draft steps + one verify of γ+1 tokens, measured apart as `round_time`)
    emits `expected_tokens_per_round(α, γ)` tokens; autoregressive decoding emits one
    token per `target_step`.
    """
    return expected_tokens_per_round(alpha, gamma) * target_step / round_time


def _parts(target, draft, *, batch, prompt_len, context, cache_len, repeats, verify=None):
    """The parts of a round and of the loop, each timed apart (dict of `Timing`); with
    `verify` = k, only the target's call on k tokens per row (a `Timing`)."""
    step = functools.partial(
        timing.decode_step_time, batch=batch, cache_len=cache_len, repeats=repeats
    )
    if verify is not None:
        return step(target, tokens_per_call=verify, context=context)
    prefill = dict(tokens_per_call=prompt_len, context=0, steps=2)
    return {
        "target_step": step(target, tokens_per_call=1, context=context),
        "draft_step": step(draft, tokens_per_call=1, context=context),
        "draft_first_step": step(draft, tokens_per_call=2, context=context),
        "target_prefill": step(target, **prefill),
        "draft_prefill": step(draft, **prefill),
        "target_bare_matmul": timing.bare_matmul_time(target, batch=batch, repeats=repeats),
        "draft_bare_matmul": timing.bare_matmul_time(draft, batch=batch, repeats=repeats),
    }


def _baseline_row(batch, measured, parts, public: timing.Timing) -> dict:
    loop_rounds = int(measured.stats.target_calls) - 1
    ar_step = (measured.seconds - parts["target_prefill"].median) / loop_rounds
    return {
        "batch": batch,
        "gamma": 0,
        "seconds": measured.seconds,
        "compile_seconds": measured.timing.compile,
        "ms_per_token": 1e3 * measured.seconds / measured.tokens,
        "loop_step_ms": 1e3 * ar_step,
        "host_overhead_ms": 1e3 * (public.median - measured.seconds),
        "parts_ms": {k: 1e3 * v.median for k, v in parts.items()},
        "loop_step_over_bare_matmul": ar_step / parts["target_bare_matmul"].median,
        "standalone_step_over_bare_matmul": parts["target_step"].median
        / parts["target_bare_matmul"].median,
    }


def _speculative_row(batch, gamma, measured, baseline: dict, parts, verify: timing.Timing) -> dict:
    stats = measured.stats
    alpha = stats.alpha
    prefill = parts["target_prefill"].median + parts["draft_prefill"].median
    round_measured = (measured.seconds - prefill) / (int(stats.target_calls) - 1)
    round_parts = (
        parts["draft_first_step"].median + (gamma - 1) * parts["draft_step"].median + verify.median
    )
    predicted = predicted_speedup(
        alpha, gamma, round_time=round_parts, target_step=parts["target_step"].median
    )
    # The batch: each row's own α, and as many rounds as its slowest row.
    accepted, rejected = np.asarray(stats.accepted), np.asarray(stats.rejected)
    row_alpha = accepted / np.maximum(accepted + rejected, 1)
    need = np.asarray(measured.output.lengths) - 1  # the prefill gives the first token
    batch_rounds = expected_batch_rounds(row_alpha, gamma, need)
    predicted_batch = need.max() * parts["target_step"].median / (batch_rounds * round_parts)
    speedup = baseline["seconds"] / measured.seconds
    return {
        "batch": batch,
        "gamma": gamma,
        "seconds": measured.seconds,
        "compile_seconds": measured.timing.compile,
        "ms_per_token": 1e3 * measured.seconds / measured.tokens,
        "alpha": alpha,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_round": stats.tokens_per_round(measured.output.lengths),
        "expected_tokens_per_round": expected_tokens_per_round(alpha, gamma),
        "verify_ms": 1e3 * verify.median,
        "round_ms": 1e3 * round_measured,
        "round_parts_ms": 1e3 * round_parts,
        "round_over_parts": round_measured / round_parts,
        "speedup": speedup,
        "predicted_speedup": predicted,
        "measured_over_predicted": speedup / predicted,
        "expected_batch_rounds": batch_rounds,
        "predicted_batch_speedup": predicted_batch,
        "measured_over_predicted_batch": speedup / predicted_batch,
    }


def _settings(target, draft, sampling, prompt_len, max_new_tokens, repeats) -> dict:
    return {
        "target": dataclasses.asdict(target.config),
        "draft": dataclasses.asdict(draft.config),
        "sampling": dataclasses.asdict(sampling),
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "rows": [],
    }


def run_benchmark(
    target: Transformer,
    draft: Transformer,
    *,
    batches=(1, 8, 32),
    gammas=(1, 2, 4, 8),
    prompt_len: int = 32,
    max_new_tokens: int = 64,
    sampling=None,
    repeats: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Speculative vs autoregressive decoding of the same target, side by side.

    For each batch size: the autoregressive baseline and each γ's speculative loop,
    timed interleaved (`measure`); the parts (target decode step, draft steps, verify
    of γ+1 tokens, prefills, the bare-matmul floor); each γ's measured α, round time
    and predicted vs measured speedup. `sampling` defaults to temperature 1. Returns a
    JSON-able dict.
    """
    from tqdm.auto import tqdm

    from jax_specdec.decode import Generator
    from jax_specdec.sampling import SamplingConfig

    sampling = SamplingConfig(1.0) if sampling is None else sampling
    context = prompt_len + max_new_tokens // 2
    cache_len = prompt_len + max_new_tokens + max(gammas)
    results = _settings(target, draft, sampling, prompt_len, max_new_tokens, repeats)
    generators = [Generator(target, sampling=sampling)]
    generators += [Generator(target, draft, schedule=g, sampling=sampling) for g in gammas]
    shape = dict(prompt_len=prompt_len, context=context, cache_len=cache_len, repeats=repeats)
    for batch in tqdm(batches, desc="bench", disable=not progress):
        rng = np.random.default_rng(seed + batch)
        prompts = rng.integers(0, target.config.vocab_size, (batch, prompt_len)).astype(np.int32)
        runs = [
            g.bind(prompts, key=jax.random.key(seed), max_new_tokens=max_new_tokens)
            for g in generators
        ]
        measured = timing.measure(runs, repeats)
        parts = _parts(target, draft, batch=batch, **shape)
        public = timing.time_call(
            lambda p=prompts: (
                generators[0]
                .bind(p, key=jax.random.key(seed), max_new_tokens=max_new_tokens)()
                .tokens
            ),
            repeats,
        )
        baseline = _baseline_row(batch, measured[0], parts, public)
        results["rows"].append(baseline)
        for gamma, m in zip(gammas, measured[1:], strict=True):
            verify = _parts(target, None, batch=batch, verify=gamma + 1, **shape)
            results["rows"].append(_speculative_row(batch, gamma, m, baseline, parts, verify))
    results["peak_rss_mib"] = timing.peak_rss_mib()
    if jax.default_backend() != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        results["peak_device_mib"] = stats.get("peak_bytes_in_use", 0) / 2**20
    return results


def _run_cells(r: dict) -> list:
    if r["gamma"] == 0:
        p = r["parts_ms"]
        loop = f"{r['loop_step_ms']:.2f}"
        return [r["batch"], "AR", f"{r['ms_per_token']:.2f}", "1.00", "", "", "", "", "", "1", loop,
                f"{p['target_step']:.2f}", f"{r['loop_step_ms'] / p['target_step']:.2f}",
                f"{r['compile_seconds']:.1f}"]  # fmt: skip
    keys = ("ms_per_token", "speedup", "predicted_speedup", "measured_over_predicted")
    keys += ("predicted_batch_speedup", "measured_over_predicted_batch")
    keys += ("alpha", "tokens_per_round", "round_ms", "round_parts_ms", "round_over_parts")
    digits = {"alpha": 3}
    cells = [f"{r[k]:.{digits.get(k, 2)}f}" if k in r else "" for k in keys]
    return [r["batch"], r["gamma"], *cells, f"{r['compile_seconds']:.1f}"]


def markdown_report(results: dict) -> str:
    """The benchmark results as two markdown tables: the runs, and the step parts."""
    runs = [_run_cells(r) for r in results["rows"]]
    parts = [
        [
            r["batch"],
            *(
                f"{r['parts_ms'][k]:.2f}"
                for k in ("target_step", "draft_step", "target_bare_matmul")
            ),
            f"{r['loop_step_over_bare_matmul']:.2f}",
            f"{r['standalone_step_over_bare_matmul']:.2f}",
        ]  # fmt: skip
        for r in results["rows"]
        if r["gamma"] == 0
    ]
    run_header = ["batch", "γ", "ms/token", "speedup", "predicted", "measured/predicted",
                  "predicted (batch)", "measured/predicted (batch)", "α",
                  "tokens/round", "round ms", "parts ms", "round/parts", "compile s"]  # fmt: skip
    part_header = ["batch", "target step ms", "draft step ms", "target bare matmul ms",
                   "AR loop step / bare matmul", "standalone step / bare matmul"]  # fmt: skip
    return markdown_table(run_header, runs) + "\n\n" + markdown_table(part_header, parts)
