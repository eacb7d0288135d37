"""Timing: compiled calls timed cold and warm, several calls interleaved, the cost of one
model call, the bare-matmul floor, and whole generations with their statistics.

Model calls are timed inside one jitted program per measurement (a `fori_loop` of
`steps` calls), so dispatch overhead does not count; results are medians of
`repeats` runs after a warm-up call that also gives the compile time.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec.nn import Transformer, init_cache, write_entries

__all__ = [
    "Measurement",
    "Timing",
    "bare_matmul_time",
    "decode_step_loop",
    "decode_step_time",
    "drop_programs_if_crowded",
    "measure",
    "peak_rss_mib",
    "time_call",
    "time_interleaved",
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


def _fill_cache(model: Transformer, batch: int, cache_len: int, context: int):
    cache = init_cache(model.config, batch=batch, max_len=cache_len)
    return cache.replace(lengths=jnp.full((batch,), context, jnp.int32))


def _decode(model, tokens, cache):
    """One decode call: a Transformer's, or a feature draft's (features of zeros: a draft
    step costs the same whatever the features hold) with its entries written."""
    from jax_specdec.decode.drafters.feature_head import AttachedHead

    if not isinstance(model, AttachedHead):
        return model.decode(tokens, cache)
    features = jnp.zeros((*tokens.shape, model.embed.shape[1]), jnp.float32)
    predicted, keys, values = model.head.decode_entries(
        features, tokens, model.embed[...], cache, cache.lengths
    )
    # The loop's head calls draft from their last entry only (its chunk call included).
    logits = model.head.logits(predicted[:, -1:])
    return logits, write_entries(cache, keys, values, cache.lengths)


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
    """Time of one `model.decode` of `tokens_per_call` tokens per row at `context` (a
    feature draft's head call, when `model` is one).

    The cache is rolled back after every call (as a rejected round would), so each of
    the `steps` calls inside the loop does the same work (`decode_step_loop`). Returns
    per-call seconds.
    """
    call, _ = decode_step_loop(
        model,
        batch=batch,
        tokens_per_call=tokens_per_call,
        context=context,
        cache_len=cache_len,
        steps=steps,
    )
    timing = time_call(call, repeats)
    return Timing(timing.first, timing.median / steps, tuple(t / steps for t in timing.runs))


def decode_step_loop(
    model: Transformer, *, batch: int, tokens_per_call: int, context: int, cache_len: int, steps
):
    """The jitted loop `decode_step_time` times: `steps` decode calls, the cache rolled
    back after each.

    The cache is donated to the loop and handed from one call to the next, as the
    generation loop carries it: without donation XLA copies the whole cache once per
    call (at batch 8 with 1024 positions on SmolLM2, 377 MB and ~10 ms), which is no
    part of a step.

    Returns:
      (call, lower): `call()` runs the loop once (returning [batch] float32);
      `lower()` is the loop lowered for the cache it would be called with next.
    """
    graphdef, state = nnx.split(model)
    tokens = jnp.ones((batch, tokens_per_call), jnp.int32)

    @functools.partial(jax.jit, donate_argnums=1)
    def run(state, cache, tokens):
        m = nnx.merge(graphdef, state)

        def body(_, carry):
            cache, acc = carry
            logits, new = _decode(m, tokens, cache)
            return new.replace(lengths=cache.lengths), acc + logits[:, -1, 0]

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch,), jnp.float32)))

    carried = [_fill_cache(model, batch, cache_len, context)]

    def call():
        carried[0], acc = run(state, carried[0], tokens)
        return acc

    return call, lambda: run.lower(state, carried[0], tokens)


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


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


def drop_programs_if_crowded(fraction: float = 0.5) -> bool:
    """Drops JAX's compiled programs (`jax.clear_caches`) once this process holds more
    than `fraction` of the memory maps the system allows (`vm.max_map_count`): XLA:CPU
    maps memory for every kernel of every program it keeps, and past the limit the next
    compile fails. Programs stay compiled until then, so a later run of the same program
    is not compiled again. Returns whether it dropped them. Without /proc (not Linux) it
    always drops them."""
    try:
        with open("/proc/self/maps") as maps:
            crowded = sum(1 for _ in maps) > fraction * _map_limit()
    except OSError:
        crowded = True
    if crowded:
        jax.clear_caches()
    return crowded


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A generation run timed among others: its `Timing` and its last output."""

    timing: Timing
    output: object  # GenerationOutput

    @property
    def seconds(self) -> float:
        return self.timing.median

    @property
    def tokens(self) -> int:
        return int(np.sum(np.asarray(self.output.lengths)))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def stats(self):
        return self.output.stats


def measure(runs: Sequence[Callable[[], object]], repeats: int = 5) -> list[Measurement]:
    """Bound generations (`Generator.bind(...)`, calling one runs only the compiled
    program) timed against each other with `time_interleaved`; one `Measurement` each."""
    outputs = [None] * len(runs)

    def call(i):
        def run():
            outputs[i] = runs[i]()
            return outputs[i].tokens

        return run

    timings = time_interleaved([call(i) for i in range(len(runs))], repeats)
    return [Measurement(t, o) for t, o in zip(timings, outputs, strict=True)]
