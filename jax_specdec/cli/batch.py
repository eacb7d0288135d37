"""`jax-specdec batch`: a resumable JSONL generation job (one result line per input row)."""

from __future__ import annotations

import functools
import json
import pathlib
import signal
import sys
from typing import Any, NamedTuple

from jax_specdec.cli import common
from jax_specdec.io.draft import context, load_pair


def add_parser(sub) -> None:
    job = sub.add_parser(
        "batch",
        help="a resumable JSONL generation job (one result line per input row)",
        description="Input lines: {id, prompt | tokens | messages, [seed, temperature, top_k, "
        "top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, "
        "max_new_tokens, n, stop, logprobs]}. Output lines: {id, [sample,] seed, tokens, "
        "text, finish_reason, [stop,] [logprobs,] stats}. A restarted job skips finished ids "
        "(and samples); a row depends only on the job seed and its id (or its seed), and its "
        "sample's index.",
    )
    job.add_argument("--input", required=True, help="JSONL prompts")
    job.add_argument("--output", required=True, help="JSONL results (appended, resumable)")
    job.add_argument("--target", default=common.DEFAULT_TARGET, help="target model directory")
    job.add_argument("--draft", default=common.DEFAULT_DRAFT, help="draft model directory")
    job.add_argument(
        "--slots",
        type=int,
        default=8,
        help="rows generated at once; a finished row's slot takes the next prompt inside "
        "the compiled program (default 8)",
    )
    job.add_argument(
        "--fixed-batches",
        action="store_true",
        help="the old way, for comparison: fixed batches of --batch-size rows of one "
        "max_new_tokens, each running until its slowest row is done",
    )
    job.add_argument(
        "--rows-per-call",
        type=int,
        help="rows per compiled-program call with slots (default 16 x --slots); output "
        "lines are written after each call, so a killed job redoes at most one call",
    )
    job.add_argument("--batch-size", type=int, default=8, help="rows per fixed batch")
    job.add_argument("--seed", type=int, default=0, help="job seed (rows without their own)")
    # A fixed width: with auto a row's tokens at T > 0 would depend on which rows share
    # its call (the widths follow the batch), and a restarted job must give each row
    # the tokens it would have got.
    why = "; auto: a row's tokens, not their distribution, then depend on its call's rows"
    common.add_round_flags(job, gamma=4, why=why)
    job.add_argument("--max-new-tokens", type=int, default=128)
    common.add_sampling_flags(job)
    common.add_sample_flags(job, "row (a row's own 'n' overrides it)")
    job.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default="stop",
        help="a malformed input line stops the job (default) or is skipped and listed",
    )
    job.add_argument("--errors", help="where skipped lines go (default <output>.errors.jsonl)")
    job.add_argument(
        "--autoregressive", action="store_true", help="plain decoding of the target (baseline)"
    )
    common.add_model_flags(job)
    _add_ray_flags(job)
    _add_distributed_flags(job)
    job.set_defaults(handler=run, parser=job)


def _add_ray_flags(job) -> None:
    job.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run over a Ray cluster with Ray Data (pip install -e '.[ray]'): ADDRESS as "
        "ray.init takes it ('auto', 'ray://head:10001'); none: a local cluster. The output "
        "is sorted by the SHA-256 of the ids when the job ends",
    )
    job.add_argument(
        "--ray-workers", type=int, default=2, help="Ray actors, each loading the models once"
    )
    job.add_argument(
        "--ray-worker-resources",
        default="CPU=1",
        metavar="NAME=N[,NAME=N]",
        help="one Ray worker's resources, e.g. CPU=1 (default), TPU=4 or GPU=1",
    )


def _add_distributed_flags(job) -> None:
    job.add_argument(
        "--distributed",
        action="store_true",
        help="run as one process of a jax.distributed job: the same command on every "
        "process (every host of a slice), --mesh over all their devices, process 0 writing "
        "the output. The coordinator and this process's place come from --coordinator, "
        "--num-processes and --process-id (any of them implies --distributed), or else "
        "from what jax.distributed.initialize finds (JAX_COORDINATOR_ADDRESS, a Cloud TPU "
        "slice, SLURM, Open MPI)",
    )
    job.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    job.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    job.add_argument("--process-id", type=int, metavar="I", help="this process's index, in [0, N)")


class _Job(NamedTuple):
    """What `_load` loads: the models, the EOS id, their context, the input's rows and its
    skipped lines."""

    loaded: Any
    eos: int | None
    max_len: int
    rows: list
    errors: list[dict]


def _load(settings, mesh) -> _Job:
    """The models (straight onto `mesh`, if given) and the input of the job's
    `BatchSettings`, checked."""
    from jax_specdec.batch import read_rows
    from jax_specdec.io.chat import load_chat_template

    settings.check_files()
    # a Ray job's driver needs the models' shapes only: its workers read the weights
    loaded = load_pair(
        settings.decode.target,
        settings.draft,
        weights=settings.ray is None,
        dtype=settings.decode.dtype,
        mesh=mesh,
    )
    eos = settings.decode.eos_token_id(loaded)
    max_len = context(loaded.target, loaded.draft if settings.speculative else None)
    settings.decode.check_context(max_len)
    if settings.max_new_tokens >= max_len:
        raise ValueError(
            f"--max-new-tokens {settings.max_new_tokens} leaves no room for a prompt in the "
            f"models' context of {max_len} tokens"
        )
    rows, errors = read_rows(
        settings.input,
        tokenizer=loaded.tokenizer,
        vocab_size=loaded.target.config.vocab_size,
        job_seed=settings.decode.seed,
        sampling=settings.decode.sampling,
        max_new_tokens=settings.max_new_tokens,
        on_error=settings.on_error,
        max_len=max_len,
        chat_template=functools.partial(load_chat_template, loaded.target_dir),
        n=settings.decode.n if settings.decode.n != 1 else None,
        stop=settings.decode.stop,
        logprobs=settings.decode.logprobs,
    )
    return _Job(loaded, eos, max_len, rows, errors)


def _run_job(settings, job: _Job, mesh, stop) -> dict:
    """Runs the job in this process (with `multihost.Hosts` if it is one of several) or
    over Ray; returns its summary."""
    output = pathlib.Path(settings.output)
    shared = dict(job=settings.job(job.eos), max_len=job.max_len, stop=stop)
    shared["logprob_kind"] = settings.decode.logprob_kind
    if settings.ray is not None:
        from jax_specdec.batch.ray import load_worker, run_ray_job

        load = functools.partial(load_worker, settings.for_workers(), job.eos)
        return run_ray_job(job.rows, output, settings, load=load, **shared)
    from jax_specdec.batch import run_job

    hosts = None
    if settings.distributed is not None:
        from jax_specdec.batch.multihost import Hosts

        hosts = Hosts()
    loaded = job.loaded
    return run_job(
        job.rows,
        output,
        generate=settings.make_generate(loaded.target, loaded.draft, job.eos, mesh),
        detokenize=loaded.tokenizer.decode,
        hosts=hosts,
        batch_size=settings.batch_size,
        slots=settings.slots,
        rows_per_call=settings.rows_per_call,
        **shared,
    )


class _Interrupt:
    """Ctrl-C during the job: a flag the job reads between calls (an exception raised
    inside a JAX call can land in a callback whose exceptions Python drops, so the job
    would run on); a second Ctrl-C stops the process at once (the output stays valid,
    as after a kill)."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("stopping after the current call (Ctrl-C again stops now)", file=sys.stderr)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


INTERRUPTED = "interrupted; run the same command again to resume"


def run(args, parser) -> int:
    with _Interrupt() as interrupt:
        return _run(args, parser, interrupt)


def _run(args, parser, interrupt) -> int:
    from jax_specdec.batch import JobError
    from jax_specdec.batch.settings import BatchSettings
    from jax_specdec.settings import parse_mesh

    try:
        settings = BatchSettings.from_args(args)
        if settings.distributed is not None:
            from jax_specdec.batch.multihost import join

            join(settings)
        mesh = parse_mesh(settings.decode.mesh)
        job = _load(settings, mesh)
    except (JobError, ValueError, OSError) as e:
        common.fail(parser, e)
    lead = settings.distributed is None or _process_index() == 0  # writes files and summary
    if job.errors and lead:
        output = pathlib.Path(settings.output)
        errors_path = pathlib.Path(settings.errors or f"{output}.errors.jsonl")
        errors_path.write_text("".join(json.dumps(e) + "\n" for e in job.errors))
        print(f"skipped {len(job.errors)} bad line(s), listed in {errors_path}", file=sys.stderr)
    try:
        summary = _run_job(settings, job, mesh, stop=lambda: interrupt.requested)
    except (JobError, ValueError, OSError) as e:  # OSError: a full disk, say
        common.fail(parser, e)
    if summary.pop("interrupted"):
        print(INTERRUPTED, file=sys.stderr)
        return 130
    summary["bad_lines"] = len(job.errors)
    if lead:
        print(json.dumps(summary, indent=1))
    return 0


def _process_index() -> int:
    import jax

    return jax.process_index()
