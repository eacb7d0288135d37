"""One batch job over the processes of a `jax.distributed` run (`jax-specdec batch
--distributed`): every host of a slice runs the same command.

Every process joins the job and compares the SHA-256 of its input file, of its model
files and of its flags (`join`, `check_same`) before anything is loaded: if one differs,
every process stops with the same error, naming it. Every process then reads the input
and loads the models. Process 0 alone reads the output (the job file, the finished ids,
a torn last line cut off) and broadcasts the rows still to run, as indexes into the
input; every process then cuts the same calls (`plan_batches`) under the job's one
`SamplingPlan` and makes the same sequence of calls to the same compiled program, on a
mesh over all processes' devices. Each call's output is gathered to every process
(`process_allgather`); process 0 alone writes the lines (`output.append`, call by call),
the job file, the progress bar and the summary. The file is the one a one-process job
writes, byte for byte, so either kind of run resumes the other's output.

A process that dies leaves the others waiting in a collective: stop them all and run the
same command on every process again; the rows already written are not run again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_specdec.batch.input import JobError, JobRow
from jax_specdec.batch.output import file_digest, model_identity, pending
from jax_specdec.batch.settings import BatchSettings

__all__ = [
    "check_same",
    "digest",
    "flags_digest",
    "Hosts",
    "initialize",
    "join",
]

MISSING = bytes(32)  # the digest of a file a process does not have


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize`, with gloo for collectives on CPU devices. What is
    None JAX finds itself (JAX_COORDINATOR_ADDRESS, a Cloud TPU slice, SLURM, ...)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


def digest(path) -> bytes:
    """The SHA-256 of a file (MISSING if there is none)."""
    path = pathlib.Path(path)
    return bytes.fromhex(file_digest(path)) if path.is_file() else MISSING


def check_same(items: dict[str, bytes]) -> None:
    """Stops every process with the same JobError unless all hold the same digests.

    Args:
      items: what must agree, by name (e.g. "--input in.jsonl") -> a 32-byte SHA-256.
    """
    local = np.array([list(v) for v in items.values()], np.int32)  # [K, 32]
    every = np.asarray(multihost_utils.process_allgather(local))  # [P, K, 32]
    for k, name in enumerate(items):
        if (every[:, k] != every[0, k]).any():
            seen = ", ".join(
                f"{_short(bytes(every[p, k].astype(np.uint8).tolist()))} on process {p}"
                for p in range(len(every))
            )
            raise JobError(
                f"{name} differs between processes (SHA-256 {seen}): every process must run "
                "the same command on the same files"
            )


def _short(value: bytes) -> str:
    return "missing" if value == MISSING else value.hex()[:12] + "…"


def _broadcast(values: np.ndarray, size: int) -> np.ndarray:
    """Process 0's int32 [size] array, on every process."""
    if not size:
        return np.zeros(0, np.int32)
    mine = values if jax.process_index() == 0 else np.zeros(size, np.int32)
    return np.asarray(multihost_utils.broadcast_one_to_all(mine.astype(np.int32)))


def _agree_pending(rows: list[JobRow], output: pathlib.Path, job: dict) -> list[int]:
    """Process 0 checks `output` as a one-process job does and sends every process the
    indexes of the rows still to run (or its error, raised on every process)."""
    status, payload = 0, np.zeros(0, np.int32)
    if jax.process_index() == 0:
        try:
            done, _ = pending(rows, output, job)
            payload = np.array(
                [i for i, r in enumerate(rows) if r.result_key not in done], np.int32
            )
        except (JobError, OSError) as e:
            status, payload = 1, np.frombuffer(str(e).encode(), np.uint8).astype(np.int32)
    head = _broadcast(np.array([status, payload.size], np.int32), 2)
    payload = _broadcast(payload, int(head[1]))
    if head[0]:
        raise JobError(bytes(payload.astype(np.uint8).tolist()).decode())
    return payload.tolist()


def _on_host(x):
    """A global array's whole value on every process (a collective); a local one as is."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _gathered(generate):
    """`generate` whose output every process holds whole, as NumPy arrays."""

    def call(*args):
        return jax.tree.map(_on_host, generate(*args))

    call.stop_ids = getattr(generate, "stop_ids", ())  # for the rows' finish reasons
    return call


def _agreed(stop):
    """`stop` asked of every process between calls: any that says stop stops them all
    (each must make the same calls)."""

    def ask() -> bool:
        mine = np.array([stop is not None and bool(stop())], np.int32)
        return bool(np.asarray(multihost_utils.process_allgather(mine)).any())

    return ask


class Hosts:
    """The hooks `run.run_job(..., hosts=Hosts())` runs a job over the processes of a
    `jax.distributed` run with (see the module's docstring): `rows`, `job`, the call
    settings and `generate` (on a mesh over all processes' devices) must be the same on
    every process; the output path is read and written by process 0 only."""

    @property
    def lead(self) -> bool:
        return jax.process_index() == 0

    @property
    def count(self) -> int:
        return jax.process_count()

    def pending(self, rows: list[JobRow], output: pathlib.Path, job: dict) -> list[JobRow]:
        return [rows[i] for i in _agree_pending(rows, output, job)]

    gathered = staticmethod(_gathered)
    agreed = staticmethod(_agreed)


def flags_digest(settings: BatchSettings) -> bytes:
    """The SHA-256 of a job's settings (JSON, keys sorted), this process's place apart."""
    fields = dataclasses.asdict(dataclasses.replace(settings, distributed=None))
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()


def join(settings: BatchSettings) -> None:
    """Joins the `jax.distributed` job at `settings.distributed`, then checks that every
    process runs the same command on the same input and model files (before anything is
    loaded or compiled)."""
    initialize(**dataclasses.asdict(settings.distributed))
    models = [model_identity(settings.decode.target), model_identity(settings.draft)]
    check_same(
        {
            f"--input {settings.input}": digest(settings.input),
            "the model files (--target, --draft)": hashlib.sha256(
                json.dumps(models).encode()
            ).digest(),
            "the command's flags": flags_digest(settings),
        }
    )
