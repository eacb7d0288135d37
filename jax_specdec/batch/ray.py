"""One batch job over a Ray cluster (`jax-specdec batch --ray`), with Ray Data.

The driver reads and checks the input and the output as `run_job` does (`output.pending`:
the job file, the finished ids; an output of another job is refused). The rows not yet
in the output (a row of n samples as n rows, `input.samples`) are split into shards by
the SHA-256 of their `input.result_key` (the id's JSON, or `[id, sample]`'s), and each
shard is cut into calls as `run_job` cuts its rows (`plan_batches`). The calls are the
items of a Ray dataset, mapped by a pool of actors: each actor loads the models itself,
once (`load_worker` gets the job's settings, with the models' paths, not arrays), and
runs a call as `run_job` does (`run_call`), under the job's one `JobPlan`, computed
from all its rows. Ray restarts an actor that dies and runs its calls again.

Output: the driver appends each call's lines as they come back (in completion order,
`output.append`, as `run_job` appends its calls), so a killed job resumes as `run_job`'s
does and a finished id never runs again. When every row is in, the file is rewritten
(atomically) in one order that does not depend on the input, the workers or the timing:
by the SHA-256 of the id's JSON, a row's samples in order (`output.merge`). A row's line
is the one `run_job` writes for it (its tokens depend on its seed and prompt only), so
the file holds the lines of a one-process run, reordered; the job file is the same, and
either kind of run resumes the other's output.
"""

from __future__ import annotations

import functools
import json
import pathlib
import pickle
import time

import numpy as np

from jax_specdec.batch.call import JobPlan, run_call
from jax_specdec.batch.input import JobError, JobRow, samples
from jax_specdec.batch.output import Tally, append, id_hash, lines, merge, pending, progress_bar
from jax_specdec.batch.run import call_limit, plan_batches
from jax_specdec.batch.settings import BatchSettings

__all__ = ["load_worker", "run_ray_job", "shard_calls"]


def shard_calls(
    rows: list[JobRow],
    shards: int,
    limit: int,
    *,
    by_budget: bool,
    max_len: int | None = None,
) -> list[list[JobRow]]:
    """The calls of `rows`: shard by shard (SHA-256 of the `result_key` modulo `shards`:
    a row's samples spread over them), each shard cut by `plan_batches`. Deterministic
    for a set of rows."""
    parts: list[list[JobRow]] = [[] for _ in range(shards)]
    for row in rows:
        parts[int(id_hash(row.result_key), 16) % shards].append(row)
    calls = []
    for part in parts:
        calls += plan_batches(part, limit, by_budget=by_budget, max_len=max_len)
    return calls


class _Worker:
    """A Ray Data actor: loads the models once, then runs calls (pickled lists of rows)."""

    def __init__(self, load, plan: JobPlan):
        self.generate, self.detokenize = load()
        self.plan = plan

    def __call__(self, batch: dict) -> dict:
        texts, slot_rounds, errors = [], [], []
        for blob in batch["call"]:
            try:
                records, rounds = run_call(
                    pickle.loads(blob), self.generate, self.detokenize, self.plan
                )
            except JobError as e:  # sent back as data: Ray would wrap it past recognition
                records, rounds = [], 0
                errors.append(str(e))
            else:
                errors.append("")
            texts.append(lines(records))
            slot_rounds.append(rounds)
        return {
            "lines": np.array(texts, dtype=object),
            "slot_rounds": np.array(slot_rounds),
            "error": np.array(errors, dtype=object),
        }


def load_worker(settings: BatchSettings, eos: int | None):
    """In a Ray worker: loads the models from the job's paths (`BatchSettings.for_workers`),
    once; returns (generate, detokenize) for `run_ray_job`."""
    from jax_specdec.io.draft import load_pair
    from jax_specdec.settings import parse_mesh

    mesh = parse_mesh(settings.decode.mesh)
    loaded = load_pair(
        settings.decode.target, settings.draft, dtype=settings.decode.dtype, mesh=mesh
    )
    generate = settings.make_generate(loaded.target, loaded.draft, eos, mesh)
    return generate, loaded.tokenizer.decode


def _connect(address: str | None, workers: int, resources: dict) -> bool:
    """Joins the cluster at `address`, or the one this process already holds, or starts a
    local one sized for the workers; returns whether this call started it."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        cpus = max(1, round(workers * resources.get("CPU", 1)))
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


def _remote_args(resources: dict) -> dict:
    """Ray's resource arguments for one worker, from {"CPU": 1, "TPU": 4, ...}."""
    args: dict = {"num_cpus": resources.get("CPU", 1)}
    if "GPU" in resources:
        args["num_gpus"] = resources["GPU"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        args["resources"] = custom
    return args


def run_ray_job(
    rows: list[JobRow],
    output,
    settings: BatchSettings,
    *,
    load,
    job: dict,
    max_len: int | None = None,
    progress: bool = True,
    stop=None,
    logprob_kind: str = "processed",
) -> dict:
    """Runs the rows not yet in `output` over a Ray cluster; see the module's docstring.

    Args:
      rows, output, job, max_len, progress, stop, logprob_kind: as `run_job` takes them
        (`stop` is asked between calls that come back).
      settings: the job's calls (batch_size, slots, rows_per_call) and its cluster (ray:
        "auto", "ray://host:10001", ..., or "" to join the cluster this process is
        connected to or start a local one; ray_workers: actors, each loading the models
        once; ray_resources: one worker's, e.g. CPU 1 or TPU 4).
      load: a picklable fn() -> (generate, detokenize), called once in each worker (it
        loads the models there, from their paths: `load_worker`).

    Returns `run_job`'s summary, with the workers.
    """
    output, rows = pathlib.Path(output), samples(rows)
    done, todo = pending(rows, output, job)
    limit = call_limit(settings.batch_size, settings.slots, settings.rows_per_call)
    workers = settings.ray_workers
    by_budget = settings.slots is None
    calls = shard_calls(todo, workers, limit, by_budget=by_budget, max_len=max_len)
    plan = JobPlan.of(rows, logprob_kind)  # all rows: every restart, one plan
    tally, interrupted = Tally(), False
    start = time.perf_counter()
    if calls:
        import ray

        resources = dict(settings.ray_resources)
        started = _connect(settings.ray or None, workers, resources)
        try:
            items = _mapped(calls, workers, resources, load, plan).iter_rows()
            write = functools.partial(append, output, job)
            tally, interrupted = _collect(items, write, len(todo), progress, stop)
        finally:
            if started:
                ray.shutdown()
    if not interrupted:
        merge(output)
    summary = tally.summary(len(done), time.perf_counter() - start)
    return {**summary, "workers": workers, "interrupted": interrupted}


def _mapped(calls, workers: int, resources: dict, load, plan: JobPlan):
    """The calls as a Ray dataset mapped by a pool of `workers` actors (`_Worker`)."""
    import ray

    items = [{"call": pickle.dumps(call)} for call in calls]
    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    return dataset.map_batches(
        _Worker,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers),
        fn_constructor_kwargs={"load": load, "plan": plan},
        **_remote_args(resources),
    )


def _collect(items, write, total: int, progress: bool, stop) -> tuple[Tally, bool]:
    """Hands each call's lines to `write` (`output.append`) as they come back; returns the
    rows' tally and whether `stop` ended the job early."""
    tally = Tally()
    with progress_bar(total, progress) as bar:
        for item in items:
            if item["error"]:
                raise JobError(item["error"])
            write(item["lines"])
            records = [json.loads(text) for text in item["lines"].splitlines()]
            tally = tally.plus(records, int(item["slot_rounds"]))
            bar.update(len(records))
            if stop is not None and stop():
                return tally, True
    return tally, False
