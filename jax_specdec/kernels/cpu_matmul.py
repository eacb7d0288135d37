"""An optional accelerator of the CPU backend: products of a few float32 rows with a
weight matrix, on XLA:CPU, as a custom call. `jax_specdec.nn.products` picks it.

A decode step multiplies one row per sequence by every weight matrix and a verify call
γ + 1 rows; both are bound by reading the weights from memory once. XLA:CPU computes
the one-row product as a matrix-vector product that streams the weights, but hands 2 or
more rows to a GEMM that packs the weight panel on every call, so a 5-row verify cost
1.5-2x a one-row step (docs/performance.md). `cpu_matmul.cc` reads each weight once for
up to 8 rows and splits the columns over XLA's own thread pool.

`matmul(x, w)` (x @ w, w [K, N]) and `matmul_t(x, e)` (x @ eᵀ, e [V, D]: a tied
embedding as the LM head) use the kernel when it applies: float32 x and float32 weights
(or float16 / bfloat16 ones, widened as they are read: half the bytes, the same result as
the weights stored as float32; more rows than the limit then go in pieces), at most
`MAX_ROWS` (`MAX_ROWS_T`) rows, the CPU backend, the library built, and the kernel
faster than XLA's products on this machine: measured once and cached (`cpu_choice`), or
decided by the environment variable `JAX_SPECDEC_SMALL_MATMUL` ("1": use it, "0": do
not; read at trace time). Otherwise they return
None and `jax_specdec.nn.products` takes jnp's products. `matmul` sums every output
element in the same order whatever the number of rows, so a verify call's rows equal
the same rows computed one at a time; so does `matmul_t`.

The library is compiled on first use with the system's C++ compiler (`$CXX`, else
`c++`) for this CPU (`-march=native`) into `~/.cache/jax_specdec/kernels/`, keyed by
the sources, the flags, the CPU and jaxlib's version, with the library's size and
SHA-256 recorded beside it: a library that does not match its record (a truncated
copy, a bad restore) is built again, never loaded. The build has a time limit
(`BUILD_TIMEOUT` seconds) and the compiler's warnings are shown as a Python warning.
Without a compiler, or if the build fails or runs out of time, a warning says so once
and jnp's products are used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp

__all__ = [
    "MAX_ROWS",
    "MAX_ROWS_T",
    "available",
    "choice_path",
    "kernel_product",
    "kernel_product_t",
    "library_path",
    "matmul",
    "matmul_t",
    "uses_kernel",
]

#: the most rows (product of x's leading dimensions) the kernel takes: it streams the
#: weights once for all of them (a decode step, a verify call of up to 8 tokens at batch
#: 1). More rows are left to XLA's products: register tiles for 9-64 rows measured at
#: most 8% cheaper than XLA's in the SmolLM2 verify calls they would take
#: (scripts/experiments/kernel_tiles), and were removed.
MAX_ROWS = 8
#: the same for `matmul_t` (the LM head).
MAX_ROWS_T = 8
_SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")  # includes cpu_matmul_*.h
_WEIGHT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)  # `matmul`'s w in the kernel
# -ffp-contract=fast (GCC's default, spelled out): the vector lanes fuse multiply-add,
# as the scalar tails do explicitly, which keeps a row's sums the same whatever M is.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC")
#: seconds the compiler may take before the build counts as failed.
BUILD_TIMEOUT = 300
_TARGETS = {"SmallMatmul": "jax_specdec_small_matmul", "SmallMatmulT": "jax_specdec_small_matmul_t"}


def _cpu_id() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler_command(compiler: str) -> list[str]:
    """`$CXX` (or c++) as a command: it may hold several words, e.g. "ccache g++"."""
    words = shlex.split(compiler)
    if not words or shutil.which(words[0]) is None:
        if "CXX" in os.environ:
            raise RuntimeError(f"no C++ compiler (CXX={compiler!r}: {words[:1]} not on PATH)")
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; set CXX)")
    return words


def _record(library: pathlib.Path) -> dict:
    """What the build recorded beside the library: its size and SHA-256."""
    data = library.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _intact(library: pathlib.Path) -> bool:
    """Whether `library` is the file its build recorded (a truncated or altered copy in
    the cache would crash the process that loads it)."""
    record = library.with_name(library.name + ".json")
    try:
        return library.is_file() and json.loads(record.read_text()) == _record(library)
    except (OSError, ValueError):
        return False


def _build(out: pathlib.Path, compiler: str) -> None:
    words = _compiler_command(compiler)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = pathlib.Path(tmp) / out.name
        command = [
            *words,
            *_FLAGS,
            f"-isystem{jax.ffi.include_dir()}",
            str(_SOURCE),
            "-o",
            str(built),
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{compiler} took over {BUILD_TIMEOUT} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        if done.stderr.strip():
            warnings.warn(
                f"jax_specdec: the CPU kernel built with warnings:\n{done.stderr[-2000:]}",
                RuntimeWarning,
                stacklevel=4,
            )
        record = pathlib.Path(tmp) / "record.json"
        record.write_text(json.dumps(_record(built)))
        # Atomic, record first: a process sees a whole file or none, and a library that
        # does not match its record is built again, never loaded.
        os.replace(record, out.with_name(out.name + ".json"))
        os.replace(built, out)


def _library_path(compiler: str) -> pathlib.Path:
    """Where the library built by `compiler` lives: keyed by the sources, the command,
    the CPU and jaxlib's version."""
    import jaxlib

    from jax_specdec.io.zoo import cache_dir

    key = hashlib.sha256()
    sources = [_SOURCE, *sorted(_SOURCE.parent.glob("cpu_matmul_*.h"))]
    for part in (*(s.read_bytes() for s in sources), " ".join((compiler, *_FLAGS)), _cpu_id()):
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(jaxlib.__version__.encode())
    return cache_dir() / "kernels" / f"small_matmul-{key.hexdigest()[:16]}.so"


def library_path() -> pathlib.Path:
    """Where this machine's kernel library lives (built or not)."""
    return _library_path(os.environ.get("CXX") or "c++")


def choice_path() -> pathlib.Path:
    """Where whether the kernel pays here is recorded (`cpu_choice`): beside the library,
    under the library's key."""
    library = library_path()
    return library.with_name(library.stem.replace("small_matmul", "choice") + ".json")


@functools.cache
def _library() -> bool:
    """Builds (once per machine) and registers the kernels; False if that fails."""
    try:
        compiler = os.environ.get("CXX") or "c++"
        out = _library_path(compiler)
        if not _intact(out):
            _build(out, compiler)
            if not _intact(out):
                raise RuntimeError(f"{out} does not match its build record after a rebuild")
        library = ctypes.cdll.LoadLibrary(str(out))
        for symbol, name in _TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(
            f"jax_specdec: the CPU kernel is not available ({e}); using XLA's "
            "products (a verify call then costs more on CPU)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return _library()


def uses_kernel(x: jax.Array, w: jax.Array, transposed: bool = False) -> bool:
    """Whether `matmul(x, w)` (`matmul_t(x, w)` when `transposed`) takes the kernel
    (decided at trace time). Shapes that do not fit are left to jnp, which says why."""
    inner, outer = (1, 0) if transposed else (0, 1)
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    return (
        os.environ.get("JAX_SPECDEC_SMALL_MATMUL") != "0"
        and x.dtype == jnp.float32
        and w.dtype in _WEIGHT_DTYPES
        and w.ndim == 2
        and w.shape[inner] == x.shape[-1]
        and w.shape[outer] > 0
        and 1 <= rows <= (MAX_ROWS_T if transposed else MAX_ROWS)
        and jax.default_backend() == "cpu"
        and _library()
        and _wanted()
    )


def _wanted() -> bool:
    """`JAX_SPECDEC_SMALL_MATMUL` "1", or unset and the kernel measured faster here."""
    setting = os.environ.get("JAX_SPECDEC_SMALL_MATMUL")
    if setting not in (None, "0", "1"):
        raise ValueError(f"JAX_SPECDEC_SMALL_MATMUL must be 1 or 0 (or unset), got {setting!r}")
    if setting == "1":
        return True
    return _pays_here(os.environ.get("CXX") or "c++", os.environ.get("JAX_SPECDEC_CACHE"))


@functools.cache
def _pays_here(compiler: str, cache: str | None) -> bool:
    """`cpu_choice.kernel_pays` for this compiler and cache folder (asked once per trace
    product otherwise: the library's key hashes the sources)."""
    from jax_specdec.kernels.cpu_choice import kernel_pays

    return kernel_pays(choice_path())


def _call(name: str, x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    y = jax.ffi.ffi_call(name, out, vmap_method="sequential")(rows, w)
    return y.reshape(*x.shape[:-1], n)


def _with_jvp(target: str, outputs, product):
    """The custom call `target` as a function of (x, w), differentiable: its JVP is
    `product` (the same product in plain jnp) of the tangents."""

    @jax.custom_jvp
    def kernel(x, w):
        return _call(target, x, w, outputs(w))

    @kernel.defjvp
    def _jvp(primals, tangents):
        (x, w), (dx, dw) = primals, tangents
        return kernel(x, w), product(dx, w) + product(x, dw)

    return kernel


_kernel = _with_jvp(
    _TARGETS["SmallMatmul"], lambda w: w.shape[1], lambda x, w: x @ w.astype(x.dtype)
)
_kernel_t = _with_jvp(
    _TARGETS["SmallMatmulT"], lambda e: e.shape[0], lambda x, e: x @ e.astype(x.dtype).T
)


def _pieces(kernel, x: jax.Array, w: jax.Array, transposed: bool):
    """More rows than the kernel takes, with 16-bit weights: pieces of at most the limit
    through the kernel (a cast of w would write a float32 copy of it on every call);
    None where that does not apply."""
    if w.dtype == x.dtype or x.ndim == 0:
        return None
    limit = MAX_ROWS_T if transposed else MAX_ROWS
    rows = x.reshape(-1, x.shape[-1])
    if not uses_kernel(rows[:limit], w, transposed):
        return None
    y = jnp.concatenate([kernel(rows[i : i + limit], w) for i in range(0, len(rows), limit)])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul(x: jax.Array, w: jax.Array) -> jax.Array | None:
    """x [..., K] @ w [K, N] -> [..., N] float32 through the kernel where it applies (x
    float32, w float32, float16 or bfloat16; 16-bit w with more rows than it takes: in
    pieces); None where it does not (`jax_specdec.nn.products` then takes jnp's)."""
    if uses_kernel(x, w):
        return _kernel(x, w)
    return _pieces(_kernel, x, w, transposed=False)


def matmul_t(x: jax.Array, e: jax.Array) -> jax.Array | None:
    """x [..., D] @ e [V, D]ᵀ -> [..., V] float32 through the kernel where it applies (as
    `matmul`); None where it does not."""
    if uses_kernel(x, e, transposed=True):
        return _kernel_t(x, e)
    return _pieces(_kernel_t, x, e, transposed=True)


def kernel_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [R, K] @ w [K, N] through the kernel whatever `uses_kernel` says (the library
    built, R <= MAX_ROWS, float32): for measuring it against XLA's (`cpu_choice`)."""
    return _kernel(x, w)


def kernel_product_t(x: jax.Array, e: jax.Array) -> jax.Array:
    """x [R, D] @ e [V, D]ᵀ through the kernel, as `kernel_product`."""
    return _kernel_t(x, e)
