"""One call of a batch job: its rows in, one program run, their output lines out.

Every call of a job runs under the job's one `JobPlan` (computed from all its rows, so a
restart compiles the same program): the rows' `SamplingPlan`, the shape of their stop
sequences (each row's stop strings tokenized, `stop_strings.token_sequences`, padded to
the job's most and longest) and the log-probabilities recorded (the most alternatives
any row asks for). A row that asked for no log-probabilities gets none in its line, and
a row asking for N alternatives gets its N most likely.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from jax_specdec import stop_strings
from jax_specdec.batch.input import JobError, JobRow
from jax_specdec.decode.logprobs import LogprobSpec, entries
from jax_specdec.decode.request import seed_key_data
from jax_specdec.decode.stats import finish_reasons
from jax_specdec.decode.stop_tokens import stop_array
from jax_specdec.sampling import RowSampling, SamplingPlan

__all__ = ["JobPlan", "run_call"]


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What every call of a job shares, so that they run one program.

    Attributes:
      sampling: the rows' `SamplingPlan`.
      stops: (sequences per row, tokens per sequence) of the rows' stop sequences, or
        None: no row has any.
      logprobs: what the program records (`decode.logprobs.LogprobSpec`), or None: no
        row asks.
    """

    sampling: SamplingPlan
    stops: tuple[int, int] | None = None
    logprobs: LogprobSpec | None = None

    @classmethod
    def of(cls, rows: list[JobRow], logprob_kind: str = "processed") -> JobPlan:
        stops = [r.stop_tokens for r in rows if r.stop_tokens]
        shape = None
        if stops:
            shape = (max(map(len, stops)), max(len(s) for row in stops for s in row))
        asked = [r.logprobs for r in rows if r.logprobs is not None]
        spec = LogprobSpec(max(asked), logprob_kind) if asked else None
        return cls(SamplingPlan.of([r.sampling for r in rows]), shape, spec)

    def rows(self, batch: list[JobRow]) -> RowSampling:
        """The call's rows' sampling, with their stop sequences where the job has any
        (`decode.stop_tokens.stop_array`, in the job's one shape)."""
        sampling = RowSampling.of([r.sampling for r in batch], self.sampling)
        if self.stops is None:
            return sampling
        rows = [row.stop_tokens for row in batch]
        return sampling.with_stops(stop_array(rows, np.iinfo(np.int32).max, self.stops))


def run_call(batch: list[JobRow], generate, detokenize, plan: JobPlan) -> tuple[list[dict], int]:
    """One call of `generate` (under the job's `JobPlan`): an output record per row, and
    the call's slot-rounds."""
    import jax

    keys = jax.random.wrap_key_data(np.stack([seed_key_data(r.seed) for r in batch]))
    budgets = [r.max_new_tokens for r in batch]
    args = ([list(r.tokens) for r in batch], keys, plan.rows(batch), budgets)
    with warnings.catch_warnings():  # checked below, for the rows' ids
        warnings.filterwarnings("ignore", "NaN/inf logits", RuntimeWarning)
        out = generate(*args, plan.logprobs) if plan.logprobs else generate(*args)
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
    stop_ids = getattr(generate, "stop_ids", ())
    reasons = finish_reasons(out, budgets, stop_ids, [r.stop_tokens for r in batch])
    logprobs = getattr(out, "logprobs", None)
    logprobs = None if logprobs is None else jax.tree.map(np.asarray, logprobs)
    records = []
    for b, row in enumerate(batch):
        stats = {"generated": int(lengths[b]), **{k: int(v[b]) for k, v in counters.items()}}
        ids = tokens[b, : lengths[b]].tolist()
        line = _record(row, ids, reasons[b], detokenize)
        if row.logprobs is not None:
            line["logprobs"] = entries(logprobs, b, len(line["tokens"]), row.logprobs)
        records.append({**line, "stats": stats})
    return records, int(out.stats.slot_rounds)


def _record(row: JobRow, ids: list[int], reason: str, detokenize) -> dict:
    """A row's output line without its stats: its id (and sample), seed, tokens and text
    (cut at its earliest stop string, `stop_strings.apply`: the text before it, the
    tokens up to the shortest prefix whose text holds it, and the stop string), finish
    reason."""
    text = None if detokenize is None else detokenize(ids)
    which = None
    if row.stop and text is not None:
        ids, text, reason, which = stop_strings.apply(ids, text, reason, row.stop, detokenize)
    sample = {} if row.sample is None else {"sample": row.sample}
    line = {"id": row.id, **sample, "seed": row.seed, "tokens": ids, "text": text}
    line["finish_reason"] = reason
    if which is not None:
        line["stop"] = which
    return line
