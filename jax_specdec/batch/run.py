"""Running a batch job in one process (`run_job`), or in each process of many (`hosts`).

Reproducibility: row r is generated with the key of seed_r (`seed_key_data`), where
seed_r is the row's own `seed` or one derived from the job seed and the row's id alone
(63 bits of SHA-256, so a million rows do not share a seed). A row of n samples runs
as n rows (`input.samples`), sample i keyed by `input.sample_seed(seed_r, i)`, in the
same calls and programs as every other row; a row's stop strings cut its text, tokens
and finish reason on the host after the call (`stop_strings.apply`).
Rows are sorted by prompt length (then input line); rows of every sampling setting share
calls, each row sampled by its own (`sampling.RowSampling`) under one `SamplingPlan` for
the whole job, so the job is one compiled program per call shape. With slots (the
default) the rows run in calls of up to `rows_per_call` rows (CALL_SLOTS x slots unless
given), each call feeding its rows through the slots (a finished row's slot takes the
next row inside the program; rows of any budget share a call). With fixed batches,
rows are grouped by max_new_tokens and cut into batches of `batch_size`, each running
until its slowest row is done. The plan covers all rows, and a restart runs the same plan minus
the finished ids. A row's tokens depend on its seed and prompt only (the loop keeps
rows independent), so the output does not depend on slots, batch size, bucketing,
order or restarts; an interrupted and restarted job writes the same lines in the
same order (`output`).
"""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Iterable

import numpy as np

from jax_specdec.batch.call import JobPlan, run_call
from jax_specdec.batch.input import JobRow, samples
from jax_specdec.batch.output import Tally, append, lines, pending, progress_bar
from jax_specdec.settings import round_args

__all__ = ["CALL_SLOTS", "call_limit", "make_generate", "plan_batches", "run_call", "run_job"]

# With slots, one call runs up to CALL_SLOTS x slots rows: a killed job redoes at most
# one call, and a call's last rows leave slots idle only at its end.
CALL_SLOTS = 16


def plan_batches(
    rows: Iterable[JobRow], batch_size: int, *, by_budget: bool = True, max_len: int | None = None
) -> list[list[JobRow]]:
    """Rows (grouped by max_new_tokens if `by_budget`) sorted by prompt length (then
    input line), cut into calls of at most batch_size rows; with `max_len`,
    also wherever a call's longest prompt and largest budget would not fit in it
    together (one compiled call holds both). Deterministic for a set of rows, and for
    the rows after any cut."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(row.max_new_tokens if by_budget else 0, []).append(row)
    plan = []
    for key in sorted(groups):
        call: list[JobRow] = []
        for row in sorted(groups[key], key=lambda r: (len(r.tokens), r.line, r.sample or 0)):
            if call and (len(call) == batch_size or not _fits([*call, row], max_len)):
                plan.append(call)
                call = []
            call.append(row)
        plan += [call] if call else []
    return plan


def _fits(call: list[JobRow], max_len: int | None) -> bool:
    if max_len is None:
        return True
    return max(len(r.tokens) for r in call) + max(r.max_new_tokens for r in call) <= max_len


def make_generate(
    target,
    draft,
    *,
    eos_token_id,
    num_draft_tokens: int | str = 4,
    mesh=None,
    num_slots=None,
    tree=None,
    acceptance: str = "token",
):
    """The `generate` of `run_job`: speculative decoding with `draft` (with `tree` and
    `acceptance` as `Generator` takes them), or autoregressive
    decoding of `target` when draft is None; through `num_slots` slots if given (at most
    one per row); on `mesh` if given (a fixed batch is padded to a multiple of its data
    axis, a call on slots to at least one row per data shard, with copies of its last
    row whose outputs are dropped; slots are then a multiple of the data axis). On a mesh
    over several processes' devices every process gets the whole output, as NumPy arrays
    (`Run.replicated`)."""
    import jax

    from jax_specdec.decode import Generator

    data = 1 if mesh is None else mesh.shape["data"]
    models = (target,) if draft is None else (target, draft)
    rounds = {}
    if draft is not None:
        rounds = round_args(num_draft_tokens, tree, acceptance)
    # Made once: the weights are placed on the mesh once for all calls.
    generator = Generator(*models, **rounds, eos_token_id=eos_token_id, mesh=mesh)
    # A mesh over several processes' devices: the output comes back whole on every process.
    spans = mesh is not None and {d.process_index for d in mesh.devices.flat} != {
        jax.process_index()
    }

    def generate(prompts, keys, sampling, max_new_tokens, logprobs=None):
        rows = len(prompts)
        extra = -rows % data if num_slots is None else max(data - rows, 0)
        prompts = prompts + [prompts[-1]] * extra
        repeat = np.minimum(np.arange(rows + extra), rows - 1)
        keys, sampling = keys[repeat], sampling.at(repeat)
        max_new_tokens = list(max_new_tokens) + [max_new_tokens[-1]] * extra
        slots = None
        if num_slots is not None:
            slots = max(min(num_slots, len(prompts)) // data * data, data)
        top = {} if logprobs is None else dict(logprobs=logprobs.top, logprob_kind=logprobs.kind)
        run = generator.bind(
            prompts,
            key=keys,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            num_slots=slots,
            **top,
        )
        out = run.replicated() if spans else run()
        width = len(prompts)
        return jax.tree.map(lambda a: a[:rows] if a.ndim and a.shape[0] == width else a, out)

    generate.stop_ids = generator.stop_ids  # for each row's finish reason (`run_call`)
    return generate


def run_job(
    rows: list[JobRow],
    output,
    *,
    generate,
    job: dict,
    batch_size: int,
    slots: int | None = None,
    rows_per_call: int | None = None,
    detokenize=None,
    progress: bool = True,
    max_len: int | None = None,
    stop=None,
    hosts=None,
    logprob_kind: str = "processed",
) -> dict:
    """Runs the rows not yet in `output`, appending one line per row, call by call.

    Args:
      rows: from `read_rows` (a row of n samples runs as n rows, `input.samples`).
      output: the results file (created, or resumed).
      generate: fn(prompts: list[list[int]], keys, sampling: RowSampling, max_new_tokens:
        [int][, logprobs: LogprobSpec]) -> GenerationOutput for one call (speculative or
        autoregressive; the last argument only when a row asks for log-probabilities).
      job: what identifies the job (models, seed, schedule, defaults); stored beside
        the output with the first row and compared on restart.
      batch_size: rows per fixed batch (when `slots` is None).
      slots: the slots `generate` runs its rows through: calls of up to
        `rows_per_call` (default CALL_SLOTS x slots) rows, whatever their budgets and
        sampling settings.
      detokenize: fn(ids) -> text, or None.
      max_len: the models' context: no call holds a longest prompt and a largest budget
        that do not fit in it together.
      stop: fn() -> bool, asked between calls: True ends the job there (resumable).
      hosts: for a job over the processes of a `jax.distributed` run,
        `multihost.Hosts()`: process 0 reads `output` and tells every process the
        rows still to run, each call's output is gathered to every process, `stop` asked
        of all, and process 0 alone writes (and shows progress).
      logprob_kind: the distribution of the log-probabilities rows ask for ("processed"
        or "raw", `decode.logprobs`).

    Returns a summary (rows, tokens, seconds, tokens/s, rows/s, α, tokens per round,
    occupancy, and whether `stop` ended it; with `hosts`, the number of processes).
    """
    output, rows = pathlib.Path(output), samples(rows)
    if hosts is None:
        todo, lead = pending(rows, output, job)[1], True
    else:
        todo, lead = hosts.pending(rows, output, job), hosts.lead
        generate, stop, progress = hosts.gathered(generate), hosts.agreed(stop), progress and lead
    limit = call_limit(batch_size, slots, rows_per_call)
    plan = plan_batches(todo, limit, by_budget=slots is None, max_len=max_len)
    # One plan for every call (of all the job's rows, so a restart compiles the same
    # program): rows of any settings, stops and log-probabilities share calls and programs.
    job_plan = JobPlan.of(rows, logprob_kind)
    run = functools.partial(run_call, generate=generate, detokenize=detokenize, plan=job_plan)
    write = functools.partial(append, output, job) if lead else None
    start = time.perf_counter()
    tally, interrupted = _run_calls(plan, run, write, progress, stop)
    summary = tally.summary(len(rows) - len(todo), time.perf_counter() - start)
    extra = {} if hosts is None else {"processes": hosts.count}
    return {**summary, **extra, "interrupted": interrupted}


def call_limit(batch_size: int, slots: int | None, rows_per_call: int | None) -> int:
    """Rows per call: a fixed batch (split by budget too), or a call through the slots
    (whatever the budgets)."""
    if slots is None:
        return batch_size
    return rows_per_call or CALL_SLOTS * slots


def _run_calls(plan, run, write, progress: bool, stop) -> tuple[Tally, bool]:
    """Runs the plan's calls with `run` (`run_call`), handing each call's lines to `write`
    (`output.append`; None: not written); returns the rows' tally and whether `stop`
    ended the job early."""
    tally, start = Tally(), time.perf_counter()
    with progress_bar(sum(map(len, plan)), progress) as bar:
        for batch in plan:
            if stop is not None and stop():
                return tally, True
            records, slot_rounds = run(batch)
            if write is not None:
                write(lines(records))
            tally = tally.plus(records, slot_rounds)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tally.tokens / (time.perf_counter() - start):.0f}")
    return tally, False
