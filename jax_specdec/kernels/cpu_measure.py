"""The measurement behind `cpu_choice`: the CPU kernel against XLA's products on a
SmolLM2-sized stack of weight products (d 576, MLP 1536, four layers and the 49,152-row
tied head) on 1 and 5 rows, interleaved. Run as `python -m
jax_specdec.kernels.cpu_measure PATH`, it records the result at PATH (`cpu_choice.write`).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

from jax_specdec.kernels.cpu_choice import MARGIN, write

__all__ = ["measure"]

_ROWS = (1, 5)


def _stack(rows: int, kernel: bool):
    """A jitted stack of SmolLM2-sized weight products on `rows` rows, through the
    kernel or through XLA, and its arguments."""
    import jax
    import jax.numpy as jnp

    from jax_specdec.kernels import cpu_matmul

    keys = jax.random.split(jax.random.key(0), 9)
    ups = [jax.random.normal(k, (576, 1536), jnp.float32) * 0.02 for k in keys[:4]]
    downs = [jax.random.normal(k, (1536, 576), jnp.float32) * 0.02 for k in keys[4:8]]
    head = jax.random.normal(keys[8], (49152, 576), jnp.float32) * 0.02
    mm = cpu_matmul.kernel_product if kernel else jnp.matmul
    mm_t = cpu_matmul.kernel_product_t if kernel else (lambda x, e: x @ e.T)

    @jax.jit
    def run(x, ups, downs, head):
        for up, down in zip(ups, downs, strict=True):
            x = x + mm(jax.nn.silu(mm(x, up)), down)
        return mm_t(x, head)

    x = jnp.ones((rows, 576), jnp.float32)
    return run, (x, ups, downs, head)


def measure(repeats: int = 7, calls: int = 10) -> dict:
    """Seconds per call of the stack on 1 and 5 rows, kernel and XLA, interleaved
    (medians of `repeats` passes of `calls` calls), and whether the kernel pays."""
    import jax

    cases = {(r, k): _stack(r, k) for r in _ROWS for k in (True, False)}
    for fn, args in cases.values():
        jax.block_until_ready(fn(*args))  # compiled
    times: dict = {c: [] for c in cases}
    for _ in range(repeats):
        for case, (fn, args) in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[case].append((time.perf_counter() - start) / calls)
    kernel = sum(statistics.median(times[(r, True)]) for r in _ROWS)
    xla = sum(statistics.median(times[(r, False)]) for r in _ROWS)
    per_rows = {
        str(r): {n: statistics.median(times[(r, k)]) for n, k in (("kernel", True), ("xla", False))}
        for r in _ROWS
    }
    return {"kernel_s": kernel, "xla_s": xla, "rows": per_rows, "pays": kernel < (1 - MARGIN) * xla}


def _main(path: str) -> int:
    from jax_specdec.kernels import cpu_matmul

    if not cpu_matmul.available():
        result = {"pays": False, "why": "the kernel is not available"}
    else:
        result = measure()
    write(pathlib.Path(path), result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
