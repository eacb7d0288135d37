"""Resumable JSONL generation jobs (`jax-specdec batch`).

Input: one JSON object per line with an `id` (string or integer, unique) and either a
`prompt` (text) or `tokens` (ids); optionally `seed` (integer >= 0), `temperature`,
`top_k`, `top_p` and `max_new_tokens` overriding the job's defaults.

Output: one JSON object per finished row, `{"id", "seed", "tokens", "text", "stats"}`,
appended and flushed call by call, plus `<output>.job.json` recording what the job
is (models, seed, schedule, defaults, input): a restart with a different job is refused.

Reproducibility: row r is generated with the key of seed_r (`seed_key_data`), where
seed_r is the row's own `seed` or one derived from the job seed and the row's id alone
(63 bits of SHA-256, so a million rows do not share a seed). Rows are grouped by their
sampling settings and sorted by prompt length (then input line). With slots (the
default) a group runs in calls of up to `rows_per_call` rows (CALL_SLOTS x slots
unless given), each call feeding
its rows through the slots (a finished row's slot takes the next row inside the
program; rows of any budget share a call). With fixed batches, groups are also split
by max_new_tokens and cut into batches of `batch_size`, each running until its
slowest row is done. The plan covers all rows, and a restart runs the same plan minus
the finished ids. A row's tokens depend on its seed and prompt only (the loop keeps
rows independent), so the output does not depend on slots, batch size, bucketing,
order or restarts; an interrupted and restarted job writes the same lines in the
same order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Iterable

import numpy as np

from jax_specdec.sampling import SamplingConfig

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

_SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
# With slots, one call runs up to CALL_SLOTS x slots rows: a killed job redoes at most
# one call, and a call's last rows leave slots idle only at its end.
CALL_SLOTS = 16
_KNOWN = {"id", "prompt", "tokens", "seed", "max_new_tokens", *_SAMPLING_FIELDS}


class JobError(ValueError):
    """Bad job input or an output file that does not belong to this job."""


@dataclasses.dataclass(frozen=True)
class JobRow:
    id: str | int
    line: int
    tokens: tuple[int, ...]
    seed: int
    sampling: SamplingConfig
    max_new_tokens: int

    @property
    def key(self) -> str:
        """The id as it is compared: its JSON text (so 1 and "1" are different ids)."""
        return json.dumps(self.id)


def seed_key_data(seed: int) -> np.ndarray:
    """The threefry key of a 63-bit seed: [seed >> 32, seed & 0xffffffff], which is
    `jax.random.key(seed)` for seeds below 2**32 (JAX without x64 keeps only the low
    32 bits of larger ones)."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def derive_seed(job_seed: int, row_id) -> int:
    """A row's seed from the job seed and its id only (63 bits of SHA-256)."""
    digest = hashlib.sha256(f"{job_seed}\0{json.dumps(row_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _row(obj, line: int, tokenizer, vocab_size, job_seed, sampling, max_new_tokens) -> JobRow:
    if not isinstance(obj, dict):
        raise JobError(f"line {line}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KNOWN)
    if unknown:
        raise JobError(f"line {line}: unknown field(s) {unknown}; known: {sorted(_KNOWN)}")
    if "id" not in obj:
        raise JobError(f"line {line}: missing 'id'")
    row_id = obj["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or row_id == "":
        raise JobError(f"line {line}: 'id' must be a non-empty string or an integer")
    if ("prompt" in obj) == ("tokens" in obj):
        raise JobError(f"line {line}: give exactly one of 'prompt' (text) or 'tokens' (ids)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise JobError(f"line {line}: 'prompt' must be a non-empty string")
        if tokenizer is None:
            raise JobError(f"line {line}: a text 'prompt' needs the target's tokenizer")
        tokens = tuple(tokenizer.encode(obj["prompt"]).ids)
        if not tokens:
            raise JobError(f"line {line}: 'prompt' encodes to no tokens")
    else:
        tokens = obj["tokens"]
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        ):
            raise JobError(f"line {line}: 'tokens' must be a non-empty list of integers")
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            raise JobError(f"line {line}: 'tokens' must lie in [0, {vocab_size})")
        tokens = tuple(tokens)
    seed = obj.get("seed")
    if seed is None:
        seed = derive_seed(job_seed, row_id)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise JobError(f"line {line}: 'seed' must be an integer in [0, 2**63)")
    try:
        overrides = {k: obj[k] for k in _SAMPLING_FIELDS if k in obj}
        row_sampling = dataclasses.replace(sampling, **overrides) if overrides else sampling
    except (ValueError, TypeError) as e:
        raise JobError(f"line {line}: {e}") from None
    new = obj.get("max_new_tokens", max_new_tokens)
    if isinstance(new, bool) or not isinstance(new, int) or new < 1:
        raise JobError(f"line {line}: 'max_new_tokens' must be an integer >= 1")
    return JobRow(row_id, line, tokens, seed, row_sampling, new)


def read_rows(
    path,
    *,
    tokenizer,
    vocab_size: int,
    job_seed: int,
    sampling: SamplingConfig,
    max_new_tokens: int,
    on_error: str = "stop",
) -> tuple[list[JobRow], list[dict]]:
    """Parses the input file. Returns (rows, errors); with on_error="stop" the first bad
    line raises a `JobError` naming its line number, with "skip" it is listed in errors.
    A duplicate id is an error of the later line."""
    if on_error not in ("stop", "skip"):
        raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    rows, errors, seen = [], [], {}
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise JobError(f"line {line_no}: not valid JSON ({e.msg})") from None
                row = _row(obj, line_no, tokenizer, vocab_size, job_seed, sampling, max_new_tokens)
                if row.key in seen:
                    raise JobError(
                        f"line {line_no}: duplicate id {row.key} (first on line {seen[row.key]})"
                    )
                seen[row.key] = line_no
                rows.append(row)
            except JobError as e:
                if on_error == "stop":
                    raise
                errors.append({"line": line_no, "error": str(e), "text": text.rstrip("\n")})
    if not rows and not errors:
        raise JobError(f"{path} holds no rows")
    return rows, errors


def plan_batches(
    rows: Iterable[JobRow], batch_size: int, *, by_budget: bool = True
) -> list[list[JobRow]]:
    """Rows grouped by sampling (and max_new_tokens if `by_budget`), sorted by prompt
    length (then input line), cut into calls of at most batch_size rows.
    Deterministic for a set of rows."""
    groups: dict = {}
    for row in rows:
        groups.setdefault((row.sampling, row.max_new_tokens if by_budget else 0), []).append(row)
    plan = []
    for key in sorted(groups, key=lambda k: (dataclasses.astuple(k[0]), k[1])):
        ordered = sorted(groups[key], key=lambda r: (len(r.tokens), r.line))
        plan += [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    return plan


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


def _check_job(output: pathlib.Path, job: dict) -> None:
    """Writes <output>.job.json, or checks that an existing one describes this job."""
    meta = output.with_name(output.name + ".job.json")
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
    else:
        meta.write_text(json.dumps(job, indent=1) + "\n")


def make_generate(
    target, draft, *, eos_token_id, num_draft_tokens: int = 4, mesh=None, num_slots=None
):
    """The `generate` of `run_job`: speculative decoding with `draft`, or autoregressive
    decoding of `target` when draft is None; through `num_slots` slots if given (at most
    one per row); on `mesh` if given (a fixed batch is padded to a multiple of its data
    axis, a call on slots to at least one row per data shard, with copies of its last
    row whose outputs are dropped; slots are then a multiple of the data axis)."""
    import jax

    from jax_specdec.decode import autoregressive_generate, speculative_generate

    data = 1 if mesh is None else mesh.shape["data"]

    def generate(prompts, keys, sampling, max_new_tokens):
        rows = len(prompts)
        extra = -rows % data if num_slots is None else max(data - rows, 0)
        prompts = prompts + [prompts[-1]] * extra
        keys = keys[np.minimum(np.arange(rows + extra), rows - 1)]
        max_new_tokens = list(max_new_tokens) + [max_new_tokens[-1]] * extra
        slots = None
        if num_slots is not None:
            slots = max(min(num_slots, len(prompts)) // data * data, data)
        common = dict(
            key=keys,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=eos_token_id,
            mesh=mesh,
            num_slots=slots,
        )
        if draft is None:
            out = autoregressive_generate(target, prompts, **common)
        else:
            out = speculative_generate(
                target, draft, prompts, num_draft_tokens=num_draft_tokens, **common
            )
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
) -> dict:
    """Runs the rows not yet in `output`, appending one line per row, call by call.

    Args:
      rows: from `read_rows`.
      output: the results file (created, or resumed).
      generate: fn(prompts: list[list[int]], keys, sampling, max_new_tokens: [int]) ->
        GenerationOutput for one call (speculative or autoregressive).
      job: what identifies the job (models, seed, schedule, defaults); stored beside
        the output and compared on restart.
      batch_size: rows per fixed batch (when `slots` is None).
      slots: the slots `generate` runs its rows through: calls of up to
        `rows_per_call` (default CALL_SLOTS x slots) rows of one sampling group,
        whatever their budgets.
      detokenize: fn(ids) -> text, or None.

    Returns a summary (rows, tokens, seconds, tokens/s, rows/s, α, tokens per round,
    occupancy).
    """
    from tqdm.auto import tqdm

    output = pathlib.Path(output)
    _check_job(output, job)
    done = _finished_ids(output)
    unknown = done - {r.key for r in rows}
    if unknown:
        raise JobError(
            f"{output} holds {len(unknown)} id(s) that are not in the input, e.g. "
            f"{sorted(unknown)[0]}: it belongs to a different job"
        )
    pending = [r for r in rows if r.key not in done]
    plan = _plan(pending, batch_size, slots, rows_per_call)
    counters = ("rows", "tokens", "accepted", "rejected", "rounds", "drafted", "slot_rounds")
    totals = dict.fromkeys(counters, 0)
    start = time.perf_counter()
    bar = tqdm(total=sum(map(len, plan)), desc="batch", unit="row", disable=not progress)
    with open(output, "a", encoding="utf-8") as f:
        for batch in plan:
            results, slot_rounds = _run_batch(batch, generate, detokenize)
            totals["slot_rounds"] += slot_rounds
            # Appended and synced call by call: a killed job loses at most this call.
            f.write("".join(json.dumps(r) + "\n" for r in results))
            f.flush()
            os.fsync(f.fileno())
            _add_up(totals, results)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{totals['tokens'] / (time.perf_counter() - start):.0f}")
    bar.close()
    return _summary(totals, len(done), time.perf_counter() - start)


def _plan(pending, batch_size: int, slots, rows_per_call) -> list[list[JobRow]]:
    """Fixed batches (slots None), or calls of a sampling group through slots."""
    if slots is None:
        return plan_batches(pending, batch_size)
    return plan_batches(pending, rows_per_call or CALL_SLOTS * slots, by_budget=False)


def _add_up(totals: dict, results: list[dict]) -> None:
    totals["rows"] += len(results)
    for r in results:
        totals["tokens"] += r["stats"]["generated"]
        for k in ("rounds", "drafted", "accepted", "rejected"):
            totals[k] += r["stats"][k]


def _run_batch(batch: list[JobRow], generate, detokenize) -> tuple[list[dict], int]:
    """One call of `generate`: an output record per row, and the call's slot-rounds."""
    import jax

    keys = jax.random.wrap_key_data(np.stack([seed_key_data(r.seed) for r in batch]))
    budgets = [r.max_new_tokens for r in batch]
    out = generate([list(r.tokens) for r in batch], keys, batch[0].sampling, budgets)
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
