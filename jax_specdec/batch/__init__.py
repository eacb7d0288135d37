"""Resumable JSONL generation jobs (`jax-specdec batch`).

Input (`input`): one JSON object per line with an `id` (string or integer, unique) and
one of a `prompt` (text), `tokens` (ids) or `messages` (role/content objects, rendered
by the target's chat template); optionally `seed` (integer >= 0), `temperature`,
`top_k`, `top_p`, `min_p`, `repetition_penalty`, `presence_penalty`,
`frequency_penalty`, `logit_bias` (an object {"id": bias}), `max_new_tokens`, `n`
(samples, an integer >= 1), `stop` (a string or a list of strings) and `logprobs` (an
integer in [0, 20]) overriding the job's defaults (`--n`, `--stop`, `--logprobs`).
Every input line is checked when the file is read, before anything is compiled or
written.

A row of `n` samples runs as n rows in the same calls and programs as the others:
sample 0 with the row's seed, sample i >= 1 with a seed derived from that seed and i
alone (`input.sample_seed`), so sample i does not depend on n or on the batch. A row's
stop strings end it inside the program when it emits one's own tokenization, and cut
its text on the host, at the earliest one found (`jax_specdec.stop_strings`): the text
before it, the tokens up to the shortest prefix whose text holds it, finish reason
"stop". Every call runs under the job's one `call.JobPlan` (sampling plan, stop
sequences' shape, log-probabilities recorded), so the job is one program per shape.

Output (`output`): one JSON object per finished row (per sample),
`{"id", ["sample",] "seed", "tokens", "text", "finish_reason", ["stop",] ["logprobs",]
"stats"}`
("eos": it emitted a stop id; "length": its budget; "stop": a stop string cut it, named
in "stop"; "sample" only in the lines of a row given an `n` or of a job of `--n` above
1; "seed" the sample's; "logprobs" for rows asking for them, an entry {"logprob", "top"}
per token; "stats" count what the program generated, before any cut),
appended and synced call by call, plus `<output>.job.json` recording what the job is
(models, seed, schedule, defaults, with `--n`, `--stop` and `--logprobs` where set),
written with the first row: a restart with a different job is refused. A restart runs only the lines
(id, sample) not yet in the output.

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
