"""The step-cost table of docs/performance.md: decode calls of 1..8 tokens per row on a
SmolLM2-135M-shaped model (or the benchmark target), against the weight-pass floor and
the bare weight matmuls, before and after the attention changes, all in one process.

    python scripts/step_cost.py --model smollm --out /tmp/step_cost

Every figure is one of `jax_specdec.bench.decode_step_time`'s or `bare_matmul_time`'s
own jitted loops (captured instead of timed alone), compiled once, then all of them are
timed against each other with `time_interleaved`: on a shared machine a slow spell falls
on every case alike. Ratios are taken within each pass, then the median over passes.

"before" is the previous attention formulation, rebuilt in this process: attention over
the whole allocated cache (one static size) and the P.V product asked for in
[B, T, K, G, hd] order, as jax_specdec/nn/transformer.py did before this change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

import jax_specdec.bench.timing as timing_module
from jax_specdec.bench import Timing, bare_matmul_time, decode_step_time, time_interleaved
from jax_specdec.nn import Transformer, TransformerConfig, attention


def smollm_config(dtype: str = "float32", **overrides) -> TransformerConfig:
    """SmolLM2-135M's shapes (Llama: 30 layers, d 576, 9/3 heads, MLP 1536, tied)."""
    base = dict(
        vocab_size=49152,
        d_model=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        mlp_dim=1536,
        max_len=8192,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        dtype=dtype,
        param_dtype=dtype,
    )
    base.update(overrides)
    return TransformerConfig.llama(**base)


def model_config(name: str, dtype: str) -> TransformerConfig:
    if name == "smollm":
        return smollm_config(dtype)
    if name == "bench":
        return TransformerConfig.bench_target(dtype=dtype, param_dtype=dtype)
    raise ValueError(f"unknown model {name!r}")


def weight_pass_fn(model: Transformer, steps: int):
    """A jitted loop of `steps` streaming reads (a max) of one buffer as large as all the
    weights: the memory floor of a batch-1 decode step. One large buffer streams faster
    than the ~300 weight arrays read one by one on XLA:CPU."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    size = sum(p.size * p.dtype.itemsize for p in params) // 4
    buffer = jnp.ones((size // 1024, 1024), jnp.float32)

    @jax.jit
    def run(buffer):
        def body(i, acc):
            return acc + jnp.max(buffer * (1.0 + i.astype(jnp.float32) * 1e-7))

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

    return lambda: run(buffer)


def parse_cases(text: str) -> list[tuple[int, int, int, int]]:
    """'B:T:cache:context,...' -> [(batch, tokens, cache_len, context)]."""
    out = []
    for item in text.split(","):
        b, t, s, c = (int(x) for x in item.split(":"))
        out.append((b, t, s, c))
    return out


DEFAULT_CASES = (
    "1:1:80:64,1:2:80:64,1:3:80:64,1:5:80:64,1:8:80:64,1:5:256:64,1:1:1024:64,1:1:1024:512,"
    "8:1:80:64,8:2:80:64,8:3:80:64,8:5:80:64,8:8:80:64,8:1:256:64,8:1:1024:64,8:1:1024:512"
)


def captured(timer, *args, **kwargs):
    """The jitted loop `timer` (decode_step_time or bare_matmul_time) would time, and its
    step count: bench's time_call is swapped for one that keeps the call."""
    kept = []

    def keep(fn, repeats=5):
        kept.append(fn)
        return Timing(1.0, 1.0, (1.0,))

    original = timing_module.time_call
    timing_module.time_call = keep
    try:
        timer(*args, **kwargs)
    finally:
        timing_module.time_call = original
    return kept[0]


@contextlib.contextmanager
def formulation(name: str):
    """ "after": the code as it is; "xla-matmul": XLA's own products instead of the CPU
    kernel (jax_specdec/kernels/cpu_matmul.py); "before": also full-cache attention and
    P.V in the old order (the code before the live-prefix attention)."""
    if name not in ("after", "xla-matmul", "before"):
        raise ValueError(f"unknown variant {name!r}")
    # "after" takes the kernel wherever it applies, whether or not it pays here
    env = {"JAX_SPECDEC_SMALL_MATMUL": "1" if name == "after" else "0"}
    with mock.patch.dict(os.environ, env), contextlib.ExitStack() as stack:
        if name == "before":
            stack.enter_context(mock.patch.object(attention, "LIVE_BLOCK", 1 << 30))
            old_pv = lambda p, v: jnp.einsum("bkgts,bksd->btkgd", p, v).astype(jnp.float32)
            stack.enter_context(mock.patch.object(attention, "_weighted", old_pv))
        yield


def measure(model, cases, variants, repeats: int, steps: int) -> dict:
    """All loops compiled (each under its formulation), then timed interleaved."""
    batches = sorted({b for b, *_ in cases})
    fns = {"floor": weight_pass_fn(model, steps)}
    for b in batches:
        fns[f"bare{b}"] = captured(bare_matmul_time, model, batch=b, steps=steps)
    compile_s = {}
    for variant in variants:
        for b, t, s, c in cases:
            with formulation(variant):
                fn = captured(
                    decode_step_time, model, batch=b, tokens_per_call=t, context=c,
                    cache_len=s, steps=steps,
                )  # fmt: skip
                start = time.perf_counter()
                jax.block_until_ready(fn())  # traced and compiled here, under the variant
                compile_s[(variant, b, t, s, c)] = time.perf_counter() - start
            fns[(variant, b, t, s, c)] = fn
        print(f"compiled {variant}", file=sys.stderr, flush=True)
    timings = time_interleaved(list(fns.values()), repeats)
    per_pass = [
        {key: timing.runs[r] / steps for key, timing in zip(fns, timings, strict=True)}
        for r in range(repeats)
    ]
    for row in per_pass:
        row.update({("compile", *k): v for k, v in compile_s.items()})
    return summarise(per_pass, cases, variants, batches)


def summarise(per_pass, cases, variants, batches) -> dict:
    """Median over passes of each figure and of each within-pass ratio."""
    med = statistics.median
    rows = []
    for variant in variants:
        for case in cases:
            b, t, s, c = case
            key = (variant, *case)
            one = (variant, *next(k for k in cases if k[0] == b and k[1] == 1))
            after = ("after", *case)
            rows.append(
                {
                    "variant": variant, "batch": b, "tokens": t, "cache_len": s, "context": c,
                    "ms": 1e3 * med([row[key] for row in per_pass]),
                    "vs_one_token": med([row[key] / row[one] for row in per_pass]),
                    "vs_bare": med([row[key] / row[f"bare{b}"] for row in per_pass]),
                    "vs_floor": med([row[key] / row["floor"] for row in per_pass]),
                    "after_vs_this": med([row[after] / row[key] for row in per_pass])
                    if after in per_pass[0] else None,
                    "compile_s": per_pass[0][("compile", *key)],
                }
            )  # fmt: skip
    return {
        "floor_ms": 1e3 * med([row["floor"] for row in per_pass]),
        "bare_ms": {b: 1e3 * med([row[f"bare{b}"] for row in per_pass]) for b in batches},
        "rows": rows,
        "passes": len(per_pass),
    }


def markdown(result: dict) -> str:
    lines = [
        f"weight-pass floor {result['floor_ms']:.1f} ms; bare weight matmuls "
        + ", ".join(f"batch {b}: {ms:.1f} ms" for b, ms in result["bare_ms"].items()),
        "",
        "| variant | batch | tokens per row | allocated cache | context | ms | vs 1-token step "
        "| vs bare matmuls | vs floor | after / this |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = "" if r["after_vs_this"] is None else f"{r['after_vs_this']:.2f}"
        lines.append(
            f"| {r['variant']} | {r['batch']} | {r['tokens']} | {r['cache_len']} | "
            f"{r['context']} | {r['ms']:.1f} | {r['vs_one_token']:.2f} | {r['vs_bare']:.2f} | "
            f"{r['vs_floor']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm", choices=["smollm", "bench"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cases", default=DEFAULT_CASES, help="batch:tokens:cache:context,...")
    p.add_argument("--variants", default="before,after")
    p.add_argument("--repeats", type=int, default=5, help="interleaved passes")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default=None, help="folder for step_cost.json and .md")
    args = p.parse_args(argv)
    config = model_config(args.model, args.dtype)
    model = Transformer(config, rngs=nnx.Rngs(0))
    start = time.time()
    variants = args.variants.split(",")
    result = measure(model, parse_cases(args.cases), variants, args.repeats, args.steps)
    result.update(model=args.model, dtype=args.dtype, wall_s=time.time() - start)
    table = markdown(result)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "step_cost.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "step_cost.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
