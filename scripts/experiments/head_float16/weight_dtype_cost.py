"""What 16-bit weights save in the small-matmul kernel: one row times the feature head's
matrices, float32 weights against float16 (widened in the kernel), each timed hot (the
same weights every call: from cache) and cold (8 copies in turn: from memory), medians.

  python scripts/experiments/head_float16/weight_dtype_cost.py [--rows 1] [--repeats 40]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_specdec.kernels.cpu_matmul import matmul, uses_kernel

SHAPES = {"fc": (1152, 576), "mlp up": (576, 1536), "mlp down": (1536, 576), "lm head": (576, 8192)}


def _median_ms(fn, x, pool, repeats):
    times = []
    for r in range(repeats):
        w = pool[r % len(pool)]
        start = time.perf_counter()
        jax.block_until_ready(fn(x, w))
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)) * 1e3, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    fn = jax.jit(matmul)
    for name, (k, n) in SHAPES.items():
        x = jnp.ones((args.rows, k), jnp.float32)
        copies = [np.random.default_rng(i).standard_normal((k, n), np.float32) for i in range(8)]
        row = {}
        for dtype in (jnp.float32, jnp.float16):
            pool = [jnp.asarray(w, dtype) for w in copies]
            assert uses_kernel(x, pool[0]), "the kernel is not available here"
            for w in pool:
                jax.block_until_ready(fn(x, w))
            label = jnp.dtype(dtype).name
            row[f"{label} hot"] = _median_ms(fn, x, pool[:1], args.repeats)
            row[f"{label} cold"] = _median_ms(fn, x, pool, args.repeats)
        print(f"{name} [{k}, {n}] ms:", row)


if __name__ == "__main__":
    main()
