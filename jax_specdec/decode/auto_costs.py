"""What `schedules.Auto` chooses from: round costs measured with the call's own
program, and the acceptance per draft position those runs saw, kept on disk.

A round's cost depends on the device, the models, the drafter, the batch and the cache
length, so it is measured where it runs: the bound program is run with each width of
the menu forced in turn (inputs that make only that width affordable: the same compiled
program, nothing else to compile), on the call's own prompts for `TOKENS` tokens per
row, and once for 1 token (the prefill alone); `REPEATS` interleaved passes, each run's
fastest (a shared machine's slow spells only add time).
The costs solve: each run − the prefill run = its rounds of each width × that width's
cost (for a drafter that drafts what it is asked: the run's time over its rounds). The
acceptance of each draft position in those runs becomes the prior `Auto` starts each
row from.

Both are kept as JSON under `$JAX_SPECDEC_ROUND_COSTS`, else `<cache>/round_costs/`
(`io.zoo.cache_dir`), keyed by the machine (device kind and count, the CPU's model and
cores, jax's version, the CPU kernel setting), the program's shapes and settings and the
models' weights (a sample of each array's values: another checkpoint of the same shapes
accepts otherwise); a later call with the same key measures nothing (its rows start
from the stored prior).
Delete the folder to measure again. When the program's mesh spans processes, process 0's
file and measurement decide for all (every process runs the same programs).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import pathlib
import platform
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_specdec.decode.run import Run
from jax_specdec.schedules.auto import Auto, AutoInputs

__all__ = ["FOLDER_ENV", "REPEATS", "TOKENS", "Costs", "cache_key", "measure", "with_round_costs"]

FOLDER_ENV = "JAX_SPECDEC_ROUND_COSTS"
TOKENS = 24  # tokens per row of a measuring run
REPEATS = 3  # interleaved passes over the runs (each run's fastest counts)
SMOOTHING = 4.0  # tries of the overall rate added to each position's acceptance
MIN_ROUNDS = 4  # rounds each forced width must run for its cost to be cached
SAMPLED = 64  # values of each weight array in a model's part of the key
# Settings read where the program is built that change what it costs.
ENV_KEYS = ("JAX_SPECDEC_SMALL_MATMUL", "JAX_SPECDEC_ATTENTION", "XLA_FLAGS")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per round of each width of `Auto.widths` (and of the tree round last, if
    `Auto.tree`), the acceptance per draft position and per step of the tree's walk the
    measuring runs saw (None: not measured), and where they came from: "given"
    (`Auto.round_costs`), "cache" (a file) or "measured" (in `seconds`)."""

    per_width: tuple[float, ...]
    alpha: tuple[float, ...] | None
    source: str
    path: pathlib.Path | None = None
    seconds: float = 0.0
    tree_alpha: tuple[float, ...] | None = None


def with_round_costs(run: Run, schedule: Auto, models) -> tuple[Run, Costs]:
    """`run` with its `auto` input set: the schedule's own costs, the cached ones for
    this machine and program, or measured now (and cached). `models`: the program's
    models (their configurations are part of the cache key)."""
    if schedule.round_costs is not None:
        costs = Costs(schedule.round_costs, None, "given")
    else:
        costs = _cached_or_measured(run, schedule, models)
    inputs = schedule.inputs(costs.per_width, costs.alpha, costs.tree_alpha)
    return _with_input(run, inputs), costs


def _cached_or_measured(run: Run, schedule: Auto, models) -> Costs:
    key = cache_key(run, schedule, models)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = _folder() / f"{digest}.json"
    found = _read(path, schedule)
    sizes = (schedule.entries, schedule.max_gamma, schedule.tree_depth)
    agree = functools.partial(_agree, spans=_spans(run))
    if agree(np.float32(found is not None)) > 0:  # process 0's file decides
        values = agree(np.asarray(found if found else [0.0] * sum(sizes), np.float64))
        source, seconds, steady = "cache", 0.0, True
    else:
        start = time.perf_counter()
        per_width, alpha, tree_alpha, steady = measure(run, schedule)
        values = agree(np.asarray([*per_width, *alpha, *tree_alpha], np.float64))
        source, seconds = "measured", time.perf_counter() - start
    parts = np.split(values, np.cumsum(sizes)[:-1])
    per_width, alpha, tree_alpha = (tuple(float(v) for v in part) for part in parts)
    if source == "measured" and steady and jax.process_index() == 0:
        _write(path, key, schedule, per_width, alpha, tree_alpha)
    return Costs(per_width, alpha, source, path, seconds, tree_alpha)


def measure(run: Run, schedule: Auto, tokens: int = TOKENS, repeats: int = REPEATS):
    """(seconds per round of each shape of the menu, acceptance per draft position and
    per step of the tree's walk, whether every shape ran `MIN_ROUNDS` rounds: else the
    figures are this call's only, not cached), with `run`'s program (see above). With
    slots, only the first slots' prompts run. A drafter that proposes fewer tokens than
    asked (n-gram lookup) runs some rounds narrower than the width forced, so the costs
    solve seconds = rounds per shape × cost over all the runs (least squares)."""
    budgets = run.args.budgets
    if run.config.num_slots is not None:  # the queue's other prompts wait (budget 0)
        budgets = jnp.where(jnp.arange(budgets.shape[0]) < run.config.num_slots, budgets, 0)
    short = _with_input(run, schedule.forcing(0), jnp.minimum(budgets, 1))
    shapes = [*schedule.widths] + ([schedule.tree_choice] if schedule.tree else [])
    runs = [short] + [
        _with_input(run, schedule.forcing(w), jnp.minimum(budgets, tokens)) for w in shapes
    ]
    from jax_specdec.bench.timing import measure as interleaved

    # Each run once (the first compiles), then `repeats` interleaved passes.
    timed = interleaved([functools.partial(_generate, r) for r in runs], repeats)
    outputs = [m.output for m in timed]
    fastest = [min(m.timing.runs) for m in timed]
    prefill = fastest[0]
    # [runs, menu shapes]: rounds of each width, then of the tree (gamma_rounds' last).
    rounds = np.stack([_local(o.stats.gamma_rounds) for o in outputs[1:]]).astype(np.float64)
    rounds = rounds[:, [*schedule.widths] + ([-1] if schedule.tree else [])]
    spent = np.array([max(seconds - prefill, 1e-9) for seconds in fastest[1:]])
    per_width = _solve(rounds, spent)
    steady = bool(np.all(np.diag(rounds) >= MIN_ROUNDS))
    chains, trees = outputs[1 : len(schedule.widths) + 1], outputs[len(schedule.widths) + 1 :]
    alpha = _acceptance(chains, schedule.prior_alpha, "accepted_at", "rejected_at")
    tree_alpha = _acceptance(trees, schedule.prior_alpha, "tree_accepted_at", "tree_rejected_at")
    return per_width, alpha, tree_alpha, steady


def _solve(rounds: np.ndarray, spent: np.ndarray) -> list[float]:
    """Costs c >= 0 with rounds @ c ≈ spent; each forced run alone (its seconds over its
    rounds) where the system gives a cost that is not positive."""
    alone = spent / np.maximum(rounds.sum(axis=1), 1.0)
    solved, *_ = np.linalg.lstsq(rounds, spent, rcond=None)
    return [float(c) if c > 0 else float(a) for c, a in zip(solved, alone, strict=True)]


def _generate(run: Run):
    """The bound program's output, rows in program order (no reordering of slots)."""
    from jax_specdec.decode import program

    return program.generate(*run.args, config=run.config)


def _acceptance(outputs, prior: float, accepted_at: str, rejected_at: str) -> list[float]:
    """Acceptance of each draft position (given the drafts before it were accepted; the
    stats' fields `accepted_at`, `rejected_at`), pooled over the runs and rows and drawn
    toward the overall rate by `SMOOTHING` tries of it (the later positions are tried
    in few rounds: a few misses must not rule them out); `prior` where nothing was
    tried; within [0.01, 0.99]. Empty without runs."""
    if not outputs:
        return []
    accepted = sum(np.asarray(_local(getattr(o.stats, accepted_at))).sum(0) for o in outputs)
    rejected = sum(np.asarray(_local(getattr(o.stats, rejected_at))).sum(0) for o in outputs)
    tried = accepted + rejected
    overall = accepted.sum() / tried.sum() if tried.sum() else prior
    alpha = (accepted + SMOOTHING * overall) / (tried + SMOOTHING)
    return [float(a) for a in np.clip(alpha, 0.01, 0.99)]


def _local(x):
    """The rows of `x` this process holds, each once (all of them on one process); a
    replicated array's one copy."""
    if jax.process_count() == 1 or not hasattr(x, "addressable_shards"):
        return np.asarray(x)
    shards = [s for s in x.addressable_shards if s.replica_id == 0] or x.addressable_shards[:1]
    if x.ndim == 0 or len(shards) == 1:
        return np.asarray(shards[0].data)
    return np.concatenate([np.asarray(s.data) for s in shards])


def cache_key(run: Run, schedule: Auto, models) -> dict:
    """What the costs depend on, as JSON-able values: the machine and the program."""
    c = run.config
    args = run.args
    states = [args.target_state] + ([] if args.draft_state is None else [args.draft_state])
    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "source": _source_digest(),
        "env": {k: os.environ.get(k, "") for k in ENV_KEYS},
        "models": [_model_key(m, s) for m, s in zip(models, states, strict=True)],
        "drafter": repr(c.drafter),
        "acceptance": getattr(c.acceptance, "__qualname__", repr(c.acceptance)),
        "plan": repr(args.sampling.plan),
        "sampling": _digest(args.sampling),  # the rows' settings: the prior's acceptance
        "logprobs": repr(c.logprobs),
        "rows": int(args.prompts.shape[0]),
        "prompt_width": int(args.prompts.shape[1]),
        "cache_len": c.cache_len,
        "max_new_tokens": c.max_new_tokens,
        "slots": c.num_slots,
        "mesh": None if c.mesh is None else dict(c.mesh.shape),
        "widths": list(schedule.widths),
        "tree": None if schedule.tree is None else repr(schedule.tree),
        "tokens": TOKENS,
    }


def _digest(tree) -> str:
    """A short hash of a pytree's leaves' values (this process's part of each)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(_local(leaf)).tobytes())
    return h.hexdigest()[:16]


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _source_digest() -> str:
    """A hash of this package's Python sources: costs measured by other code are stale."""
    h = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parents[1].rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _model_key(model, state) -> str:
    """A model's configuration, its parameters' shapes and dtypes, and a sample of their
    values (`_fingerprint`)."""
    leaves = jax.tree.leaves(state)
    shapes = hashlib.sha256(repr([(a.shape, str(a.dtype)) for a in leaves]).encode())
    config = getattr(model, "config", type(model).__name__)
    return f"{config!r}:{shapes.hexdigest()[:16]}:{_fingerprint(leaves)}"


def _fingerprint(leaves) -> str:
    """A hash of up to `SAMPLED` evenly spaced values of each array (this process's
    first shard of it): a draft of the same shapes with other weights accepts otherwise,
    so it gets its own prior. Sampled where the array lives (a CPU array is read in
    place), never copied whole; each array once while it lives (`_sample`)."""
    h = hashlib.sha256()
    for leaf in leaves:
        h.update(_sample(leaf))
    return h.hexdigest()[:16]


_SAMPLES: dict[int, tuple[weakref.ref, bytes]] = {}  # id(array): (the array, its sample)


def _sample(leaf) -> bytes:
    """The bytes of up to `SAMPLED` evenly spaced values of `leaf`, remembered while the
    array lives (a `bind` of the same weights reads none of them again)."""
    hit = _SAMPLES.get(id(leaf))
    if hit is not None and hit[0]() is leaf:
        return hit[1]
    data = jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
    shards = getattr(data, "addressable_shards", None)
    data = shards[0].data if shards else data
    step = -(-data.size // SAMPLED) or 1
    on = {d.platform for d in data.devices()} if isinstance(data, jax.Array) else {"cpu"}
    if on == {"cpu"}:
        sample = np.asarray(data).reshape(-1)[::step]
    else:
        sample = np.asarray(_strided(data, step))
    value = np.ascontiguousarray(sample).tobytes()
    try:  # forgotten when the array goes (its id may then be reused)
        key = id(leaf)
        _SAMPLES[key] = (weakref.ref(leaf, lambda _, key=key: _SAMPLES.pop(key, None)), value)
    except TypeError:  # not weakly referable (a NumPy array): sampled again next time
        pass
    return value


@functools.partial(jax.jit, static_argnums=1)
def _strided(x, step: int):
    """Every `step`-th value of `x` flattened, on its device."""
    return x.reshape(-1)[::step]


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _folder() -> pathlib.Path:
    from jax_specdec.io.zoo import cache_dir

    if os.environ.get(FOLDER_ENV):
        return pathlib.Path(os.environ[FOLDER_ENV]).expanduser()
    return cache_dir() / "round_costs"


def _read(path: pathlib.Path, schedule: Auto) -> list[float] | None:
    """A record's costs, acceptance per position and per step of the tree's walk, or
    None (absent, unreadable, or for another menu)."""
    try:
        record = json.loads(path.read_text())
        costs = [float(c) for c in record["seconds_per_round"]]
        alpha = [float(a) for a in record["acceptance_per_position"]]
        tree_alpha = [float(a) for a in record.get("tree_acceptance_per_step", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = record.get("widths") == list(schedule.widths) and len(costs) == schedule.entries
    ok = ok and len(alpha) == schedule.max_gamma and len(tree_alpha) == schedule.tree_depth
    ok = ok and all(0 < c < 1e9 for c in costs)
    ok = ok and all(0 < a < 1 for a in alpha + tree_alpha)
    return costs + alpha + tree_alpha if ok else None


def _write(path: pathlib.Path, key: dict, schedule: Auto, per_width, alpha, tree_alpha) -> None:
    record = {
        "widths": list(schedule.widths),
        "seconds_per_round": list(per_width),
        "acceptance_per_position": list(alpha),
        "tree_acceptance_per_step": list(tree_alpha),
        "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "key": key,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: measured again next time
        pass


def _spans(run: Run) -> bool:
    """Whether the program's mesh spans other processes (which then run it together)."""
    mesh = run.config.mesh
    return mesh is not None and {d.process_index for d in mesh.devices.flat} != {
        jax.process_index()
    }


def _agree(value: np.ndarray, spans: bool) -> np.ndarray:
    """Process 0's `value` on every process of a program that spans processes (else
    this process's own)."""
    if not spans:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def _with_input(run: Run, inputs: AutoInputs, budgets=None) -> Run:
    """A copy of `run` with other `auto` inputs (and budgets)."""
    mesh = run.config.mesh
    if mesh is None:
        placed = AutoInputs(*(jnp.asarray(a) for a in inputs))
    else:  # replicated over the mesh, on every process
        sharding = NamedSharding(mesh, P())
        place = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])  # noqa: E731
        placed = AutoInputs(*(place(a) for a in inputs))
    out = copy.copy(run)
    args = run.args._replace(auto=placed)
    out.args = args if budgets is None else args._replace(budgets=budgets)
    return out
