"""Resumable JSONL generation jobs (`jax-specdec batch`).

Input (`input`): one JSON object per line with an `id` (string or integer, unique) and
one of a `prompt` (text), `tokens` (ids) or `messages` (role/content objects, rendered
by the target's chat template); optionally `seed` (integer >= 0), `temperature`,
`top_k`, `top_p`, `min_p`, `repetition_penalty`, `presence_penalty`,
`frequency_penalty`, `logit_bias` (an object {"id": bias}) and `max_new_tokens`
overriding the job's defaults. Every input line is checked when the file is read,
before anything is compiled or written.

Output (`output`): one JSON object per finished row, `{"id", "seed", "tokens", "text",
"finish_reason", "stats"}` ("eos": it emitted a stop id; "length": its budget),
appended and synced call by call, plus `<output>.job.json` recording what the job is
(models, seed, schedule, defaults, input), written with the first row: a restart with a
different job is refused.

Running (`run`): in one process (`run_job`), over the processes of a `jax.distributed`
run (`multihost`), or over a Ray cluster (`ray`); all three write the same lines for a
row, through the same `output` code. `settings` holds the command's flags, parsed once.
"""

from jax_specdec.batch.input import JobError, JobRow, derive_seed, read_rows
from jax_specdec.batch.output import model_identity
from jax_specdec.batch.run import CALL_SLOTS, make_generate, plan_batches, run_job
from jax_specdec.decode.request import seed_key_data

__all__ = [
    "CALL_SLOTS",
    "JobError",
    "JobRow",
    "derive_seed",
    "make_generate",
    "model_identity",
    "plan_batches",
    "read_rows",
    "run_job",
    "seed_key_data",
]
