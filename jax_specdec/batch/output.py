"""The output of a batch job, written the same way by one process (`run.run_job`), by the
lead of many (`multihost`) and by a Ray driver (`ray`): one JSON line per finished row,
`{"id", ["sample",] "seed", "tokens", "text", "finish_reason", ["stop",] "stats"}` (the
reason "eos", "length" or "stop"; "sample" only in the lines of a row of `n` samples),
appended and synced call by call, and `<output>.job.json`, what the job is, written with
the first row.

A restart reads the output back (`pending`): the job file must describe the same job, a
torn last line is cut off (its row runs again), and the finished lines, known by their
id and sample (`input.result_key`), are not run again. `merge` rewrites a finished output
in the order of its ids' SHA-256 (a Ray job's order), a row's samples in order;
`Tally` adds up the rows' counters into the job's summary.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib

from jax_specdec.batch.input import JobError, JobRow, result_key

__all__ = [
    "Tally",
    "append",
    "check_job",
    "file_digest",
    "finished_ids",
    "id_hash",
    "job_file",
    "lines",
    "merge",
    "model_identity",
    "pending",
    "progress_bar",
]

# A row's counters in its "stats", added up over the job.
_ROW_COUNTERS = ("rounds", "drafted", "accepted", "rejected")


def job_file(output: pathlib.Path) -> pathlib.Path:
    """`<output>.job.json`: what the job is, compared on restart."""
    return output.with_name(output.name + ".job.json")


def finished_ids(output: pathlib.Path) -> set[str]:
    """The lines already in the output, as `input.result_key`s (an id, or an id and a
    sample); a torn last line (no newline, or not JSON) is cut off."""
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
            line = json.loads(text)
            done.add(result_key(line["id"], line.get("sample")))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise JobError(f"{output} line {n} is not a result line of this tool") from None
    return done


def check_job(output: pathlib.Path, job: dict) -> None:
    """Checks that an existing <output>.job.json describes this job (it is written with
    the first row, so a job that failed before any row leaves its output path free)."""
    meta = job_file(output)
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


def pending(rows: list[JobRow], output: pathlib.Path, job: dict) -> tuple[set[str], list[JobRow]]:
    """Checks that `output` is free or belongs to this job; returns (the finished lines'
    `result_key`s, the rows (samples, `input.samples`) still to run)."""
    check_job(output, job)
    done = finished_ids(output)
    unknown = done - {r.result_key for r in rows}
    if unknown:
        raise JobError(
            f"{output} holds {len(unknown)} id(s) that are not in the input, e.g. "
            f"{sorted(unknown)[0]}: it belongs to a different job"
        )
    return done, [r for r in rows if r.result_key not in done]


def file_digest(path: pathlib.Path) -> str:
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
    """A model directory in the job file: its path (or Hub id) and its files' SHA-256 (a
    Hub id's from its snapshot in the cache)."""
    from jax_specdec.io.hub import hub_snapshot, is_hub_id

    given = d = pathlib.Path(model_dir)
    if not d.exists() and is_hub_id(str(model_dir)):
        d = hub_snapshot(str(model_dir), "model")
    return {
        "path": str(given),
        "sha256": {
            name: file_digest(d / name)
            for name in ("config.json", "model.safetensors")
            if (d / name).is_file()
        },
    }


def lines(records: list[dict]) -> str:
    """A call's output records as the file's lines."""
    return "".join(json.dumps(r) + "\n" for r in records)


def append(output: pathlib.Path, job: dict, text: str) -> None:
    """Appends a call's lines, synced (a killed job loses at most this call); the job
    file first if there is none yet."""
    if not job_file(output).exists():
        job_file(output).write_text(json.dumps(job, indent=1) + "\n")
    with open(output, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def id_hash(key: str) -> str:
    """The SHA-256 (hex) of an id's JSON text (`JobRow.key`): a Ray job's shard of the row
    and its place in the merged output."""
    return hashlib.sha256(key.encode()).hexdigest()


def merge(output) -> None:
    """Rewrites a finished output in the order of its ids' SHA-256, a row's samples in
    order (atomically: a kill leaves the old file or the new one)."""
    output = pathlib.Path(output)
    if not output.exists():
        return
    text = output.read_text(encoding="utf-8").splitlines(keepends=True)
    text.sort(key=_merge_order)
    merged = output.with_name(output.name + ".merging")
    with open(merged, "w", encoding="utf-8") as f:
        f.write("".join(text))
        f.flush()
        os.fsync(f.fileno())
    os.replace(merged, output)


def _merge_order(text: str) -> tuple[str, int]:
    line = json.loads(text)
    return id_hash(json.dumps(line["id"])), line.get("sample", 0)


def progress_bar(total: int, show: bool):
    """The job's progress bar over `total` rows (hidden unless `show`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="batch", unit="row", disable=not show)


@dataclasses.dataclass(frozen=True)
class Tally:
    """The counters of the rows run so far (`plus` adds a call's)."""

    rows: int = 0
    tokens: int = 0
    accepted: int = 0
    rejected: int = 0
    rounds: int = 0
    drafted: int = 0
    slot_rounds: int = 0

    def plus(self, records: list[dict], slot_rounds: int) -> Tally:
        """The tally with a call's records and slot-rounds added."""
        sums = {k: sum(r["stats"][k] for r in records) for k in _ROW_COUNTERS}
        return dataclasses.replace(
            self,
            rows=self.rows + len(records),
            tokens=self.tokens + sum(r["stats"]["generated"] for r in records),
            slot_rounds=self.slot_rounds + slot_rounds,
            **{k: getattr(self, k) + v for k, v in sums.items()},
        )

    def summary(self, skipped: int, seconds: float) -> dict:
        """The job's summary (rows, tokens, seconds, tokens/s, rows/s, α, tokens per round,
        occupancy)."""
        judged = self.accepted + self.rejected
        return {
            "rows_run": self.rows,
            "rows_skipped_as_finished": skipped,
            "tokens": self.tokens,
            "seconds": seconds,
            "tokens_per_second": self.tokens / seconds if seconds else 0.0,
            "rows_per_second": self.rows / seconds if seconds else 0.0,
            "alpha": self.accepted / judged if judged else None,
            "tokens_per_round": (self.tokens - self.rows) / self.rounds if self.rounds else None,
            "occupancy": self.rounds / self.slot_rounds if self.slot_rounds else None,
        }
