"""Whether the CPU kernel (`cpu_matmul`) pays on this machine: measured once, cached.

The kernel reads each weight once for up to 8 rows, where XLA:CPU hands 2 or more rows
to a GEMM that packs the weight panel on every call. On the AMD EPYC the docs' first
CPU figures came from, that made a 5-token verify cost 1.03-1.31 one-token steps
instead of 1.5-2; on an Intel Xeon with AVX-512 and AMX, XLA's own products were faster
at every row count, 1.65-1.7x in SmolLM2's one-token step and 5-token verify
(docs/performance.md). So the choice is measured where the program runs: a
SmolLM2-sized stack of weight products (d 576, MLP 1536, four layers and the
49,152-row tied head) on 1 and on 5 rows, through the kernel and through XLA,
interleaved; the kernel is used when it is at least `MARGIN` faster over both.

The measurement runs in a subprocess (`python -m jax_specdec.kernels.cpu_choice`), once
per machine, CPU, jaxlib and kernel source (the library's own key), under a file lock
(processes that start together wait for one measurement), and is cached next to the
library. It is asked for by the first trace that could take the kernel, which is why it
runs in a subprocess: inside a trace JAX stages computations instead of running them. A
measurement that fails is recorded as "does not pay" with the reason (XLA's products,
always correct), so no later process waits for it again; delete the file to measure
again. `JAX_SPECDEC_SMALL_MATMUL` set to "1" or "0" decides without measuring.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import warnings

__all__ = ["MARGIN", "choice_path", "kernel_pays", "measure"]

#: how much faster the kernel must be to be chosen (a tie goes to XLA's products).
MARGIN = 0.10
_ROWS = (1, 5)


def choice_path() -> pathlib.Path:
    """The cached measurement: beside the kernel library, under the library's key."""
    from jax_specdec.kernels import cpu_matmul

    library = cpu_matmul.library_path()
    return library.with_name(library.stem.replace("small_matmul", "choice") + ".json")


@functools.cache
def kernel_pays() -> bool:
    """Whether the kernel is faster here (read from the cache, or measured once in a
    subprocess and cached); False when it cannot be measured (a warning says why)."""
    path = choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be measuring
        if not path.is_file():
            _measure_into(path)
    try:
        return bool(json.loads(path.read_text())["pays"])
    except (OSError, ValueError, KeyError):
        return False


def _measure_into(path: pathlib.Path) -> None:
    """Runs the measurement in a subprocess; on failure records "does not pay" and why."""
    command = [sys.executable, "-m", "jax_specdec.kernels.cpu_choice", str(path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        why = done.stderr.strip()[-500:] if done.returncode else ""
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    if why or not path.is_file():
        warnings.warn(
            f"jax_specdec: could not measure whether the CPU kernel pays here ({why}); "
            f"using XLA's products (recorded in {path}; delete it to measure again)",
            RuntimeWarning,
            stacklevel=3,
        )
        _write(path, {"pays": False, "why": why or "no result"})


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
    _write(pathlib.Path(path), result)
    print(json.dumps(result))
    return 0


def _write(out: pathlib.Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
