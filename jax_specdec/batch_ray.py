"""One batch job over a Ray cluster (`jax-specdec batch --ray`), with Ray Data.

The driver reads and checks the input and the output as `run_job` does (the job file, the
finished ids; an output of another job is refused). The rows not yet in the output are
split into shards by the SHA-256 of their id's JSON, and each shard is cut into calls as
`run_job` cuts its rows (`plan_batches`). The calls are the items of a Ray dataset,
mapped by a pool of actors: each actor loads the models itself, once (`load` gets paths,
not arrays), and runs a call as `run_job` does (`_run_batch`), under the job's one
`SamplingPlan`, computed from all its rows. Ray restarts an actor that dies and runs its
calls again.

Output: the driver appends each call's lines as they come back (in completion order,
synced), so a killed job resumes as `run_job`'s does and a finished id never runs again.
When every row is in, the file is rewritten (atomically) in one order that does not
depend on the input, the workers or the timing: by the SHA-256 of the id's JSON. A row's
line is the one `run_job` writes for it (its tokens depend on its seed and prompt only),
so the file holds the lines of a one-process run, reordered; the job file is the same,
and either kind of run resumes the other's output.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import time

import numpy as np

from jax_specdec.batch import (
    _add_up,
    _call_limit,
    _job_file,
    _pending,
    _run_batch,
    _summary,
    plan_batches,
)
from jax_specdec.batch_input import JobError, JobRow
from jax_specdec.sampling import SamplingPlan

__all__ = ["id_hash", "merge_output", "run_ray_job", "shard_calls"]


def id_hash(key: str) -> str:
    """The SHA-256 (hex) of an id's JSON text (`JobRow.key`): the row's shard and its place
    in the finished output."""
    return hashlib.sha256(key.encode()).hexdigest()


def shard_calls(
    rows: list[JobRow],
    shards: int,
    limit: int,
    *,
    by_budget: bool,
    max_len: int | None = None,
) -> list[list[JobRow]]:
    """The calls of `rows`: shard by shard (SHA-256 of the id modulo `shards`), each shard
    cut by `plan_batches`. Deterministic for a set of rows."""
    parts: list[list[JobRow]] = [[] for _ in range(shards)]
    for row in rows:
        parts[int(id_hash(row.key), 16) % shards].append(row)
    calls = []
    for part in parts:
        calls += plan_batches(part, limit, by_budget=by_budget, max_len=max_len)
    return calls


class _Worker:
    """A Ray Data actor: loads the models once, then runs calls (pickled lists of rows)."""

    def __init__(self, load, plan: SamplingPlan):
        self.generate, self.detokenize = load()
        self.plan = plan

    def __call__(self, batch: dict) -> dict:
        lines, slot_rounds, errors = [], [], []
        for blob in batch["call"]:
            try:
                records, rounds = _run_batch(
                    pickle.loads(blob), self.generate, self.detokenize, self.plan
                )
            except JobError as e:  # sent back as data: Ray would wrap it past recognition
                records, rounds = [], 0
                errors.append(str(e))
            else:
                errors.append("")
            lines.append("".join(json.dumps(r) + "\n" for r in records))
            slot_rounds.append(rounds)
        return {
            "lines": np.array(lines, dtype=object),
            "slot_rounds": np.array(slot_rounds),
            "error": np.array(errors, dtype=object),
        }


def merge_output(output) -> None:
    """Rewrites a finished output in the order of its ids' SHA-256 (atomically: a kill
    leaves the old file or the new one)."""
    output = pathlib.Path(output)
    if not output.exists():
        return
    lines = output.read_text(encoding="utf-8").splitlines(keepends=True)
    lines.sort(key=lambda text: id_hash(json.dumps(json.loads(text)["id"])))
    merged = output.with_name(output.name + ".merging")
    with open(merged, "w", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(merged, output)


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
    *,
    load,
    job: dict,
    batch_size: int,
    slots: int | None = None,
    rows_per_call: int | None = None,
    max_len: int | None = None,
    address: str | None = None,
    workers: int = 2,
    resources: dict | None = None,
    progress: bool = True,
    stop=None,
) -> dict:
    """Runs the rows not yet in `output` over a Ray cluster; see the module's docstring.

    Args:
      rows, output, job, batch_size, slots, rows_per_call, max_len, stop: as `run_job`
        takes them (`stop` is asked between calls that come back).
      load: a picklable fn() -> (generate, detokenize), called once in each worker (it
        loads the models there, from their paths).
      address: the Ray cluster ("auto", "ray://host:10001", ...); None joins the cluster
        this process is connected to, or starts a local one.
      workers: actors (each loads the models once).
      resources: one worker's resources, e.g. {"CPU": 1} (default) or {"TPU": 4}.

    Returns `run_job`'s summary, with the workers.
    """
    import ray
    from tqdm.auto import tqdm

    output = pathlib.Path(output)
    resources = {"CPU": 1} if resources is None else resources
    done, pending = _pending(rows, output, job)
    limit = _call_limit(batch_size, slots, rows_per_call)
    calls = shard_calls(pending, workers, limit, by_budget=slots is None, max_len=max_len)
    plan = SamplingPlan.of([r.sampling for r in rows])  # all rows: every restart, one plan
    counters = ("rows", "tokens", "accepted", "rejected", "rounds", "drafted", "slot_rounds")
    totals = dict.fromkeys(counters, 0)
    start = time.perf_counter()
    interrupted = False
    if calls:
        started = _connect(address, workers, resources)
        try:
            items = [{"call": pickle.dumps(call)} for call in calls]
            dataset = ray.data.from_items(items, override_num_blocks=len(items))
            dataset = dataset.map_batches(
                _Worker,
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=workers),
                fn_constructor_kwargs={"load": load, "plan": plan},
                **_remote_args(resources),
            )
            bar = tqdm(total=len(pending), desc="batch", unit="row", disable=not progress)
            with bar:
                for item in dataset.iter_rows():
                    if item["error"]:
                        raise JobError(item["error"])
                    if not _job_file(output).exists():
                        _job_file(output).write_text(json.dumps(job, indent=1) + "\n")
                    with open(output, "a", encoding="utf-8") as f:
                        f.write(item["lines"])
                        f.flush()
                        os.fsync(f.fileno())
                    results = [json.loads(text) for text in item["lines"].splitlines()]
                    _add_up(totals, results)
                    totals["slot_rounds"] += int(item["slot_rounds"])
                    bar.update(len(results))
                    if stop is not None and stop():
                        interrupted = True
                        break
        finally:
            if started:
                ray.shutdown()
    if not interrupted:
        merge_output(output)
    summary = _summary(totals, len(done), time.perf_counter() - start)
    return {**summary, "workers": workers, "interrupted": interrupted}
