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

The measurement (`cpu_measure`) runs in a subprocess (`python -m
jax_specdec.kernels.cpu_measure PATH`), once
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
import subprocess
import sys
import warnings

__all__ = ["MARGIN", "kernel_pays", "write"]

#: how much faster the kernel must be to be chosen (a tie goes to XLA's products).
MARGIN = 0.10
_ROWS = (1, 5)


@functools.cache
def kernel_pays(path: pathlib.Path) -> bool:
    """Whether the kernel is faster here: read from `path` (`cpu_matmul.choice_path`), or
    measured once in a subprocess and recorded there; False when it cannot be measured
    (a warning says why)."""
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
    command = [sys.executable, "-m", "jax_specdec.kernels.cpu_measure", str(path)]
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
        write(path, {"pays": False, "why": why or "no result"})


def write(out: pathlib.Path, result: dict) -> None:
    """Records a measurement at `out`, atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
