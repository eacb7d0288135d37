"""Resumable JSONL generation jobs (`jax-specdec batch`).

Input: one JSON object per line with an `id` (string or integer, unique) and either a
`prompt` (text) or `tokens` (ids); optionally `seed` (integer >= 0), `temperature`,
`top_k`, `top_p` and `max_new_tokens` overriding the job's defaults.

Output: one JSON object per finished row, `{"id", "seed", "tokens", "text", "stats"}`,
appended and flushed call by call, plus `<output>.job.json` recording what the job
is (models, seed, schedule, defaults, input), written with the first row: a restart
with a different job is refused. Every input line is checked when the file is read
(`jax_specdec.batch_input`), before anything is compiled or written.

Reproducibility: row r is generated with the key of seed_r (`seed_key_data`), where
seed_r is the row's own `seed` or one derived from the job seed and the row's id alone
(63 bits of SHA-256, so a million rows do not share a seed).
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
same order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import time
import warnings
from collections.abc import Iterable

import numpy as np

from jax_specdec.batch_input import JobError, JobRow, derive_seed, read_rows, seed_key_data
from jax_specdec.sampling import RowSampling, SamplingPlan

__all__ = [
    "CALL_SLOTS",
    "JobError",
    "JobRow",
    "derive_seed",
    "make_generate",
    "plan_batches",
    "read_rows",
    "run_job",
    "seed_key_data",
]

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
        for row in sorted(groups[key], key=lambda r: (len(r.tokens), r.line)):
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


def _finished_ids(output: pathlib.Path) -> set[str]:
    """Ids already in the output; a torn last line (no newline, or not JSON) is cut off."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with open(output, "r+b") as f:  # torn last line: drop it, its row runs again
            f.truncate(cut)
        data = data[:cut]
    done = set()
    for n, text in enumerate(data.decode("utf-8").splitlines(), start=1):
        try:
            done.add(json.dumps(json.loads(text)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise JobError(f"{output} line {n} is not a result line of this tool") from None
    return done


def _file_digest(path: pathlib.Path) -> str:
    """The SHA-256 (hex) of a file, hashed once while its size and time stay the same (a
    multi-host job checks the model files before `model_identity` records them)."""
    stat = os.stat(path)
    return _digest(str(pathlib.Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(model_dir) -> dict:
    d = pathlib.Path(model_dir)
    return {
        "path": str(d),
        "sha256": {
            name: _file_digest(d / name)
            for name in ("config.json", "model.safetensors")
            if (d / name).is_file()
        },
    }


def _job_file(output: pathlib.Path) -> pathlib.Path:
    return output.with_name(output.name + ".job.json")


def _check_job(output: pathlib.Path, job: dict) -> None:
    """Checks that an existing <output>.job.json describes this job (it is written with
    the first row, so a job that failed before any row leaves its output path free)."""
    meta = _job_file(output)
    if meta.exists():
        old = json.loads(meta.read_text())
        differs = sorted(k for k in set(old) | set(job) if old.get(k) != job.get(k))
        if differs:
            raise JobError(
                f"{output} belongs to a different job ({', '.join(differs)} differ, see "
                f"{meta}); use a new output file or delete both"
            )
    elif output.exists() and output.stat().st_size > 0:
        raise JobError(f"{output} exists but has no {meta.name}: not an output of this tool")


def make_generate(
    target,
    draft,
    *,
    eos_token_id,
    num_draft_tokens: int = 4,
    mesh=None,
    num_slots=None,
    tree=None,
    acceptance=None,
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
    rounds = {} if draft is None else dict(num_draft_tokens=num_draft_tokens, tree=tree)
    if draft is not None:
        rounds["acceptance"] = acceptance
    # Made once: the weights are placed on the mesh once for all calls.
    generator = Generator(*models, **rounds, eos_token_id=eos_token_id, mesh=mesh)
    # A mesh over several processes' devices: the output comes back whole on every process.
    spans = mesh is not None and {d.process_index for d in mesh.devices.flat} != {
        jax.process_index()
    }

    def generate(prompts, keys, sampling, max_new_tokens):
        rows = len(prompts)
        extra = -rows % data if num_slots is None else max(data - rows, 0)
        prompts = prompts + [prompts[-1]] * extra
        repeat = np.minimum(np.arange(rows + extra), rows - 1)
        keys, sampling = keys[repeat], sampling.at(repeat)
        max_new_tokens = list(max_new_tokens) + [max_new_tokens[-1]] * extra
        slots = None
        if num_slots is not None:
            slots = max(min(num_slots, len(prompts)) // data * data, data)
        run = generator.bind(
            prompts, key=keys, max_new_tokens=max_new_tokens, sampling=sampling, num_slots=slots
        )
        out = run.replicated() if spans else run()
        width = len(prompts)
        return jax.tree.map(lambda a: a[:rows] if a.ndim and a.shape[0] == width else a, out)

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
) -> dict:
    """Runs the rows not yet in `output`, appending one line per row, call by call.

    Args:
      rows: from `read_rows`.
      output: the results file (created, or resumed).
      generate: fn(prompts: list[list[int]], keys, sampling: RowSampling, max_new_tokens:
        [int]) -> GenerationOutput for one call (speculative or autoregressive).
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
        `batch_multihost.Hosts()`: process 0 reads `output` and tells every process the
        rows still to run, each call's output is gathered to every process, `stop` asked
        of all, and process 0 alone writes (and shows progress).

    Returns a summary (rows, tokens, seconds, tokens/s, rows/s, α, tokens per round,
    occupancy, and whether `stop` ended it; with `hosts`, the number of processes).
    """
    output = pathlib.Path(output)
    if hosts is None:
        pending, write = _pending(rows, output, job)[1], True
    else:
        pending, write = hosts.pending(rows, output, job), hosts.lead
        generate, stop, progress = hosts.gathered(generate), hosts.agreed(stop), progress and write
    limit = _call_limit(batch_size, slots, rows_per_call)
    plan = plan_batches(pending, limit, by_budget=slots is None, max_len=max_len)
    # One sampling plan for every call (of all the job's rows, so a restart compiles the
    # same program): rows of any settings share calls and programs.
    sampling = SamplingPlan.of([r.sampling for r in rows])
    counters = ("rows", "tokens", "accepted", "rejected", "rounds", "drafted", "slot_rounds")
    totals = dict.fromkeys(counters, 0)
    start = time.perf_counter()
    run = functools.partial(_run_batch, generate=generate, detokenize=detokenize, plan=sampling)
    interrupted = _append(output, job, plan, totals, run, progress, stop, write=write)
    summary = _summary(totals, len(rows) - len(pending), time.perf_counter() - start)
    extra = {} if hosts is None else {"processes": hosts.count}
    return {**summary, **extra, "interrupted": interrupted}


def _pending(rows: list[JobRow], output: pathlib.Path, job: dict) -> tuple[set[str], list[JobRow]]:
    """Checks that `output` is free or belongs to this job; returns (the finished ids, the
    rows still to run)."""
    _check_job(output, job)
    done = _finished_ids(output)
    unknown = done - {r.key for r in rows}
    if unknown:
        raise JobError(
            f"{output} holds {len(unknown)} id(s) that are not in the input, e.g. "
            f"{sorted(unknown)[0]}: it belongs to a different job"
        )
    return done, [r for r in rows if r.key not in done]


def _call_limit(batch_size: int, slots: int | None, rows_per_call: int | None) -> int:
    """Rows per call: a fixed batch (split by budget too), or a call through the slots
    (whatever the budgets)."""
    if slots is None:
        return batch_size
    return rows_per_call or CALL_SLOTS * slots


def _append(output, job, plan, totals, run, progress, stop, *, write: bool = True) -> bool:
    """Runs the plan's calls with `run` (`_run_batch`), appending each call's lines (the
    job file with the first) if `write`; returns whether `stop` ended it early."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    bar = tqdm(total=sum(map(len, plan)), desc="batch", unit="row", disable=not progress)
    with bar:
        for batch in plan:
            if stop is not None and stop():
                return True
            results, slot_rounds = run(batch)
            totals["slot_rounds"] += slot_rounds
            if write:
                _write_call(output, job, results)
            _add_up(totals, results)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{totals['tokens'] / (time.perf_counter() - start):.0f}")
    return False


def _write_call(output: pathlib.Path, job: dict, results: list[dict]) -> None:
    if not _job_file(output).exists():
        _job_file(output).write_text(json.dumps(job, indent=1) + "\n")
    # Appended and synced call by call: a killed job loses at most this call.
    with open(output, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in results))
        f.flush()
        os.fsync(f.fileno())


def _add_up(totals: dict, results: list[dict]) -> None:
    totals["rows"] += len(results)
    for r in results:
        totals["tokens"] += r["stats"]["generated"]
        for k in ("rounds", "drafted", "accepted", "rejected"):
            totals[k] += r["stats"][k]


def _run_batch(batch: list[JobRow], generate, detokenize, plan) -> tuple[list[dict], int]:
    """One call of `generate` (rows sampled under the job's `SamplingPlan`): an output
    record per row, and the call's slot-rounds."""
    import jax

    keys = jax.random.wrap_key_data(np.stack([seed_key_data(r.seed) for r in batch]))
    budgets = [r.max_new_tokens for r in batch]
    sampling = RowSampling.of([r.sampling for r in batch], plan)
    with warnings.catch_warnings():  # checked below, for the rows' ids
        warnings.filterwarnings("ignore", "NaN/inf logits", RuntimeWarning)
        out = generate([list(r.tokens) for r in batch], keys, sampling, budgets)
    bad = np.flatnonzero(np.asarray(out.stats.nonfinite))
    if bad.size:
        rows = ", ".join(f"{batch[b].key} (line {batch[b].line})" for b in bad[:4])
        raise JobError(
            f"NaN/inf logits met for id(s) {rows}: the model's weights hold NaN/inf or are "
            "corrupt; nothing of this call was written"
        )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    counters = {
        k: np.asarray(getattr(out.stats, k)) for k in ("rounds", "drafted", "accepted", "rejected")
    }
    records = []
    for b, row in enumerate(batch):
        ids = tokens[b, : lengths[b]].tolist()
        stats = {"generated": int(lengths[b]), **{k: int(v[b]) for k, v in counters.items()}}
        text = None if detokenize is None else detokenize(ids)
        records.append(
            {"id": row.id, "seed": row.seed, "tokens": ids, "text": text, "stats": stats}
        )
    return records, int(out.stats.slot_rounds)


def _summary(totals: dict, skipped: int, seconds: float) -> dict:
    judged = totals["accepted"] + totals["rejected"]
    rounds = totals["rounds"]
    return {
        "rows_run": totals["rows"],
        "rows_skipped_as_finished": skipped,
        "tokens": totals["tokens"],
        "seconds": seconds,
        "tokens_per_second": totals["tokens"] / seconds if seconds else 0.0,
        "rows_per_second": totals["rows"] / seconds if seconds else 0.0,
        "alpha": totals["accepted"] / judged if judged else None,
        "tokens_per_round": (totals["tokens"] - totals["rows"]) / rounds if rounds else None,
        "occupancy": rounds / totals["slot_rounds"] if totals["slot_rounds"] else None,
    }
