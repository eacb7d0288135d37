"""`jax-specdec batch`'s flags, parsed and checked once into a frozen `BatchSettings`: the
decoding flags it shares with `generate` (`jax_specdec.settings.DecodeSettings`) and the job's
own. One process, every process of a multi-host job (whose flags are compared by their
digest) and each Ray worker (which loads the models from them) read the same object."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from jax_specdec.decode.request import INT32_MAX
from jax_specdec.settings import DecodeSettings

__all__ = ["BatchSettings", "Placement"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """This process's place in a `jax.distributed` job, as `multihost.initialize` takes it
    (None: what JAX finds itself)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """A batch job, from the flags.

    Attributes:
      decode: how to decode (draft None with --autoregressive).
      draft: --draft as given; loaded and checked even with --autoregressive.
      input, output, errors: the job's files (errors None: <output>.errors.jsonl).
      on_error: "stop" or "skip" a malformed input line.
      max_new_tokens: the rows' default budget.
      batch_size: rows per fixed batch.
      slots: rows generated at once (None: --fixed-batches).
      rows_per_call: rows per call through the slots (None: `run.CALL_SLOTS` x slots).
      ray: the Ray cluster's address ("" a local one), or None: no Ray.
      ray_workers: Ray actors, each loading the models once.
      ray_resources: one Ray worker's resources, as (name, amount) pairs.
      distributed: this process's place in a multi-host job, or None: one process.
    """

    decode: DecodeSettings
    draft: str
    input: str
    output: str
    errors: str | None
    on_error: str
    max_new_tokens: int
    batch_size: int
    slots: int | None
    rows_per_call: int | None
    ray: str | None = None
    ray_workers: int = 2
    ray_resources: tuple[tuple[str, float], ...] = (("CPU", 1.0),)
    distributed: Placement | None = None

    @classmethod
    def from_args(cls, args) -> BatchSettings:
        """The settings of `jax-specdec batch`'s parsed flags; ValueError naming the flag.
        Files are checked apart (`check_files`), after the processes of a multi-host job
        have met."""
        distributed = _placement(args)
        _check_counts(args)
        decode = DecodeSettings.from_args(args, draft=None if args.autoregressive else args.draft)
        resources = ()
        if args.ray is not None:
            resources = _check_ray(args)
        return cls(
            decode=decode,
            draft=args.draft,
            input=args.input,
            output=args.output,
            errors=args.errors,
            on_error=args.on_error,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            slots=None if args.fixed_batches else args.slots,
            rows_per_call=args.rows_per_call,
            ray=args.ray,
            ray_workers=args.ray_workers,
            ray_resources=resources,
            distributed=distributed,
        )

    @property
    def speculative(self) -> bool:
        return self.decode.draft is not None

    def check_files(self) -> None:
        """--input is a file; --output and --errors can be written."""
        if not pathlib.Path(self.input).is_file():
            raise ValueError(f"--input: {self.input} is not a file")
        _check_writable("--output", pathlib.Path(self.output))
        if self.errors is not None:
            _check_writable("--errors", pathlib.Path(self.errors))

    def job(self, eos: int | None) -> dict:
        """What identifies the job (`output.job_file`): compared on restart."""
        from jax_specdec.batch.output import model_identity

        decode, speculative = self.decode, self.speculative
        rounds = {}  # set only when asked for: jobs written before them still resume
        if speculative and decode.tree is not None:
            tree = decode.tree
            rounds["tree"] = f"{tree.nodes}:{decode.num_draft_tokens}:{tree.branch}"
            if tree.lookup:  # set only when asked for, as above
                rounds["tree"] += f":lookup{tree.lookup}"
        if speculative and decode.acceptance != "token":
            rounds["acceptance"] = decode.acceptance
        if decode.dtype is not None:
            rounds["dtype"] = decode.dtype
        return {
            **rounds,
            "mode": "speculative" if speculative else "autoregressive",
            "target": model_identity(decode.target),
            "draft": model_identity(self.draft) if speculative else None,
            "seed": decode.seed,
            "num_draft_tokens": decode.num_draft_tokens if speculative else None,
            "defaults": {
                "temperature": decode.sampling.temperature,
                "top_k": decode.sampling.top_k,
                "top_p": decode.sampling.top_p,
                # only when set: job files written before they existed still resume
                **_set_only(decode.sampling),
                **_samples_and_stops(decode),
                "max_new_tokens": self.max_new_tokens,
                "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
            },
        }

    def make_generate(self, target, draft, eos: int | None, mesh):
        """The job's `generate` (`run.make_generate` with these settings)."""
        from jax_specdec.batch.run import make_generate

        d = self.decode
        rounds = {}
        if self.speculative and d.draft is not None:
            rounds = dict(num_draft_tokens=d.num_draft_tokens, tree=d.tree, acceptance=d.acceptance)
        return make_generate(
            target,
            draft if self.speculative else None,
            eos_token_id=eos,
            mesh=mesh,
            num_slots=self.slots,
            **rounds,
        )

    def for_workers(self) -> BatchSettings:
        """The settings with the model directories that exist here made absolute (a Ray
        worker's directory is not the driver's)."""

        def absolute(path):
            exists = path is not None and pathlib.Path(path).exists()
            return str(pathlib.Path(path).resolve()) if exists else path

        decode = self.decode
        decode = dataclasses.replace(
            decode, target=absolute(decode.target), draft=absolute(decode.draft)
        )
        return dataclasses.replace(self, decode=decode, draft=absolute(self.draft))


def _gamma_count(value) -> int:
    """--num-draft-tokens as a count to check (auto: within bounds)."""
    from jax_specdec.settings import check_gamma_flag

    gamma = check_gamma_flag(value)
    return 1 if gamma == "auto" else gamma


def _check_counts(args) -> None:
    """The counts and budgets that become int32 in the compiled program."""
    for flag, value in (
        ("--slots", args.slots),
        ("--rows-per-call", 1 if args.rows_per_call is None else args.rows_per_call),
        ("--batch-size", args.batch_size),
        ("--num-draft-tokens", _gamma_count(args.num_draft_tokens)),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if not 1 <= value <= INT32_MAX:
            raise ValueError(f"{flag} must lie in [1, {INT32_MAX}], got {value}")


def _check_ray(args) -> tuple[tuple[str, float], ...]:
    """--ray-workers and --ray-worker-resources (as pairs), and that Ray Data is there."""
    if not 1 <= args.ray_workers <= 1024:
        raise ValueError(f"--ray-workers must lie in [1, 1024], got {args.ray_workers}")
    resources = _resources(args.ray_worker_resources)
    try:
        import ray.data  # noqa: F401
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install -e '.[ray]'") from None
    return tuple(resources.items())


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


def _placement(args) -> Placement | None:
    """This process's place from the flags (None: one process), checked before anything
    starts."""
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
    return Placement(args.coordinator, count, index)


def _check_writable(flag: str, path: pathlib.Path) -> None:
    """A file the job will write: not a directory, in a directory that exists."""
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a directory; give a file in it")
    if not path.parent.is_dir():
        raise ValueError(f"{flag}: the directory {path.parent} does not exist")


def _samples_and_stops(decode: DecodeSettings) -> dict:
    """--n, --stop, --logprobs and --logprob-kind in the job file, where they are set
    (older jobs still resume)."""
    out: dict = {"n": decode.n} if decode.n != 1 else {}
    out |= {"stop": list(decode.stop)} if decode.stop else {}
    if decode.logprobs is None:
        return out
    out["logprobs"] = decode.logprobs
    return out | ({"logprob_kind": "raw"} if decode.logprob_kind == "raw" else {})


def _set_only(sampling) -> dict:
    """The sampling defaults added after the first job files, where they are not off."""
    off = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0}
    off |= {"frequency_penalty": 0.0, "logit_bias": ()}
    out = {k: getattr(sampling, k) for k, v in off.items() if getattr(sampling, k) != v}
    if "logit_bias" in out:
        out["logit_bias"] = {str(t): b for t, b in out["logit_bias"]}
    return out
