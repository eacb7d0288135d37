"""No longer runs (see the SystemExit below); kept as the record of its run.

Products of M rows with one weight matrix: our kernel against XLA's own, for each shape
of a SmolLM2-135M layer and for its LM head. The layer shapes take 8 different weights
per call (at most 28 MB together: they sit in the 32 MB L3, so those rows measure
arithmetic, not the stream from memory); the LM head is one 113 MB matrix.

`python scripts/experiments/verify_arithmetic_floor/products_probe.py`; output of 2026-12-03
in products_run10.txt.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

raise SystemExit(
    "this probe no longer runs: it timed jax_specdec.kernels.cpu_matmul.matmul on 16 and 40 "
    "rows, which the kernel no longer takes (its 9-64-row tiles were removed in 164ad07); "
    "see git history before 164ad07"
)

from jax_specdec.kernels import cpu_matmul  # noqa: E402

LAYER_SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))


def best_seconds(f, *args, calls=30):
    """Best of 5 runs of `calls` calls, seconds per call."""
    f(*args).block_until_ready()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        out.block_until_ready()
        runs.append((time.perf_counter() - t) / calls)
    return min(runs)


def line(name, flops, ours, xla):
    return (
        f"{name}: kernel {ours * 1e6:.0f} us {flops / ours / 1e9:.0f} GF/s; "
        f"xla {xla * 1e6:.0f} us {flops / xla / 1e9:.0f} GF/s"
    )


def main():
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    ours = jax.jit(lambda x, *ws: sum(cpu_matmul.matmul(x, w) for w in ws))
    xla = jax.jit(lambda x, *ws: sum(x @ w for w in ws))
    ours_t = jax.jit(cpu_matmul.matmul_t)
    xla_t = jax.jit(lambda x, e: x @ e.T)
    for m in (8, 16, 40):
        for k, n in LAYER_SHAPES:
            x, ws = normal(m, k), [normal(k, n) for _ in range(8)]
            flops = 2 * m * k * n * len(ws)
            times = best_seconds(ours, x, *ws), best_seconds(xla, x, *ws)
            print(line(f"M={m} K={k} N={n}", flops, *times), flush=True)
        x, e = normal(m, 576), normal(49152, 576)
        times = best_seconds(ours_t, x, e, calls=10), best_seconds(xla_t, x, e, calls=10)
        print(line(f"M={m} LM head", 2 * m * 576 * 49152, *times), flush=True)


if __name__ == "__main__":
    main()
