"""The test run's compile machinery (a pytest plugin, registered by conftest.py):
cheaper XLA:CPU compile settings, the run's own persistent compilation cache, dropping
compiled programs between files, the per-file compile budgets of compile_budget.json,
and the order in which the files are handed to the two xdist workers.

Environment: JAX_SPECDEC_TEST_XLA_DEFAULTS=1 keeps XLA's defaults; JAX_SPECDEC_TEST_CACHE=0
runs without the run's cache; JAX_SPECDEC_COMPILE_COUNTS=DIR writes each process's
programs and compile seconds per file to DIR (to set the budgets after a deliberate
change). What the settings were measured to save: scripts/experiments/README.md, "The
test suite's compile settings".
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

from jax_specdec.bench import drop_programs_if_crowded

# The legacy fusion emitters compile the suite's programs about a third faster than the
# default (MLIR) ones; LLVM level 1 keeps fused multiply-adds (level 0 moves float32
# results past test_tree's 1e-5 comparison with a float64 reference). Set for the test
# processes and their subprocesses before any JAX backend starts, where this jaxlib
# accepts the flags (a probe: XLA aborts on an unknown flag).
FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"


def _compile_faster():
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_use_fusion_emitters" in flags or os.environ.get("JAX_SPECDEC_TEST_XLA_DEFAULTS"):
        return
    flags = f"{flags} {FAST_COMPILE}".strip()
    probe = [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"]
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    if subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0:
        os.environ["XLA_FLAGS"] = flags


_compile_faster()

# The tests run the CPU kernel wherever it applies, on any machine (whether it pays here
# is measured and cached per machine, `kernels.cpu_choice`; tests/test_cpu_choice.py).
os.environ.setdefault("JAX_SPECDEC_SMALL_MATMUL", "1")

# In-process CLI calls would turn on JAX's persistent compilation cache in the user's
# cache directory: tests write nothing there (test_zoo checks the switch itself).
os.environ.setdefault("JAX_SPECDEC_COMPILE_CACHE", "0")

# The run's own persistent compilation cache: a folder made empty when the run starts
# (every run starts cold, as CI's) and deleted when it ends. The first process to load
# this module (pytest, or xdist's controller) makes it; workers and subprocesses inherit
# it through the environment, so a program compiled once is loaded, not compiled again,
# by a later file, the other worker or a subprocess. Loaded programs count as compiled
# ones in the budgets (JAX reports both as backend compiles).
RUN_CACHE = "JAX_SPECDEC_TEST_CACHE_DIR"


def _run_cache():
    if os.environ.get("JAX_SPECDEC_TEST_CACHE") == "0" or RUN_CACHE in os.environ:
        return
    os.environ[RUN_CACHE] = tempfile.mkdtemp(prefix="jax_specdec_tests_xla_")
    os.environ["JAX_SPECDEC_TEST_CACHE_OWNER"] = str(os.getpid())


_run_cache()
# schedule="auto" measures round costs once per shape: into this run's own folder, so a
# test never reads another run's (or the user's) measurements.
# Made here, it is deleted when this process ends (the run cache's owner deletes both).
_OWN_COSTS = None
if "JAX_SPECDEC_ROUND_COSTS" not in os.environ and RUN_CACHE not in os.environ:
    _OWN_COSTS = tempfile.mkdtemp(prefix="jax_specdec_costs_")
os.environ.setdefault(
    "JAX_SPECDEC_ROUND_COSTS",
    _OWN_COSTS or os.environ[RUN_CACHE] + "_round_costs",
)
if RUN_CACHE in os.environ:
    for name, value in (
        ("jax_compilation_cache_dir", os.environ[RUN_CACHE]),
        ("jax_persistent_cache_min_compile_time_secs", 0.5),
        # a size limit turns on the cache's file lock, which the two workers need
        ("jax_compilation_cache_max_size", 16 << 30),
    ):
        os.environ[name.upper()] = str(value)  # for subprocesses
        jax.config.update(name, value)


def pytest_unconfigure(config):
    if _OWN_COSTS is not None:
        shutil.rmtree(_OWN_COSTS, ignore_errors=True)
    if os.environ.get("JAX_SPECDEC_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ[RUN_CACHE], ignore_errors=True)
        shutil.rmtree(os.environ[RUN_CACHE] + "_round_costs", ignore_errors=True)


# Every program XLA:CPU compiles holds a few hundred memory maps until it is dropped, and
# past vm.max_map_count the next compile segfaults. Each file starts from no compiled
# programs (so its count does not depend on the files run before it in the process), and
# within a file they are dropped once a test leaves the process above half that limit.
@pytest.fixture(autouse=True)
def _drop_compiled_programs():
    yield
    drop_programs_if_crowded()


# Programs compiled per file, held to compile_budget.json: a file over its budget fails
# at its last test's teardown, so the suite does not drift back to compiling the same
# program again and again. A test class is counted on its own ("file.py::Class"), since
# xdist may run a file's classes on different workers (--dist loadscope); each starts
# from no compiled programs too. A budget is the measured count with 15% and 5 programs
# of slack (30 more for the files that may build the session's `pair`).
BUDGETS = json.loads(pathlib.Path(__file__).with_name("compile_budget.json").read_text())
_compiles = [0]
_counts: dict[str, int] = {}
# Seconds spent compiling (or loading from the run's cache) and saved by the cache.
_seconds = {"compiling": 0.0, "saved_by_cache": 0.0}
_file_seconds: dict[str, dict] = {}


def _count(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1
        _seconds["compiling"] += duration
    elif event == "/jax/compilation_cache/compile_time_saved_sec":
        _seconds["saved_by_cache"] += duration


jax.monitoring.register_event_duration_secs_listener(_count)


def _budget(name, before, seconds):
    _counts[name] = _compiles[0] - before
    _file_seconds[name] = {k: round(_seconds[k] - seconds[k], 1) for k in seconds}
    budget = BUDGETS.get(name)
    if budget is not None and _counts[name] > budget:
        pytest.fail(
            f"{name} compiled {_counts[name]} programs, over its budget of {budget} in "
            "tests/compile_budget.json: share compiled programs between its tests (one bound "
            "Run, module-scoped fixtures), or raise the budget if the new programs are needed"
        )


@pytest.fixture(autouse=True, scope="module")
def _compile_budget(request):
    jax.clear_caches()
    before, seconds = _compiles[0], dict(_seconds)
    yield
    _budget(request.path.name, before, seconds)


@pytest.fixture(autouse=True, scope="class")
def _class_compile_budget(request):
    if request.cls is None:  # a function outside a class: its file's count only
        yield
        return
    jax.clear_caches()
    before, seconds = _compiles[0], dict(_seconds)
    yield
    _budget(f"{request.path.name}::{request.cls.__name__}", before, seconds)


def pytest_sessionfinish(session):
    out = os.environ.get("JAX_SPECDEC_COMPILE_COUNTS")
    if out and _counts:
        path = pathlib.Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{os.getpid()}.json").write_text(json.dumps(_counts, indent=1, sort_keys=True))
        seconds = json.dumps(_file_seconds, indent=1, sort_keys=True)
        (path / f"{os.getpid()}.seconds.json").write_text(seconds)


# The heaviest files first, longest first: each file (each test class) runs whole on one
# of two workers (--dist loadscope; xdist keeps this order under --no-loadscope-reorder),
# and a heavy file started last would run on alone at the end.
HEAVY_FIRST = (
    "test_drafter_contract.py",
    "test_sharding.py",
    "test_slots.py",
    "test_batch_multihost.py",
    "test_schedules.py",
    "test_decode.py",
    "test_tree.py",
    "test_cli.py",
    "test_feature_drafter.py",
    "test_bench.py",
    "test_batch.py",
    "test_eagle3_loop.py",
    "test_batch_ray.py",
    "test_row_sampling.py",
    "test_acceptance.py",
    "test_block.py",
    "test_feature_train.py",
    "test_smollm2.py",
    "test_device_bench.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
