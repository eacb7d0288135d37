"""The compiled generation loops: `speculative_generate` and `autoregressive_generate`.

Each call is one XLA program: prefill of the model(s), then a `lax.while_loop` over
rounds; a speculative round is a `lax.scan` over draft steps, one target verify of
γ+1 tokens and the acceptance step, for every row of a ragged batch at once.

Conventions inside the loop (DESIGN.md §4):
- `tokens` [B, L] holds each row's prompt followed by its generated tokens;
  `lengths` [B] counts them. The last one (the *pending* token) has been run through
  neither model yet.
- Cache lengths are derived from `lengths` at the start of every phase: the target's
  cache holds `lengths - 1` positions; the draft's is set to `lengths - 2` and fed the
  last two tokens, which re-writes an identical entry when only one is new. So a fully
  accepted round (whose last draft the draft never saw) has the same static shapes as
  any other, and a rejection is rolled back by the length alone, never by copying.
- Row b's randomness: round r uses fold_in(key_b, r) (r = 0 is the prefill's first
  token), split into draft and acceptance keys. A row's tokens depend only on its key
  and prompt, never on its batch neighbours.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jax_specdec.acceptance import accept
from jax_specdec.nn import KVCache, Transformer, init_cache
from jax_specdec.sampling import SamplingConfig, probs_from_logits, sample

__all__ = [
    "GenerationOutput",
    "GenerationStats",
    "autoregressive_generate",
    "autoregressive_program",
    "speculative_generate",
    "speculative_program",
]


@struct.dataclass
class GenerationStats:
    """Per-row counters of one generation call (arrays on device).

    Attributes:
      rounds: [B] rounds (target calls after the prefill) in which the row was active.
      target_calls: [] target forward calls of the whole batch, prefill included.
      drafted: [B] drafted tokens.
      accepted: [B] drafted tokens accepted.
      accepted_at: [B, γ] rounds in which draft position i (0-based) was accepted; the
        acceptance rate at position i is accepted_at[:, i] / rounds. Empty for
        autoregressive decoding.
      nonfinite: [B] whether the row ever met a NaN/inf logit (its tokens are then not
        to be trusted; a warning is raised too).
    """

    rounds: jax.Array
    target_calls: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    accepted_at: jax.Array
    nonfinite: jax.Array

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted, over the whole batch.

        It falls with γ even at a constant per-token acceptance, since drafts after a
        rejection count as drafted; `alpha` does not.
        """
        return float(jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.drafted), 1))

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability α (the i.i.d. model of DESIGN §2), estimated as
        accepted / (accepted + rejections): each round tests drafts up to its first
        rejection, if any (the maximum-likelihood estimate for geometric run lengths).
        """
        gamma = self.accepted_at.shape[1]
        if gamma == 0:
            return float("nan")
        rejections = jnp.sum(self.rounds - self.accepted_at[:, gamma - 1])
        accepted = jnp.sum(self.accepted)
        return float(accepted / jnp.maximum(accepted + rejections, 1))

    def tokens_per_round(self, lengths: jax.Array) -> float:
        """Mean tokens emitted per round (the prefill's first token not counted)."""
        return float(jnp.sum(lengths - 1) / jnp.maximum(jnp.sum(self.rounds), 1))


class GenerationOutput(NamedTuple):
    """What a generation call returns.

    Attributes:
      tokens: [B, max_new_tokens] int32 generated tokens, `pad_token_id` after each
        row's end.
      lengths: [B] int32 generated tokens per row (max_new_tokens unless the row hit EOS,
        which is included).
      stats: `GenerationStats`.
    """

    tokens: jax.Array
    lengths: jax.Array
    stats: GenerationStats


@struct.dataclass
class _LoopState:
    tokens: jax.Array  # [B, L] prompt + generated
    lengths: jax.Array  # [B] valid tokens per row, the last one pending
    target_cache: KVCache
    draft_cache: KVCache | None
    done: jax.Array  # [B] bool
    round: jax.Array  # [] int32, rounds run so far
    stats: GenerationStats


# ---------------------------------------------------------------------- validation


def _prepare_prompts(prompts, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host-side: prompts as a right-padded int32 [B, P] array and lengths [B]."""
    if isinstance(prompts, (jax.Array, np.ndarray)):
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise ValueError(f"prompts array must be [B, P], got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"prompts must hold integer token ids, got dtype {array.dtype}")
        if prompt_lengths is None:
            lengths = np.full(array.shape[0], array.shape[1], np.int64)
        else:
            lengths = np.asarray(prompt_lengths)
            if lengths.shape != (array.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
                raise ValueError(
                    f"prompt_lengths must be [B] = [{array.shape[0]}] integers, "
                    f"got {lengths.dtype} {lengths.shape}"
                )
            if np.any(lengths > array.shape[1]):
                raise ValueError(f"prompt_lengths exceed the prompts' width {array.shape[1]}")
        rows = [array[b, : lengths[b]] for b in range(array.shape[0])]
    else:
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for an array of prompts, not a list")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of token-id lists or an int array [B, P]")
        rows = []
        for b, row in enumerate(prompts):
            arr = np.asarray(row)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise TypeError(f"prompts[{b}] must be a flat list of integer token ids")
            rows.append(arr)
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    for b, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompts[{b}] is empty: every prompt needs at least one token")
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(
                f"prompts[{b}] has token ids outside [0, {vocab_size}): "
                f"min {int(row.min())}, max {int(row.max())}"
            )
    lengths = np.array([row.size for row in rows], np.int32)
    padded = np.zeros((len(rows), int(lengths.max())), np.int32)
    for b, row in enumerate(rows):
        padded[b, : row.size] = row
    return padded, lengths


def _row_keys(key, batch: int) -> jax.Array:
    if not isinstance(key, jax.Array):
        raise TypeError("key must be a jax.random.key(...) or an array of B keys")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape == ():
            return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
        if key.shape == (batch,):
            return key
    elif key.dtype == jnp.uint32 and key.shape == (2,):
        return _row_keys(jax.random.wrap_key_data(key), batch)
    elif key.dtype == jnp.uint32 and key.shape == (batch, 2):
        return jax.random.wrap_key_data(key)
    raise ValueError(
        f"key must be one key (shape []) or one key per row (shape [{batch}]), "
        f"got dtype {key.dtype} shape {key.shape}"
    )


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_common(model, name, prompts, prompt_lengths, key, max_new_tokens, sampling, eos):
    if not isinstance(model, Transformer):
        raise TypeError(f"{name} must be a jax_specdec.nn.Transformer, got {type(model).__name__}")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    vocab = model.config.vocab_size
    if eos is not None and not (0 <= _check_int("eos_token_id", eos, 0) < vocab):
        raise ValueError(f"eos_token_id must lie in [0, {vocab}), got {eos}")
    prompts, lengths = _prepare_prompts(prompts, prompt_lengths, vocab)
    keys = _row_keys(key, prompts.shape[0])
    return prompts, lengths, keys, max_new_tokens


def _check_fits(model, name, lengths, max_new_tokens):
    limit = model.config.max_len
    longest = int(lengths.max())
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt length ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"{name} model's maximum length config.max_len={limit}"
        )


# ---------------------------------------------------------------- loop pieces


def _nonfinite(logits):
    return ~jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


def _prefill(model, cache, prompts, prompt_lengths):
    """Runs the prompts through the model; returns logits at each row's last prompt token."""
    logits, cache = model.decode(prompts, cache)
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, cache.replace(lengths=prompt_lengths)


def _gather_last(tokens, lengths, count):
    """tokens[b, lengths[b] - count : lengths[b]] -> [B, count]."""
    idx = lengths[:, None] - count + jnp.arange(count, dtype=jnp.int32)
    return jnp.take_along_axis(tokens, idx, axis=1)


def _emit(state, new_tokens, num_new, prompt_lengths, max_new_tokens, eos_token_id):
    """Appends the first num_new[b] of new_tokens[b] to each active row, with EOS and budget."""
    batch, width = new_tokens.shape
    idx = jnp.arange(width, dtype=jnp.int32)
    generated = state.lengths - prompt_lengths
    count = jnp.minimum(num_new, max_new_tokens - generated)
    hit_eos = jnp.zeros((batch,), bool)
    if eos_token_id is not None:
        is_eos = (new_tokens == eos_token_id) & (idx[None] < count[:, None])
        first_eos = jnp.argmax(is_eos, axis=1).astype(jnp.int32)
        hit_eos = jnp.any(is_eos, axis=1)
        count = jnp.where(hit_eos, first_eos + 1, count)
    count = jnp.where(state.done, 0, count)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    # Positions past the buffer are dropped (a negative index would wrap around).
    skip = state.tokens.shape[1]
    positions = jnp.where(idx[None] < count[:, None], state.lengths[:, None] + idx, skip)
    tokens = state.tokens.at[rows, positions].set(new_tokens, mode="drop")
    lengths = state.lengths + count
    done = state.done | hit_eos | (lengths - prompt_lengths >= max_new_tokens)
    return state.replace(tokens=tokens, lengths=lengths, done=done), count


def _init_state(
    target,
    draft,
    prompts,
    prompt_lengths,
    keys,
    *,
    max_new_tokens,
    gamma,
    sampling,
    eos_token_id,
    vocab_size,
    cache_len,
    buffer_len,
):
    batch, width = prompts.shape
    target_cache = init_cache(target.config, batch=batch, max_len=cache_len)
    logits, target_cache = _prefill(target, target_cache, prompts, prompt_lengths)
    logits = logits[:, :vocab_size]
    draft_cache = None
    if draft is not None:
        draft_cache = init_cache(draft.config, batch=batch, max_len=cache_len)
        _, draft_cache = _prefill(draft, draft_cache, prompts, prompt_lengths)
    first = sample(
        jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys), probs_from_logits(logits, sampling)
    )
    tokens = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(prompts)
    stats = GenerationStats(
        rounds=jnp.zeros((batch,), jnp.int32),
        target_calls=jnp.ones((), jnp.int32),
        drafted=jnp.zeros((batch,), jnp.int32),
        accepted=jnp.zeros((batch,), jnp.int32),
        accepted_at=jnp.zeros((batch, gamma), jnp.int32),
        nonfinite=_nonfinite(logits),
    )
    state = _LoopState(
        tokens=tokens,
        lengths=prompt_lengths,
        target_cache=target_cache,
        draft_cache=draft_cache,
        done=jnp.zeros((batch,), bool),
        round=jnp.zeros((), jnp.int32),
        stats=stats,
    )
    state, _ = _emit(
        state,
        first[:, None],
        jnp.ones((batch,), jnp.int32),
        prompt_lengths,
        max_new_tokens,
        eos_token_id,
    )
    return state


def _draft(draft, state, keys, *, gamma, sampling, vocab_size):
    """γ draft steps: the first feeds the last two tokens, then one token per step.

    Returns drafted tokens [B, γ], their q [B, γ, V] and the draft cache.
    """
    step_keys = jax.vmap(lambda k: jax.random.split(k, gamma))(keys)  # [B, γ]
    cache = state.draft_cache.replace(lengths=state.lengths - 2)

    def step(cache, inputs, key):
        logits, cache = draft.decode(inputs, cache)
        q = probs_from_logits(logits[:, -1, :vocab_size], sampling)  # [B, V]
        return cache, sample(key, q), q, _nonfinite(logits[:, -1])

    cache, x, q, bad = step(cache, _gather_last(state.tokens, state.lengths, 2), step_keys[:, 0])

    def body(carry, key):
        cache, x = carry
        cache, x, q, bad = step(cache, x[:, None], key)
        return (cache, x), (x, q, bad)

    # Unrolled: γ is small and static, and a rolled loop costs more per step than the
    # small draft model itself on CPU.
    (cache, _), (xs, qs, bads) = jax.lax.scan(
        body, (cache, x), jnp.swapaxes(step_keys[:, 1:], 0, 1), unroll=True
    )
    drafted = jnp.concatenate([x[:, None], jnp.swapaxes(xs, 0, 1)], axis=1)
    probs = jnp.concatenate([q[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    return drafted, probs, cache, bad | jnp.any(bads, axis=0)


def _speculative_round(
    target,
    draft,
    state,
    keys,
    prompt_lengths,
    *,
    gamma,
    sampling,
    max_new_tokens,
    eos_token_id,
    vocab_size,
):
    round_keys = jax.vmap(lambda k: jax.random.fold_in(k, state.round + 1))(keys)
    split = jax.vmap(jax.random.split)(round_keys)  # [B, 2]
    drafted, q, draft_cache, draft_bad = _draft(
        draft, state, split[:, 0], gamma=gamma, sampling=sampling, vocab_size=vocab_size
    )
    pending = _gather_last(state.tokens, state.lengths, 1)
    target_cache = state.target_cache.replace(lengths=state.lengths - 1)
    logits, target_cache = target.decode(jnp.concatenate([pending, drafted], axis=1), target_cache)
    logits = logits[..., :vocab_size]
    p = probs_from_logits(logits, sampling)  # [B, γ+1, V]
    result = accept(split[:, 1], drafted, q, p)

    new_tokens = jnp.concatenate([drafted, result.next_token[:, None]], axis=1)
    idx = jnp.arange(gamma + 1, dtype=jnp.int32)
    new_tokens = jnp.where(
        idx[None] < result.num_accepted[:, None], new_tokens, result.next_token[:, None]
    )
    active = ~state.done
    state = state.replace(target_cache=target_cache, draft_cache=draft_cache)
    state, _ = _emit(
        state, new_tokens, result.num_accepted + 1, prompt_lengths, max_new_tokens, eos_token_id
    )
    s = state.stats
    on = active.astype(jnp.int32)
    stats = s.replace(
        rounds=s.rounds + on,
        target_calls=s.target_calls + 1,
        drafted=s.drafted + gamma * on,
        accepted=s.accepted + result.num_accepted * on,
        accepted_at=s.accepted_at
        + (idx[None, :gamma] < result.num_accepted[:, None]) * on[:, None],
        nonfinite=s.nonfinite | (active & (_nonfinite(logits) | draft_bad)),
    )
    return state.replace(stats=stats, round=state.round + 1)


def _autoregressive_step(
    target, state, keys, prompt_lengths, *, sampling, max_new_tokens, eos_token_id, vocab_size
):
    round_keys = jax.vmap(lambda k: jax.random.fold_in(k, state.round + 1))(keys)
    pending = _gather_last(state.tokens, state.lengths, 1)
    cache = state.target_cache.replace(lengths=state.lengths - 1)
    logits, cache = target.decode(pending, cache)
    logits = logits[:, 0, :vocab_size]
    token = sample(round_keys, probs_from_logits(logits, sampling))
    active = ~state.done
    state, _ = _emit(
        state.replace(target_cache=cache),
        token[:, None],
        jnp.ones_like(state.lengths),
        prompt_lengths,
        max_new_tokens,
        eos_token_id,
    )
    s = state.stats
    stats = s.replace(
        rounds=s.rounds + active,
        target_calls=s.target_calls + 1,
        nonfinite=s.nonfinite | (active & _nonfinite(logits)),
    )
    return state.replace(stats=stats, round=state.round + 1)


def _finish(state, prompt_lengths, max_new_tokens, pad_token_id):
    idx = jnp.arange(max_new_tokens, dtype=jnp.int32)
    generated = state.lengths - prompt_lengths
    out = jnp.take_along_axis(state.tokens, prompt_lengths[:, None] + idx[None], axis=1)
    out = jnp.where(idx[None] < generated[:, None], out, pad_token_id)
    return GenerationOutput(tokens=out, lengths=generated, stats=state.stats)


@functools.partial(
    jax.jit,
    static_argnames=(
        "target_def",
        "draft_def",
        "max_new_tokens",
        "gamma",
        "sampling",
        "eos_token_id",
        "vocab_size",
        "cache_len",
        "pad_token_id",
    ),
)
def _generate_program(
    target_def,
    target_state,
    draft_def,
    draft_state,
    prompts,
    prompt_lengths,
    keys,
    *,
    max_new_tokens,
    gamma,
    sampling,
    eos_token_id,
    vocab_size,
    cache_len,
    pad_token_id,
):
    """The whole generation as one XLA program (gamma = 0 and no draft: autoregressive)."""
    target = nnx.merge(target_def, target_state)
    draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
    buffer_len = prompts.shape[1] + max_new_tokens + gamma + 1
    state = _init_state(
        target,
        draft,
        prompts,
        prompt_lengths,
        keys,
        max_new_tokens=max_new_tokens,
        gamma=gamma,
        sampling=sampling,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        cache_len=cache_len,
        buffer_len=buffer_len,
    )
    if draft is None:
        body = functools.partial(
            _autoregressive_step,
            target,
            keys=keys,
            prompt_lengths=prompt_lengths,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            vocab_size=vocab_size,
        )
    else:
        body = functools.partial(
            _speculative_round,
            target,
            draft,
            keys=keys,
            prompt_lengths=prompt_lengths,
            gamma=gamma,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            vocab_size=vocab_size,
        )
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return _finish(state, prompt_lengths, max_new_tokens, pad_token_id)


def _bind(target, draft, prompts, prompt_lengths, keys, **static):
    """Splits the models and binds every input: calling the result runs only the program."""
    models = [target] if draft is None else [target, draft]
    cache_len = min(
        int(prompt_lengths.max()) + static["max_new_tokens"] + static["gamma"],
        *(m.config.max_len for m in models),
    )
    target_def, target_state = nnx.split(target)
    draft_def, draft_state = (None, None) if draft is None else nnx.split(draft)
    return functools.partial(
        _generate_program,
        target_def,
        target_state,
        draft_def,
        draft_state,
        jnp.asarray(prompts),
        jnp.asarray(prompt_lengths),
        keys,
        cache_len=cache_len,
        **static,
    )


def _checked(out: GenerationOutput) -> GenerationOutput:
    bad = np.asarray(out.stats.nonfinite)
    if bad.any():
        warnings.warn(
            f"NaN/inf logits met in rows {np.flatnonzero(bad).tolist()}; their tokens are "
            "not samples of the model's distribution",
            RuntimeWarning,
            stacklevel=3,
        )
    return out


# ------------------------------------------------------------------- public API


def speculative_program(
    target: Transformer,
    draft: Transformer,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens: int,
    num_draft_tokens: int = 4,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    prompt_lengths=None,
    vocab_size: int | None = None,
    pad_token_id: int = 0,
) -> Callable[[], GenerationOutput]:
    """The speculative program with its inputs validated and bound, not yet run.

    Arguments are those of `speculative_generate`. Calling the result runs only the
    compiled XLA program (no validation, no model splitting): for benchmarks and for
    generating repeatedly from the same inputs.
    """
    prompts, lengths, keys, max_new_tokens = _check_common(
        target, "target", prompts, prompt_lengths, key, max_new_tokens, sampling, eos_token_id
    )
    if not isinstance(draft, Transformer):
        raise TypeError(f"draft must be a jax_specdec.nn.Transformer, got {type(draft).__name__}")
    gamma = _check_int("num_draft_tokens", num_draft_tokens, 1)
    vocab_size = _shared_vocab(target, draft, vocab_size)
    if int(prompts.max()) >= vocab_size:
        raise ValueError(f"prompts have token ids >= vocab_size ({vocab_size})")
    _check_fits(target, "target", lengths, max_new_tokens)
    _check_fits(draft, "draft", lengths, max_new_tokens)
    return _bind(
        target,
        draft,
        prompts,
        lengths,
        keys,
        max_new_tokens=max_new_tokens,
        gamma=gamma,
        sampling=sampling,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
    )


def _shared_vocab(target, draft, vocab_size):
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vocab_size is None:
        if vt != vd:
            raise ValueError(
                f"target and draft vocabularies differ ({vt} vs {vd}); if one is only padded "
                "beyond the tokenizer's vocabulary, pass vocab_size=<the tokenizer's size>"
            )
        return vt
    vocab_size = _check_int("vocab_size", vocab_size, 1)
    if vocab_size > min(vt, vd):
        raise ValueError(f"vocab_size ({vocab_size}) exceeds a model's vocabulary ({vt}, {vd})")
    return vocab_size


def autoregressive_program(
    target: Transformer,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    prompt_lengths=None,
    pad_token_id: int = 0,
) -> Callable[[], GenerationOutput]:
    """The autoregressive program with its inputs validated and bound, not yet run.

    Arguments are those of `autoregressive_generate`.
    """
    prompts, lengths, keys, max_new_tokens = _check_common(
        target, "target", prompts, prompt_lengths, key, max_new_tokens, sampling, eos_token_id
    )
    _check_fits(target, "target", lengths, max_new_tokens)
    return _bind(
        target,
        None,
        prompts,
        lengths,
        keys,
        max_new_tokens=max_new_tokens,
        gamma=0,
        sampling=sampling,
        eos_token_id=eos_token_id,
        vocab_size=target.config.vocab_size,
        pad_token_id=pad_token_id,
    )


def speculative_generate(
    target: Transformer,
    draft: Transformer,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens: int,
    num_draft_tokens: int = 4,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    prompt_lengths=None,
    vocab_size: int | None = None,
    pad_token_id: int = 0,
) -> GenerationOutput:
    """Generates with speculative decoding; distributed exactly as sampling from `target`.

    Args:
      target: the model whose distribution the output follows.
      draft: the cheaper proposer model (same tokenizer).
      prompts: a list of token-id lists (ragged), or an int array [B, P] with
        `prompt_lengths` [B] (right padding ignored).
      key: one `jax.random.key` (row b uses fold_in(key, b)) or an array of B keys.
      max_new_tokens: tokens to generate per row (fewer if the row emits EOS).
      num_draft_tokens: γ >= 1, tokens drafted per round.
      sampling: temperature / top-k / top-p, applied identically to target and draft.
      eos_token_id: a row stops after emitting it (it is kept); None: no EOS.
      prompt_lengths: [B] lengths when `prompts` is an array.
      vocab_size: the real vocabulary when target and draft differ only by padding
        (e.g. 32000 vs 32064): logits beyond it are dropped from both models, which is
        exact as long as the target gives padded ids no probability. Required when
        the two vocabulary sizes differ.
      pad_token_id: fills `tokens` after each row's end.

    Returns:
      GenerationOutput(tokens [B, max_new_tokens], lengths [B], stats).
    """
    program = speculative_program(
        target,
        draft,
        prompts,
        key=key,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        sampling=sampling,
        eos_token_id=eos_token_id,
        prompt_lengths=prompt_lengths,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
    )
    return _checked(program())


def autoregressive_generate(
    target: Transformer,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    prompt_lengths=None,
    pad_token_id: int = 0,
) -> GenerationOutput:
    """Plain decoding, one target call per token: the baseline, built like the speculative
    loop (one program, the same cache code) so speed comparisons are fair.

    Arguments are those of `speculative_generate`.
    """
    program = autoregressive_program(
        target,
        prompts,
        key=key,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_token_id=eos_token_id,
        prompt_lengths=prompt_lengths,
        pad_token_id=pad_token_id,
    )
    return _checked(program())
