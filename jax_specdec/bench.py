"""Measurement helpers: timing of compiled calls, the parts of a round, the cost model.

Everything is timed inside one jitted program per measurement (a `fori_loop` of
`steps` calls), so dispatch overhead does not count; results are medians of
`repeats` runs after a warm-up call that also gives the compile time.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec.nn import Transformer, init_cache

__all__ = [
    "Timing",
    "time_call",
    "time_generation",
    "time_interleaved",
    "time_generations",
    "expected_tokens_per_round",
    "predicted_speedup",
    "decode_step_time",
    "bare_matmul_time",
    "peak_rss_mib",
    "calibrate_costs",
    "calibrate_round_costs",
]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds: `first` (compile + one run), the `median` and all `runs` after it."""

    first: float
    median: float
    runs: tuple[float, ...]

    @property
    def compile(self) -> float:
        return max(self.first - self.median, 0.0)


def time_call(fn: Callable[[], object], repeats: int = 5) -> Timing:
    """Times fn() (which must return jax arrays) once cold, then `repeats` times warm."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - start)
    return Timing(first, statistics.median(runs), tuple(runs))


def time_interleaved(fns: Sequence[Callable[[], object]], repeats: int = 5) -> list[Timing]:
    """Times several calls against each other: each once cold, then `repeats` passes
    that run every call once (each pass starting one call later), so that a slow spell
    of a shared machine falls on all of them alike. One Timing per call."""
    if not fns:
        raise ValueError("fns is empty")
    firsts, runs = [], [[] for _ in fns]
    for fn in fns:
        start = time.perf_counter()
        jax.block_until_ready(fn())
        firsts.append(time.perf_counter() - start)
    for r in range(repeats):
        for i in range(len(fns)):
            j = (i + r) % len(fns)
            start = time.perf_counter()
            jax.block_until_ready(fns[j]())
            runs[j].append(time.perf_counter() - start)
    return [
        Timing(first, statistics.median(rs), tuple(rs))
        for first, rs in zip(firsts, runs, strict=True)
    ]


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """(1 - α^(γ+1)) / (1 - α): tokens per round with i.i.d. acceptance α (DESIGN §2)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, *, round_time: float, target_step: float) -> float:
    """Speculative vs autoregressive throughput predicted from measured parts.

    A round (γ draft steps + one verify of γ+1 tokens, measured apart as `round_time`)
    emits `expected_tokens_per_round(α, γ)` tokens; autoregressive decoding emits one
    token per `target_step`.
    """
    return expected_tokens_per_round(alpha, gamma) * target_step / round_time


def _fill_cache(model: Transformer, batch: int, cache_len: int, context: int):
    cache = init_cache(model.config, batch=batch, max_len=cache_len)
    return cache.replace(lengths=jnp.full((batch,), context, jnp.int32))


def decode_step_time(
    model: Transformer,
    *,
    batch: int,
    tokens_per_call: int,
    context: int,
    cache_len: int,
    steps: int = 16,
    repeats: int = 5,
) -> Timing:
    """Time of one `model.decode` of `tokens_per_call` tokens per row at `context`.

    The cache is rolled back after every call (as a rejected round would), so each of
    the `steps` calls inside the loop does the same work. Returns per-call seconds.
    """
    graphdef, state = nnx.split(model)
    cache = _fill_cache(model, batch, cache_len, context)
    tokens = jnp.ones((batch, tokens_per_call), jnp.int32)

    @jax.jit
    def run(state, cache, tokens):
        m = nnx.merge(graphdef, state)

        def body(_, carry):
            cache, acc = carry
            logits, new = m.decode(tokens, cache)
            return new.replace(lengths=cache.lengths), acc + logits[:, -1, 0]

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch,), jnp.float32)))[1]

    timing = time_call(lambda: run(state, cache, tokens), repeats)
    return Timing(timing.first, timing.median / steps, tuple(t / steps for t in timing.runs))


def bare_matmul_time(
    model: Transformer, *, batch: int, steps: int = 16, repeats: int = 5
) -> Timing:
    """The floor under a decode step: only the weight matmuls of one token per row.

    Every 2-D weight (and the tied embedding as the output projection) is multiplied
    by a [batch, in] activation; no attention, no cache, no norms.
    """
    graphdef, state = nnx.split(model)
    weights = []
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path[-1]
        if value.ndim != 2 or name == "pos_embed":
            continue
        if name == "embed":
            if model.config.tie_embeddings:
                weights.append(value[...].T)
            continue
        weights.append(value[...])

    @jax.jit
    def run(weights):
        def body(i, acc):
            total = acc
            for w in weights:
                x = jnp.full((batch, w.shape[0]), 1e-3, w.dtype) + i.astype(w.dtype) * 1e-6
                total = total + jnp.sum(x @ w)
            return total

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

    timing = time_call(lambda: run(weights), repeats)
    del graphdef, state
    return Timing(timing.first, timing.median / steps, tuple(t / steps for t in timing.runs))


def calibrate_costs(
    target: Transformer,
    draft: Transformer,
    *,
    batch: int,
    context: int,
    max_gamma: int,
    cache_len: int | None = None,
    repeats: int = 5,
    prior_alpha: float = 0.6,
):
    """A `schedules.CostModel` from measured costs at this batch size and context: one
    draft step, and a target call on k = 1 … max_gamma + 1 tokens per row."""
    from jax_specdec.schedules import CostModel

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
    target: Transformer,
    draft: Transformer,
    prompts,
    *,
    max_gamma: int,
    prompt_lengths=None,
    sampling=None,
    max_new_tokens: int = 48,
    repeats: int = 5,
    prior_alpha: float | tuple[float, ...] | None = None,
    more_batches: Sequence[tuple[object, object]] = (),
):
    """A `schedules.CostModel` from whole rounds timed inside the compiled loop: the
    autoregressive program (γ = 0) and constant-γ programs for γ = 1 … max_gamma on
    `prompts` with `sampling` (default greedy), each minus its prefill (a 1-token run),
    per round. All 2 (max_gamma + 1) programs (per batch) are timed interleaved
    (`time_interleaved`).
    Unlike `calibrate_costs` it includes sampling, acceptance and the loop's bookkeeping.

    `more_batches`: further `(prompts, prompt_lengths)` batches, timed and counted with
    the first (seconds and rounds summed over the batches), so a small batch is not
    calibrated on one prompt alone.

    `prior_alpha` None: the acceptance of each draft position (given the drafts
    before it were accepted) that those constant-γ runs measured, the model's starting
    belief. It only learns from rounds that draft, so a wrong prior that picks γ = 0
    would never be corrected.
    """
    from jax_specdec.decode import autoregressive_program, speculative_program
    from jax_specdec.sampling import SamplingConfig
    from jax_specdec.schedules import CostModel

    sampling = SamplingConfig(0.0) if sampling is None else sampling

    def make(gamma, n, batch, lengths):
        common = dict(key=jax.random.key(0), sampling=sampling, prompt_lengths=lengths)
        if gamma == 0:
            return autoregressive_program(target, batch, max_new_tokens=n, **common)
        return speculative_program(
            target, draft, batch, max_new_tokens=n, num_draft_tokens=gamma, **common
        )

    batches = [(prompts, prompt_lengths), *more_batches]
    for b in batches[1:]:
        if not (isinstance(b, tuple) and len(b) == 2):
            raise ValueError(
                f"more_batches must hold (prompts, prompt_lengths) tuples, got {type(b).__name__}"
            )
    programs = [
        make(g, n, *batch)
        for g in range(max_gamma + 1)
        for batch in batches
        for n in (1, max_new_tokens)
    ]
    timings, outputs = time_generations(programs, repeats)
    jax.clear_caches()
    costs = []
    accepted, rejected = np.zeros(max_gamma), np.zeros(max_gamma)
    for g in range(max_gamma + 1):
        seconds, rounds = 0.0, 0
        for b in range(len(batches)):
            i = 2 * (g * len(batches) + b)
            seconds += max(timings[i + 1].median - timings[i].median, 1e-9)
            stats = outputs[i + 1].stats
            rounds += int(stats.target_calls) - 1
            if g > 0:
                accepted[:g] += np.asarray(stats.accepted_at).sum(0)
                rejected[:g] += np.asarray(stats.rejected_at).sum(0)
        costs.append(seconds / rounds)
    if prior_alpha is None:
        overall = accepted.sum() / max(accepted.sum() + rejected.sum(), 1)
        tried = accepted + rejected
        alpha = np.where(tried > 0, accepted / np.maximum(tried, 1), overall)
        prior_alpha = tuple(float(a) for a in np.clip(alpha, 0.01, 0.99))
    return CostModel(draft_cost=0.0, verify_costs=tuple(costs), prior_alpha=prior_alpha)


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_generations(programs, repeats):
    """Bound generation programs timed against each other (`time_interleaved`);
    returns (Timings, the last GenerationOutput of each)."""
    outputs = [None] * len(programs)

    def call(i):
        def run():
            outputs[i] = programs[i]()
            return outputs[i].tokens

        return run

    return time_interleaved([call(i) for i in range(len(programs))], repeats), outputs


def time_generation(program, repeats):
    """Times a bound generation program (compiled XLA only, no host-side validation);
    returns (Timing, its last GenerationOutput)."""
    outputs = []

    def run():
        outputs.append(program())
        return outputs[-1].tokens

    timing = time_call(run, repeats)
    return timing, outputs[-1]


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

    For each batch size: the autoregressive baseline, the parts (target decode step,
    draft steps, verify of γ+1 tokens, prefills, the bare-matmul floor) and, for each γ,
    the speculative loop with its measured α, round time, and predicted vs measured
    speedup. Returns a JSON-able dict.
    """
    import numpy as np
    from tqdm.auto import tqdm

    from jax_specdec.decode import (
        autoregressive_generate,
        autoregressive_program,
        speculative_program,
    )
    from jax_specdec.sampling import SamplingConfig

    sampling = SamplingConfig() if sampling is None else sampling
    vocab = target.config.vocab_size
    context = prompt_len + max_new_tokens // 2
    cache_len = prompt_len + max_new_tokens + max(gammas)
    results = {
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
    work = [(b, g) for b in batches for g in (0, *gammas)]
    bar = tqdm(work, desc="bench", disable=not progress)
    parts: dict = {}
    for batch, gamma in bar:
        bar.set_postfix(batch=batch, gamma=gamma)
        rng = np.random.default_rng(seed + batch)
        prompts = rng.integers(0, vocab, size=(batch, prompt_len)).astype(np.int32)
        key = jax.random.key(seed)
        step = lambda m, t, b=batch: decode_step_time(  # noqa: E731
            m,
            batch=b,
            tokens_per_call=t,
            context=context,
            cache_len=cache_len,
            repeats=repeats,
        )
        if gamma == 0:
            timing, out = time_generation(
                autoregressive_program(
                    target,
                    prompts,
                    key=key,
                    max_new_tokens=max_new_tokens,
                    sampling=sampling,
                ),
                repeats,
            )
            parts = {
                "target_step": step(target, 1),
                "draft_step": step(draft, 1),
                "draft_first_step": step(draft, 2),
                "target_prefill": decode_step_time(
                    target,
                    batch=batch,
                    tokens_per_call=prompt_len,
                    context=0,
                    cache_len=cache_len,
                    steps=2,
                    repeats=repeats,
                ),
                "draft_prefill": decode_step_time(
                    draft,
                    batch=batch,
                    tokens_per_call=prompt_len,
                    context=0,
                    cache_len=cache_len,
                    steps=2,
                    repeats=repeats,
                ),
                "target_bare_matmul": bare_matmul_time(target, batch=batch, repeats=repeats),
                "draft_bare_matmul": bare_matmul_time(draft, batch=batch, repeats=repeats),
            }
            public = time_call(
                lambda p=prompts, k=key: (
                    autoregressive_generate(
                        target, p, key=k, max_new_tokens=max_new_tokens, sampling=sampling
                    ).tokens
                ),
                repeats,
            )
            tokens = int(np.sum(np.asarray(out.lengths)))
            loop_rounds = int(out.stats.target_calls) - 1
            ar_step = (timing.median - parts["target_prefill"].median) / loop_rounds
            baseline = {
                "batch": batch,
                "gamma": 0,
                "seconds": timing.median,
                "compile_seconds": timing.compile,
                "ms_per_token": 1e3 * timing.median / tokens,
                "loop_step_ms": 1e3 * ar_step,
                "host_overhead_ms": 1e3 * (public.median - timing.median),
                "parts_ms": {k: 1e3 * v.median for k, v in parts.items()},
                "loop_step_over_bare_matmul": ar_step / parts["target_bare_matmul"].median,
                "standalone_step_over_bare_matmul": parts["target_step"].median
                / parts["target_bare_matmul"].median,
            }
            results["rows"].append(baseline)
            continue

        timing, out = time_generation(
            speculative_program(
                target,
                draft,
                prompts,
                key=key,
                max_new_tokens=max_new_tokens,
                num_draft_tokens=gamma,
                sampling=sampling,
            ),
            repeats,
        )
        verify = step(target, gamma + 1)
        alpha = out.stats.alpha
        rounds = int(out.stats.target_calls) - 1
        prefill = parts["target_prefill"].median + parts["draft_prefill"].median
        round_measured = (timing.median - prefill) / rounds
        round_parts = (
            parts["draft_first_step"].median
            + (gamma - 1) * parts["draft_step"].median
            + verify.median
        )
        predicted = predicted_speedup(
            alpha, gamma, round_time=round_parts, target_step=parts["target_step"].median
        )
        measured = baseline["seconds"] / timing.median
        results["rows"].append(
            {
                "batch": batch,
                "gamma": gamma,
                "seconds": timing.median,
                "compile_seconds": timing.compile,
                "ms_per_token": 1e3 * timing.median / int(np.sum(np.asarray(out.lengths))),
                "alpha": alpha,
                "acceptance_rate": out.stats.acceptance_rate,
                "tokens_per_round": out.stats.tokens_per_round(out.lengths),
                "expected_tokens_per_round": expected_tokens_per_round(alpha, gamma),
                "verify_ms": 1e3 * verify.median,
                "round_ms": 1e3 * round_measured,
                "round_parts_ms": 1e3 * round_parts,
                "round_over_parts": round_measured / round_parts,
                "speedup": measured,
                "predicted_speedup": predicted,
                "measured_over_predicted": measured / predicted,
            }
        )
    results["peak_rss_mib"] = peak_rss_mib()
    if jax.default_backend() != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        results["peak_device_mib"] = stats.get("peak_bytes_in_use", 0) / 2**20
    return results


def markdown_table(results: dict) -> str:
    """The benchmark results as a markdown table (one row per batch and γ)."""
    lines = [
        "| batch | γ | ms/token | speedup | predicted | measured/predicted | α | tokens/round "
        "| round ms | parts ms | round/parts | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["gamma"] == 0:
            p = r["parts_ms"]
            lines.append(
                f"| {r['batch']} | AR | {r['ms_per_token']:.2f} | 1.00 | | | | 1 "
                f"| {r['loop_step_ms']:.2f} | {p['target_step']:.2f} "
                f"| {r['loop_step_ms'] / p['target_step']:.2f} | {r['compile_seconds']:.1f} |"
            )
            continue
        lines.append(
            f"| {r['batch']} | {r['gamma']} | {r['ms_per_token']:.2f} | {r['speedup']:.2f} "
            f"| {r['predicted_speedup']:.2f} | {r['measured_over_predicted']:.2f} "
            f"| {r['alpha']:.3f} | {r['tokens_per_round']:.2f} | {r['round_ms']:.2f} "
            f"| {r['round_parts_ms']:.2f} | {r['round_over_parts']:.2f} "
            f"| {r['compile_seconds']:.1f} |"
        )
    lines.append("")
    lines.append(
        "| batch | target step ms | draft step ms | target bare matmul ms "
        "| AR loop step / bare matmul | standalone step / bare matmul |"
    )
    lines.append("|---|---|---|---|---|---|")
    for r in results["rows"]:
        if r["gamma"] == 0:
            p = r["parts_ms"]
            lines.append(
                f"| {r['batch']} | {p['target_step']:.2f} | {p['draft_step']:.2f} "
                f"| {p['target_bare_matmul']:.2f} | {r['loop_step_over_bare_matmul']:.2f} "
                f"| {r['standalone_step_over_bare_matmul']:.2f} |"
            )
    return "\n".join(lines)
