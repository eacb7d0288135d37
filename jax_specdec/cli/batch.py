"""`jax-specdec batch`: a resumable JSONL generation job (one result line per input row)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import signal
import sys

from jax_specdec.cli import common


def add_parser(sub) -> None:
    job = sub.add_parser(
        "batch",
        help="a resumable JSONL generation job (one result line per input row)",
        description="Input lines: {id, prompt | tokens, [seed, temperature, top_k, top_p, "
        "max_new_tokens]}. Output lines: {id, seed, tokens, text, stats}. A restarted job "
        "skips finished ids; a row depends only on the job seed and its id (or its seed).",
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
    job.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    common.add_round_flags(job)
    job.add_argument("--max-new-tokens", type=int, default=128)
    common.add_sampling_flags(job)
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
    job.add_argument(
        "--mesh",
        help="DATAxMODEL, e.g. 4x2: rows over data, weights over model (all devices; with "
        "--distributed, all processes' devices)",
    )
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
    job.set_defaults(handler=run, parser=job)


def _distributed(args) -> dict | None:
    """jax.distributed.initialize's arguments from the flags (None: one process), checked
    before anything starts."""
    count, index = args.num_processes, args.process_id
    if not args.distributed and args.coordinator is None and count is None and index is None:
        return None
    if args.ray is not None:
        raise ValueError("--ray and --distributed (or --coordinator) exclude each other")
    if args.mesh is None:
        raise ValueError("--distributed needs --mesh DATAxMODEL over all processes' devices")
    if args.coordinator is not None:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
        if count is None or index is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
    for flag, value in (("--num-processes", count), ("--process-id", index)):
        if value is not None and args.coordinator is None:
            if not os.environ.get("JAX_COORDINATOR_ADDRESS"):
                raise ValueError(
                    f"{flag} needs --coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS)"
                )
    if (count is None) != (index is None):
        raise ValueError("--num-processes and --process-id go together")
    if count is not None:
        if count < 1:
            raise ValueError(f"--num-processes must be at least 1, got {count}")
        if not 0 <= index < count:
            raise ValueError(
                f"--process-id must lie in [0, {count}) (--num-processes {count}), got {index}"
            )
    return {"coordinator": args.coordinator, "num_processes": count, "process_id": index}


def _resources(text: str) -> dict:
    """--ray-worker-resources as {"CPU": 1.0, "TPU": 4.0, ...}."""
    resources = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            resources[name.strip()] = float(value)
        except ValueError:
            resources[name.strip()] = -1.0
        if not name.strip() or resources[name.strip()] < 0:
            raise ValueError(f"--ray-worker-resources must be NAME=N[,NAME=N], got {text!r}")
    return resources


def _load(args):
    """(target, draft, tokenizer, eos, rows, errors), every flag checked."""
    from jax_specdec.batch import read_rows
    from jax_specdec.decode.request import INT32_MAX

    for flag, value in (
        ("--slots", args.slots),
        ("--rows-per-call", 1 if args.rows_per_call is None else args.rows_per_call),
        ("--batch-size", args.batch_size),
        ("--num-draft-tokens", args.num_draft_tokens),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if not 1 <= value <= INT32_MAX:
            raise ValueError(f"{flag} must lie in [1, {INT32_MAX}], got {value}")
    common.check_seed(args.seed)
    if args.ray is not None:
        if not 1 <= args.ray_workers <= 1024:
            raise ValueError(f"--ray-workers must lie in [1, 1024], got {args.ray_workers}")
        _resources(args.ray_worker_resources)
        try:
            import ray.data  # noqa: F401
        except ImportError:
            raise ValueError("--ray needs Ray Data: pip install -e '.[ray]'") from None
    sampling = common.sampling(args)
    common.tree(args, args.num_draft_tokens)
    common.acceptance(args)
    if not pathlib.Path(args.input).is_file():
        raise ValueError(f"--input: {args.input} is not a file")
    _check_writable("--output", pathlib.Path(args.output))
    if args.errors is not None:
        _check_writable("--errors", pathlib.Path(args.errors))
    # a Ray job's driver needs the models' shapes only: its workers read the weights
    loaded = common.load_pair(args.target, args.draft, weights=args.ray is None)
    target, draft, tokenizer = loaded.target, loaded.draft, loaded.tokenizer
    eos = common.eos(args.eos, loaded)
    max_len = common.context(target, None if args.autoregressive else draft)
    if not args.autoregressive:
        common.check_draft_length(args.num_draft_tokens, max_len)
    if args.max_new_tokens >= max_len:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
            f"models' context of {max_len} tokens"
        )
    rows, errors = read_rows(
        args.input,
        tokenizer=tokenizer,
        vocab_size=target.config.vocab_size,
        job_seed=args.seed,
        sampling=sampling,
        max_new_tokens=args.max_new_tokens,
        on_error=args.on_error,
        max_len=max_len,
    )
    return target, draft, tokenizer, eos, rows, errors


def _check_writable(flag: str, path: pathlib.Path) -> None:
    """A file the job will write: not a directory, in a directory that exists."""
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a directory; give a file in it")
    if not path.parent.is_dir():
        raise ValueError(f"{flag}: the directory {path.parent} does not exist")


def _mesh(text: str | None):
    import jax

    if text is None:
        return None
    try:
        data, model = (int(x) for x in text.lower().split("x"))
        if data < 1 or model < 1:
            raise ValueError("each axis needs at least one device")
        return jax.make_mesh((data, model), ("data", "model"))
    except ValueError as e:
        raise ValueError(
            f"--mesh must be DATAxMODEL with {jax.device_count()} devices in all, "
            f"got {text!r} ({e})"
        ) from None


def _job(args, eos) -> dict:
    """What identifies the job: compared on restart."""
    from jax_specdec.batch import model_identity

    sampling = common.sampling(args)
    speculative = not args.autoregressive
    rounds = {}  # set only when asked for: jobs written before them still resume
    if speculative and args.tree is not None:
        rounds["tree"] = f"{args.tree}:{args.num_draft_tokens}:{args.branch}"
    if speculative and args.acceptance != "token":
        rounds["acceptance"] = args.acceptance
    return {
        **rounds,
        "mode": "speculative" if speculative else "autoregressive",
        "target": model_identity(args.target),
        "draft": model_identity(args.draft) if speculative else None,
        "seed": args.seed,
        "num_draft_tokens": args.num_draft_tokens if speculative else None,
        "defaults": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "max_new_tokens": args.max_new_tokens,
            "eos_token_id": eos,
        },
    }


def _generate(args, target, draft, eos, mesh):
    """The job's `generate` (`make_generate` with the flags)."""
    from jax_specdec.batch import make_generate

    return make_generate(
        target,
        None if args.autoregressive else draft,
        eos_token_id=eos,
        num_draft_tokens=args.num_draft_tokens,
        mesh=mesh,
        num_slots=None if args.fixed_batches else args.slots,
        tree=common.tree(args, args.num_draft_tokens),
        acceptance=common.acceptance(args),
    )


def load_worker(settings: dict, eos):
    """In a Ray worker: loads the models from the job's paths, once; returns (generate,
    detokenize) for `run_ray_job`."""
    args = argparse.Namespace(**settings)
    loaded = common.load_pair(args.target, args.draft)
    generate = _generate(args, loaded.target, loaded.draft, eos, _mesh(args.mesh))
    return generate, loaded.tokenizer.decode


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
    from jax_specdec.batch import JobError, run_job

    try:
        distributed = _distributed(args)
        if distributed is not None:
            _join(args, distributed)
        target, draft, tokenizer, eos, rows, errors = _load(args)
        mesh = _mesh(args.mesh)
    except (JobError, ValueError, OSError) as e:
        common.fail(parser, e)
    output = pathlib.Path(args.output)
    lead = distributed is None or _process_index() == 0  # writes the files and the summary
    if errors and lead:
        errors_path = pathlib.Path(args.errors or f"{output}.errors.jsonl")
        errors_path.write_text("".join(json.dumps(e) + "\n" for e in errors))
        print(f"skipped {len(errors)} bad line(s), listed in {errors_path}", file=sys.stderr)
    shared = dict(
        job=_job(args, eos),
        batch_size=args.batch_size,
        slots=None if args.fixed_batches else args.slots,
        rows_per_call=args.rows_per_call,
        max_len=common.context(target, None if args.autoregressive else draft),
        stop=lambda: interrupt.requested,
    )
    try:
        if args.ray is None:
            from jax_specdec.batch_multihost import Hosts

            generate = _generate(args, target, draft, eos, mesh)
            hosts = None if distributed is None else Hosts()
            detokenize = tokenizer.decode
            summary = run_job(
                rows, output, generate=generate, detokenize=detokenize, hosts=hosts, **shared
            )
        else:
            from jax_specdec.batch_ray import run_ray_job

            settings = {k: v for k, v in vars(args).items() if k not in ("handler", "parser")}
            for flag in ("target", "draft"):  # a worker's directory is not the driver's
                if pathlib.Path(settings[flag]).exists():
                    settings[flag] = str(pathlib.Path(settings[flag]).resolve())
            summary = run_ray_job(
                rows,
                output,
                load=functools.partial(load_worker, settings, eos),
                address=args.ray or None,
                workers=args.ray_workers,
                resources=_resources(args.ray_worker_resources),
                **shared,
            )
    except (JobError, ValueError, OSError) as e:  # OSError: a full disk, say
        common.fail(parser, e)
    if summary.pop("interrupted"):
        print(INTERRUPTED, file=sys.stderr)
        return 130
    summary["bad_lines"] = len(errors)
    if lead:
        print(json.dumps(summary, indent=1))
    return 0


def _process_index() -> int:
    import jax

    return jax.process_index()


def _join(args, distributed: dict) -> None:
    """Joins the jax.distributed job, then checks that every process runs the same
    command on the same input and model files (before anything is loaded or compiled)."""
    import hashlib

    from jax_specdec.batch import model_identity
    from jax_specdec.batch_multihost import check_same, digest, flags_digest, initialize

    initialize(**distributed)
    place = ("handler", "parser", "coordinator", "num_processes", "process_id")
    settings = {k: v for k, v in vars(args).items() if k not in place}
    models = json.dumps([model_identity(args.target), model_identity(args.draft)])
    check_same(
        {
            f"--input {args.input}": digest(args.input),
            "the model files (--target, --draft)": hashlib.sha256(models.encode()).digest(),
            "the command's flags": flags_digest(settings),
        }
    )
