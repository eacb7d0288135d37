"""Shared fixtures: the tiny target and draft of the loop tests, and a tiny pair saved as
model directories. Shared functions live in helpers.py."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest
from flax import nnx
from helpers import make_draft, make_model

from jax_specdec.bench import drop_programs_if_crowded
from jax_specdec.io.hf import save_model
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.training.corpus import stdlib_corpus, train_tokenizer

# Compiling is most of the suite's time, and two XLA:CPU settings make it cheaper: the
# legacy fusion emitters compile the suite's programs about a third faster than the
# default (MLIR) ones. LLVM's optimisation level 1 is set too: user CPU of
# tests/test_decode.py 205 s at level 2 and 138 s at level 1, but measured under unequal
# load, and a fresh-clone suite at level 1 with the run cache below used 2565 CPU-s
# against 2400 at level 2 without it (fewer tests): its gain is not shown yet (compare with
# JAX_SPECDEC_TEST_XLA_DEFAULTS=1 and JAX_SPECDEC_TEST_CACHE=0). Level 0 halves test_decode's
# CPU (110 s; run-bound files unchanged), but without fused
# multiply-adds float32 results move by up to 1.3e-5 relative, past test_tree's 1e-5
# comparison with a float64 reference; level 1 keeps them. Set here for the test
# processes and their subprocesses (before any JAX backend starts), where this jaxlib
# accepts the flags (a probe, since XLA aborts on an unknown one);
# JAX_SPECDEC_TEST_XLA_DEFAULTS=1 keeps XLA's defaults.
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

# In-process CLI calls would turn on JAX's persistent compilation cache (in the user's
# cache directory) for the rest of the test process: tests keep it off so that they write
# nothing there (test_zoo checks the switch itself).
os.environ.setdefault("JAX_SPECDEC_COMPILE_CACHE", "0")

# Instead, the run has a persistent compilation cache of its own: a folder made empty when
# the run starts (so every run, as CI's on a clean checkout, starts cold) and deleted when
# it ends. The process that loads this file first (pytest, or xdist's controller) makes
# it; the workers and every subprocess inherit it through the environment, so a program
# compiled once is loaded, not compiled again, by a later test file (each starts with no
# programs in memory), the other worker or a subprocess. Loaded programs count as compiled
# ones in the compile budgets below (JAX reports both as backend compiles).
# JAX_SPECDEC_TEST_CACHE=0 runs without it.
RUN_CACHE = "JAX_SPECDEC_TEST_CACHE_DIR"


def _run_cache():
    if os.environ.get("JAX_SPECDEC_TEST_CACHE") == "0" or RUN_CACHE in os.environ:
        return
    os.environ[RUN_CACHE] = tempfile.mkdtemp(prefix="jax_specdec_tests_xla_")
    os.environ["JAX_SPECDEC_TEST_CACHE_OWNER"] = str(os.getpid())


_run_cache()
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
    if os.environ.get("JAX_SPECDEC_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ[RUN_CACHE], ignore_errors=True)


# Every program XLA:CPU compiles keeps a few hundred memory maps until it is dropped, and a
# process may hold vm.max_map_count of them: past that, the next compile segfaults. Each
# test file starts from no compiled programs (so the programs it compiles are its own and
# their count does not depend on the files run before it in the process), and within a
# file they are dropped once a test leaves the process above half of that limit.
@pytest.fixture(autouse=True)
def _drop_compiled_programs():
    yield
    drop_programs_if_crowded()


# Programs compiled per test file, held to tests/compile_budget.json: a file that compiles
# more than its budget fails at its last test's teardown, so the suite does not drift back
# to compiling the same program again and again. A budget is the count measured with 15%
# and 5 programs of slack (30 more for the files that may build the session's `pair`).
# JAX_SPECDEC_COMPILE_COUNTS=DIR writes the counts of each process to DIR (to set the
# budgets after a deliberate change).
BUDGETS = json.loads((pathlib.Path(__file__).with_name("compile_budget.json")).read_text())
_compiles = [0]
_counts: dict[str, int] = {}
# Seconds spent compiling (or loading from the run's cache) and saved by the cache, per
# file: written beside the counts, to see where compiling goes.
_seconds = {"compiling": 0.0, "saved_by_cache": 0.0}
_file_seconds: dict[str, dict] = {}


def _count(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1
        _seconds["compiling"] += duration
    elif event == "/jax/compilation_cache/compile_time_saved_sec":
        _seconds["saved_by_cache"] += duration


jax.monitoring.register_event_duration_secs_listener(_count)


@pytest.fixture(autouse=True, scope="module")
def _compile_budget(request):
    jax.clear_caches()
    before, seconds = _compiles[0], dict(_seconds)
    yield
    name = request.path.name
    _counts[name] = _compiles[0] - before
    _file_seconds[name] = {k: round(_seconds[k] - seconds[k], 1) for k in seconds}
    budget = BUDGETS.get(name)
    if budget is not None and _counts[name] > budget:
        pytest.fail(
            f"{name} compiled {_counts[name]} programs, over its budget of {budget} in "
            "tests/compile_budget.json: share compiled programs between its tests (one bound "
            "Run, module-scoped fixtures), or raise the budget if the new programs are needed"
        )


def pytest_sessionfinish(session):
    out = os.environ.get("JAX_SPECDEC_COMPILE_COUNTS")
    if out and _counts:
        path = pathlib.Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{os.getpid()}.json").write_text(json.dumps(_counts, indent=1, sort_keys=True))
        seconds = json.dumps(_file_seconds, indent=1, sort_keys=True)
        (path / f"{os.getpid()}.seconds.json").write_text(seconds)


# The heaviest files first (measured, longest first; xdist keeps this order under
# --no-loadscope-reorder, which pyproject sets): each file runs whole on one of two
# workers (--dist loadfile), and a heavy file started last would run on alone at the end.
HEAVY_FIRST = (
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


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """target/, draft/ (same tokenizer) and other/ (a different tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    corpus = stdlib_corpus()
    tokenizer = train_tokenizer(corpus.read(corpus.train[:10]), 300)
    vocab = tokenizer.get_vocab_size()
    target = Transformer(TransformerConfig.tiny(vocab_size=vocab), rngs=nnx.Rngs(0), init_scale=0.3)
    draft = Transformer(
        TransformerConfig.tiny(vocab_size=vocab, num_layers=1), rngs=nnx.Rngs(1), init_scale=0.3
    )
    save_model(target, root / "target", tokenizer=tokenizer)
    save_model(draft, root / "draft", tokenizer=tokenizer)
    other = train_tokenizer(corpus.read(corpus.train[10:20]), 300)
    save_model(draft, root / "other", tokenizer=other)
    return root


@pytest.fixture(scope="module")
def target():
    """The target of the enumerated exactness tests (vocabulary 6)."""
    return make_model(0)


@pytest.fixture(scope="module")
def draft():
    return make_draft()
