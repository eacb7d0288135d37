"""The input of a batch job: one JSON object per line, each checked when the file is read
(fields, ids, seeds, sampling, and that the prompt and its budget fit the models'
context), so a bad row is named by its line and id before anything is compiled or
written. A row without a seed of its own gets one derived from the job seed and its id
(`derive_seed`); its key is the seed's (`decode.request.seed_key_data`).

A row of `n` samples (its field, or the job's `--n`) runs as n rows (`samples`): sample 0
with the row's seed, sample i >= 1 with one derived from that seed and i alone
(`sample_seed`), each known by (id, i) in the output (`result_key`). A row's `stop`
strings (its field, or the job's `--stop`) cut its text on the host (`stop_strings`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

from jax_specdec import stop_strings
from jax_specdec.decode.logprobs import MAX_TOP
from jax_specdec.decode.request import INT32_MAX
from jax_specdec.sampling import SamplingConfig
from jax_specdec.settings import MAX_SAMPLES

__all__ = ["JobError", "JobRow", "derive_seed", "read_rows", "result_key", "sample_seed", "samples"]

_SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)
_PROMPT_FIELDS = ("prompt", "tokens", "messages")
_KNOWN = {
    "id",
    *_PROMPT_FIELDS,
    "seed",
    "max_new_tokens",
    "n",
    "stop",
    "logprobs",
    *_SAMPLING_FIELDS,
}


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
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[tuple[int, ...], ...] = ()  # the stop strings' tokenizations
    logprobs: int | None = None  # alternatives per token in the output; None: no logprobs
    n: int | None = None  # samples of the row; None: one, written without "sample"
    sample: int | None = None  # which sample this row is (`samples`); None: not expanded

    @property
    def key(self) -> str:
        """The id as it is compared: its JSON text (so 1 and "1" are different ids)."""
        return json.dumps(self.id)

    @property
    def result_key(self) -> str:
        """What this row's output line is known by (`result_key`)."""
        return result_key(self.id, self.sample)


def result_key(row_id, sample: int | None = None) -> str:
    """An output line's identity: its id's JSON text, or with a sample `[id, sample]`'s."""
    return json.dumps(row_id if sample is None else [row_id, sample])


def sample_seed(seed: int, sample: int) -> int:
    """The seed of a row's sample: the row's own for sample 0, else 63 bits of the SHA-256
    of the row's seed and the sample's index only (so sample i does not depend on n)."""
    if sample == 0:
        return seed
    digest = hashlib.sha256(f"{seed}\0{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def samples(rows: list[JobRow]) -> list[JobRow]:
    """Each row of n samples as n rows, sample i with `sample_seed(seed, i)`; a row of no
    `n` (or one already expanded) as it is."""
    out = []
    for row in rows:
        if row.n is None or row.sample is not None:
            out.append(row)
            continue
        for i in range(row.n):
            out.append(dataclasses.replace(row, seed=sample_seed(row.seed, i), sample=i))
    return out


def derive_seed(job_seed: int, row_id) -> int:
    """A row's seed from the job seed and its id only (63 bits of SHA-256)."""
    digest = hashlib.sha256(f"{job_seed}\0{json.dumps(row_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _row(obj, line: int, defaults: dict) -> JobRow:
    """One input line as a `JobRow`, or a JobError naming the line."""
    job_seed, sampling = defaults["job_seed"], defaults["sampling"]
    max_new_tokens, max_len = defaults["max_new_tokens"], defaults["max_len"]
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
    tokens = _prompt_tokens(obj, line, defaults)
    seed = obj.get("seed")
    if seed is None:
        seed = derive_seed(job_seed, row_id)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise JobError(f"line {line}: 'seed' must be an integer in [0, 2**63)")
    try:
        overrides = {k: obj[k] for k in _SAMPLING_FIELDS if k in obj}
        row_sampling = dataclasses.replace(sampling, **overrides) if overrides else sampling
    except (ValueError, TypeError) as e:
        raise JobError(f"line {line} (id {json.dumps(row_id)}): {e}") from None
    outside = [t for t, _ in row_sampling.logit_bias if t >= defaults["vocab_size"]]
    if outside:
        raise JobError(
            f"line {line} (id {json.dumps(row_id)}): 'logit_bias' names token ids outside "
            f"[0, {defaults['vocab_size']}): {outside}"
        )
    new = obj.get("max_new_tokens", max_new_tokens)
    if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= INT32_MAX:
        raise JobError(f"line {line}: 'max_new_tokens' must be an integer in [1, {INT32_MAX}]")
    if max_len is not None and len(tokens) + new > max_len:
        raise JobError(
            f"line {line} (id {json.dumps(row_id)}): its prompt of {len(tokens)} tokens and "
            f"max_new_tokens {new} exceed the models' context of {max_len} tokens"
        )
    extra = _output_fields(obj, f"line {line} (id {json.dumps(row_id)})", defaults)
    return JobRow(row_id, line, tokens, seed, row_sampling, new, **extra)


def _output_fields(obj: dict, where: str, defaults: dict) -> dict:
    """The row's `n` (None: one sample, unnamed in the output), `stop` strings (and their
    tokenizations) and `logprobs`, each its own or the job's; a JobError naming the row
    otherwise."""
    n = obj.get("n", defaults["n"])
    if n is not None and (
        isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES
    ):
        raise JobError(f"{where}: 'n' must be an integer in [1, {MAX_SAMPLES}], got {n!r}")
    try:
        stop = stop_strings.check(obj["stop"], "'stop'") if "stop" in obj else defaults["stop"]
    except ValueError as e:
        raise JobError(f"{where}: {e}") from None
    if stop and defaults["tokenizer"] is None:
        raise JobError(f"{where}: 'stop' strings need the target's tokenizer")
    logprobs = obj.get("logprobs", defaults["logprobs"])
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP
    ):
        raise JobError(
            f"{where}: 'logprobs' must be an integer in [0, {MAX_TOP}], got {logprobs!r}"
        )
    stop_tokens = stop_strings.token_sequences(defaults["tokenizer"], stop) if stop else ()
    return dict(n=n, stop=stop, stop_tokens=stop_tokens, logprobs=logprobs)


def _prompt_tokens(obj: dict, line: int, defaults: dict) -> tuple[int, ...]:
    """The row's prompt ids: from its `prompt` text, its `tokens`, or its `messages` in the
    target's chat template; a JobError naming the line otherwise."""
    tokenizer, vocab_size = defaults["tokenizer"], defaults["vocab_size"]
    given = [f for f in _PROMPT_FIELDS if f in obj]
    if len(given) != 1:
        raise JobError(
            f"line {line}: give exactly one of 'prompt' (text), 'tokens' (ids) or 'messages' "
            "(role/content objects)"
        )
    if given != ["tokens"] and tokenizer is None:
        raise JobError(f"line {line}: a text '{given[0]}' needs the target's tokenizer")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise JobError(f"line {line}: 'prompt' must be a non-empty string")
        tokens = tuple(tokenizer.encode(obj["prompt"]).ids)
    elif "messages" in obj:
        tokens = _chat_tokens(obj, line, defaults)
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
        return tuple(tokens)
    if not tokens:
        raise JobError(f"line {line}: '{given[0]}' encodes to no tokens")
    return tokens


def _chat_tokens(obj: dict, line: int, defaults: dict) -> tuple[int, ...]:
    from jax_specdec.io.chat import check_messages, encode_chat

    where = f"line {line} (id {json.dumps(obj['id'])})"
    template = defaults["chat_template"]() if defaults["chat_template"] else None
    if template is None:
        raise JobError(f"{where}: 'messages' needs a chat template; the target has none")
    try:
        check_messages(obj["messages"], "'messages'")
        return tuple(encode_chat(defaults["tokenizer"], template, obj["messages"]))
    except ValueError as e:
        raise JobError(f"{where}: {e}") from None


def read_rows(
    path,
    *,
    tokenizer,
    vocab_size: int,
    job_seed: int,
    sampling: SamplingConfig,
    max_new_tokens: int,
    on_error: str = "stop",
    max_len: int | None = None,
    chat_template=None,
    n: int | None = None,
    stop: tuple[str, ...] = (),
    logprobs: int | None = None,
) -> tuple[list[JobRow], list[dict]]:
    """Parses the input file. Returns (rows, errors); with on_error="stop" the first bad
    line raises a `JobError` naming its line number, with "skip" it is listed in errors.
    `chat_template`: a function returning the target's `io.chat.ChatTemplate` (or None),
    called once, at the first row with `messages`.
    A duplicate id is an error of the later line; so is a row whose prompt and budget do
    not fit in `max_len` tokens (the models' context), when given. `n`, `stop` and
    `logprobs`: the rows' default samples (None: one, without a "sample" in the output),
    stop strings and log-probabilities (None: none). One row per line: `samples` expands
    the rows of several samples."""
    if on_error not in ("stop", "skip"):
        raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    defaults = dict(
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        job_seed=job_seed,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        max_len=max_len,
        n=n,
        stop=tuple(stop),
        logprobs=logprobs,
        chat_template=None if chat_template is None else functools.cache(chat_template),
    )
    rows, errors, seen = [], [], {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1:  # a byte order mark, as some Windows editors write
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            try:
                try:
                    raw.decode("utf-8")
                    obj = json.loads(text)
                except UnicodeDecodeError:
                    raise JobError(f"line {line_no}: not valid UTF-8") from None
                except json.JSONDecodeError as e:
                    raise JobError(f"line {line_no}: not valid JSON ({e.msg})") from None
                row = _row(obj, line_no, defaults)
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
