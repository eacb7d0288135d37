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
from jax.sharding import Mesh, NamedSharding

from jax_specdec.acceptance import AcceptResult, accept_with_noise
from jax_specdec.nn import KVCache, Transformer, init_cache, write_entries
from jax_specdec.proposers import NGram
from jax_specdec.sampling import SamplingConfig, probs_from_logits, sample, sample_with_uniforms
from jax_specdec.schedules import SCHEDULES, Constant, Schedule, ScheduleStats
from jax_specdec.sharding import cache_spec, check_mesh, place_rows, shard_state

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
      rejected: [B] rounds that ended with a drafted token rejected.
      drafted_at: [B, γ_max] rounds in which the row drafted a token at position i
        (0-based); the acceptance rate at position i is accepted_at / drafted_at.
      accepted_at: [B, γ_max] rounds in which draft position i was accepted.
      rejected_at: [B, γ_max] rounds whose first rejection was at draft position i, so
        the acceptance of position i given that the drafts before it were accepted is
        accepted_at / (accepted_at + rejected_at). The three are empty for
        autoregressive decoding.
      gamma_rounds: [γ_max + 1] rounds of the whole batch run with each draft width
        (0: a plain target step).
      nonfinite: [B] whether the row ever met a NaN/inf logit (its tokens are then not
        to be trusted; a warning is raised too).
    """

    rounds: jax.Array
    target_calls: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    drafted_at: jax.Array
    accepted_at: jax.Array
    rejected_at: jax.Array
    gamma_rounds: jax.Array
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
        if self.accepted_at.shape[1] == 0:
            return float("nan")
        accepted = jnp.sum(self.accepted)
        return float(accepted / jnp.maximum(accepted + jnp.sum(self.rejected), 1))

    def tokens_per_round(self, lengths: jax.Array) -> float:
        """Mean tokens emitted per round (the prefill's first token not counted)."""
        return float(jnp.sum(lengths - 1) / jnp.maximum(jnp.sum(self.rounds), 1))

    def acceptance_at(self) -> np.ndarray:
        """[γ_max] acceptance rate of each draft position over the batch (NaN if unused)."""
        drafted = np.asarray(jnp.sum(self.drafted_at, axis=0), np.float64)
        accepted = np.asarray(jnp.sum(self.accepted_at, axis=0), np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(drafted > 0, accepted / drafted, np.nan)

    def conditional_acceptance_at(self) -> np.ndarray:
        """[γ_max] acceptance of each draft position given that the drafts before it were
        accepted, over the batch (NaN if never reached). Constant under the i.i.d. model
        of DESIGN §2; it is what `schedules.CostModel` estimates per row."""
        accepted = np.asarray(jnp.sum(self.accepted_at, axis=0), np.float64)
        tried = accepted + np.asarray(jnp.sum(self.rejected_at, axis=0), np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tried > 0, accepted / tried, np.nan)

    @staticmethod
    def merge(stats: Sequence[GenerationStats]) -> GenerationStats:
        """The counters of several calls as one (rows concatenated, batch counts summed)."""
        if not stats:
            raise ValueError("merge needs at least one GenerationStats")
        rows = (
            "rounds",
            "drafted",
            "accepted",
            "rejected",
            "drafted_at",
            "accepted_at",
            "rejected_at",
        )
        fields = {k: jnp.concatenate([getattr(s, k) for s in stats]) for k in rows}
        fields["nonfinite"] = jnp.concatenate([s.nonfinite for s in stats])
        fields["target_calls"] = sum(s.target_calls for s in stats)
        width = max(s.gamma_rounds.shape[0] for s in stats)
        fields["gamma_rounds"] = sum(
            jnp.pad(s.gamma_rounds, (0, width - s.gamma_rounds.shape[0])) for s in stats
        )
        return GenerationStats(**fields)


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
    last_gamma: jax.Array  # [B] tokens drafted by the row in the previous round
    last_accepted: jax.Array  # [B] of which accepted
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
    gamma_max,
    sampling,
    eos_token_id,
    vocab_size,
    cache_len,
    buffer_len,
    prefill_draft,
    mesh,
):
    batch, width = prompts.shape

    def init(config):
        cache = init_cache(config, batch=batch, max_len=cache_len)
        if mesh is None:
            return cache
        # Rows over the data axis, key/value heads over the model axis.
        spec = NamedSharding(mesh, cache_spec())
        return cache.replace(
            keys=tuple(jax.lax.with_sharding_constraint(a, spec) for a in cache.keys),
            values=tuple(jax.lax.with_sharding_constraint(a, spec) for a in cache.values),
        )

    target_cache = init(target.config)
    logits, target_cache = _prefill(target, target_cache, prompts, prompt_lengths)
    logits = logits[:, :vocab_size]
    draft_cache = None
    if draft is not None:
        draft_cache = init(draft.config)
        if prefill_draft:
            _, draft_cache = _prefill(draft, draft_cache, prompts, prompt_lengths)
    first = _choose(
        jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys),
        logits,
        probs_from_logits(logits, sampling),
        sampling,
    )
    tokens = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(prompts)
    zeros = jnp.zeros((batch,), jnp.int32)
    stats = GenerationStats(
        rounds=zeros,
        target_calls=jnp.ones((), jnp.int32),
        drafted=zeros,
        accepted=zeros,
        rejected=zeros,
        drafted_at=jnp.zeros((batch, gamma_max), jnp.int32),
        accepted_at=jnp.zeros((batch, gamma_max), jnp.int32),
        rejected_at=jnp.zeros((batch, gamma_max), jnp.int32),
        gamma_rounds=jnp.zeros((gamma_max + 1,), jnp.int32),
        nonfinite=_nonfinite(logits),
    )
    state = _LoopState(
        tokens=tokens,
        lengths=prompt_lengths,
        target_cache=target_cache,
        draft_cache=draft_cache,
        done=jnp.zeros((batch,), bool),
        round=jnp.zeros((), jnp.int32),
        last_gamma=zeros,
        last_accepted=zeros,
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


class _Noise(NamedTuple):
    """One round's randomness for each row, drawn at the widest γ so that a row's noise
    does not depend on how wide its batch's round is.

    Under greedy decoding (temperature 0) nothing is drawn: p and q are one-hot, so
    zero uniforms accept exactly the drafts equal to the target's argmax, and a zero
    draw picks the first token with mass of the one-hot residual or bonus, its argmax.
    The same shapes, all zeros, keep one code path.
    """

    draft_keys: jax.Array  # [B, γ_max] one key per draft step (zeros [B, γ_max] if greedy)
    uniforms: jax.Array  # [B, γ_max] acceptance tests
    draws: jax.Array  # [B] the correction / bonus draw (inverse CDF)


def _round_noise(keys, round_index, gamma_max, sampling) -> _Noise:
    batch = keys.shape[0]
    if sampling.greedy:
        return _Noise(
            jnp.zeros((batch, gamma_max), jnp.int32),
            jnp.zeros((batch, gamma_max), jnp.float32),
            jnp.zeros((batch,), jnp.float32),
        )
    round_keys = jax.vmap(lambda k: jax.random.fold_in(k, round_index))(keys)
    split = jax.vmap(jax.random.split)(round_keys)  # [B, 2]: draft, acceptance

    def accept_noise(key):  # as `acceptance.accept` draws it
        accept_key, residual_key = jax.random.split(key)
        return (
            jax.random.uniform(accept_key, (gamma_max,), jnp.float32),
            jax.random.uniform(residual_key, (), jnp.float32),
        )

    uniforms, draws = jax.vmap(accept_noise)(split[:, 1])
    draft_keys = jax.vmap(lambda k: jax.random.split(k, gamma_max))(split[:, 0])
    return _Noise(draft_keys, uniforms, draws)


def _choose(keys, logits, probs, sampling):
    """A token per row: the argmax under greedy decoding (keys unused), else a draw
    from probs [B, V] with keys [B]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample(keys, probs)


def _draw(draws, logits, probs, sampling):
    """The token of a width-0 round from its draws [B]: the argmax under greedy decoding,
    else inverse CDF on probs (what the acceptance step does with no drafts)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_with_uniforms(draws, probs)


def _schedule_stats(state, prompt_lengths, max_new_tokens) -> ScheduleStats:
    s = state.stats
    generated = state.lengths - prompt_lengths
    return ScheduleStats(
        round=state.round,
        active=~state.done,
        generated=generated,
        remaining=jnp.where(state.done, 0, max_new_tokens - generated),
        rounds=s.rounds,
        drafted=s.drafted,
        accepted=s.accepted,
        rejected=s.rejected,
        accepted_at=s.accepted_at,
        rejected_at=s.rejected_at,
        last_gamma=state.last_gamma,
        last_accepted=state.last_accepted,
    )


def _draft_step(draft, sampling, vocab_size):
    """One draft call on a read-only cache: returns x [B], q [B, V], the new entries, a
    NaN flag [B] and the draft's confidence in x: q(x), or under greedy decoding
    (q one-hot) the softmax of the raw logits at x."""

    def step(cache, recent, inputs, key):
        logits, keys, values = draft.decode_entries(inputs, cache, recent)
        logits = logits[:, -1, :vocab_size]
        q = probs_from_logits(logits, sampling)  # [B, V]
        x = _choose(key, logits, q, sampling)
        conf = q if sampling.temperature > 0 else jax.nn.softmax(logits, axis=-1)
        conf = jnp.take_along_axis(conf, x[:, None], axis=1)[:, 0]
        return x, q, (keys, values), _nonfinite(logits), conf

    return step


def _catch_up(draft, cache, tokens, lengths, needed):
    """Brings the draft cache to `lengths - 2` valid positions in the rows where `needed`:
    after rounds that did not run the draft (γ = 0), or from empty (a skippable
    schedule has no draft prefill). Feeds chunks of 32 tokens while a row is 16 or more
    behind, then of 4; a no-op check when nothing is behind."""
    goal = jnp.where(needed, lengths - 2, 0)
    width = tokens.shape[1]

    def feed(chunk):
        def body(cache):
            idx = cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)
            chunk_tokens = jnp.take_along_axis(tokens, jnp.minimum(idx, width - 1), axis=1)
            _, new = draft.decode(chunk_tokens, cache)
            # Rows already there wrote only past their valid entries; they keep their length.
            behind = cache.lengths < goal
            step = jnp.minimum(cache.lengths + chunk, goal)
            return new.replace(lengths=jnp.where(behind, step, cache.lengths))

        return body

    for chunk, lag in ((min(32, cache.max_len), 16), (min(4, cache.max_len), 1)):
        cache = jax.lax.while_loop(
            lambda c, lag=lag: jnp.any(c.lengths + lag <= goal), feed(chunk), cache
        )
    return cache


def _pad_entries(entries, size):
    """Per-layer [B, T, K, hd] entries padded with zeros to T = size."""
    pad = lambda a: jnp.pad(a, ((0, 0), (0, size - a.shape[1]), (0, 0), (0, 0)))  # noqa: E731
    return tuple(tuple(map(pad, part)) for part in entries)


def _draft(draft, cache, tokens, lengths, draft_keys, *, gamma, sampling, vocab_size):
    """γ draft steps, unrolled, on a read-only cache valid below `lengths - 2`: the first
    feeds the last two tokens, then one token per step, with this round's entries kept
    aside. Returns drafted [B, γ], q [B, γ, V], entries (γ+1 per layer, for positions
    lengths - 2 …) and a NaN flag [B].
    """
    step = _draft_step(draft, sampling, vocab_size)
    cache = cache.replace(lengths=lengths - 2)
    x, q, entries, bad, _ = step(cache, None, _gather_last(tokens, lengths, 2), draft_keys[:, 0])
    xs, qs = [x], [q]
    for i in range(1, gamma):  # unrolled: γ is small, and a rolled loop costs more on CPU
        recent = (*entries, jnp.full_like(lengths, entries[0][0].shape[1]))
        x, q, new, step_bad, _ = step(cache, recent, x[:, None], draft_keys[:, i])
        entries = tuple(
            tuple(jnp.concatenate([a, b], axis=1) for a, b in zip(old, fresh, strict=True))
            for old, fresh in zip(entries, new, strict=True)
        )
        xs.append(x)
        qs.append(q)
        bad = bad | step_bad
    return jnp.stack(xs, axis=1), jnp.stack(qs, axis=1), entries, bad


def _draft_until(
    draft, cache, tokens, lengths, done, draft_keys, *, threshold, sampling, vocab_size
):
    """The confidence-threshold draft: up to γ_max steps in an early-exit loop; a row
    stops after a token whose draft probability is below `threshold`.

    Returns drafted [B, γ_max], q [B, γ_max, V], counts [B], entries (γ_max + 1 per
    layer, for positions lengths - 2 …) and a NaN flag [B].
    """
    batch, gamma_max = draft_keys.shape
    step = _draft_step(draft, sampling, vocab_size)
    cache = cache.replace(lengths=lengths - 2)
    x, q, entries, bad, conf = step(cache, None, _gather_last(tokens, lengths, 2), draft_keys[:, 0])
    entries = _pad_entries(entries, gamma_max + 1)
    drafted = jnp.zeros((batch, gamma_max), jnp.int32).at[:, 0].set(x)
    probs = jnp.zeros((batch, gamma_max, q.shape[-1]), jnp.float32).at[:, 0].set(q)
    going = conf >= threshold
    counts = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        i, going = carry[0], carry[5]
        return (i < gamma_max) & jnp.any(going & ~done)

    def body(carry):
        i, x, drafted, probs, entries, going, counts, bad = carry
        key = jax.lax.dynamic_index_in_dim(draft_keys, i, axis=1, keepdims=False)
        recent = (*entries, jnp.full_like(lengths, i + 1))
        x, q, new, step_bad, conf = step(cache, recent, x[:, None], key)
        drafted = jax.lax.dynamic_update_index_in_dim(drafted, x, i, axis=1)
        probs = jax.lax.dynamic_update_index_in_dim(probs, q, i, axis=1)
        entries = tuple(
            tuple(
                jax.lax.dynamic_update_slice_in_dim(a, b, i + 1, axis=1)
                for a, b in zip(old, fresh, strict=True)
            )
            for old, fresh in zip(entries, new, strict=True)
        )
        counts = counts + going
        bad = bad | (going & step_bad)
        going = going & (conf >= threshold)
        return i + 1, x, drafted, probs, entries, going, counts, bad

    carry = (jnp.int32(1), x, drafted, probs, entries, going, counts, bad)
    _, _, drafted, probs, entries, _, counts, bad = jax.lax.while_loop(cond, body, carry)
    return drafted, probs, counts, entries, bad


def _verify(
    target,
    cache,
    state,
    drafted,
    q,
    counts,
    draft_bad,
    noise,
    prompt_lengths,
    *,
    width,
    sampling,
    max_new_tokens,
    eos_token_id,
    vocab_size,
):
    """The target scores the pending token and `width` drafts on its read-only cache;
    row b's first counts[b] drafts go through the acceptance step; the accepted run and
    the correction (or bonus) token are appended. `width` = 0 is a plain decode step.

    Returns the state (caches untouched) and the target's entries for positions
    lengths - 1 …, padded to γ_max + 1 per layer.
    """
    gamma_max = state.stats.accepted_at.shape[1]
    drafted = drafted[:, :width]
    q = None if q is None else q[:, :width]
    pending = _gather_last(state.tokens, state.lengths, 1)
    logits, keys, values = target.decode_entries(
        jnp.concatenate([pending, drafted], axis=1), cache.replace(lengths=state.lengths - 1)
    )
    logits = logits[..., :vocab_size]
    counts = jnp.minimum(counts, width)
    if width == 0:  # a plain decode step: what the acceptance step reduces to
        first = logits[:, 0]
        token = _draw(noise.draws, first, probs_from_logits(first, sampling), sampling)
        result = AcceptResult(jnp.zeros_like(counts), token)
    else:
        p = probs_from_logits(logits, sampling)  # [B, width+1, V]
        result = accept_with_noise(noise.uniforms[:, :width], noise.draws, drafted, q, p, counts)
    na = result.num_accepted

    new_tokens = jnp.concatenate([drafted, result.next_token[:, None]], axis=1)
    idx = jnp.arange(width + 1, dtype=jnp.int32)
    new_tokens = jnp.where(idx[None] < na[:, None], new_tokens, result.next_token[:, None])
    active = ~state.done
    state, _ = _emit(state, new_tokens, na + 1, prompt_lengths, max_new_tokens, eos_token_id)
    s = state.stats
    on = active.astype(jnp.int32)
    at = jnp.arange(gamma_max, dtype=jnp.int32)[None]
    stats = s.replace(
        rounds=s.rounds + on,
        target_calls=s.target_calls + 1,
        drafted=s.drafted + counts * on,
        accepted=s.accepted + na * on,
        rejected=s.rejected + (na < counts) * on,
        drafted_at=s.drafted_at + (at < counts[:, None]) * on[:, None],
        accepted_at=s.accepted_at + (at < na[:, None]) * on[:, None],
        rejected_at=s.rejected_at + ((at == na[:, None]) & (na < counts)[:, None]) * on[:, None],
        gamma_rounds=s.gamma_rounds.at[width].add(1),
        nonfinite=s.nonfinite | (active & (_nonfinite(logits) | draft_bad)),
    )
    state = state.replace(
        stats=stats,
        round=state.round + 1,
        last_gamma=jnp.where(active, counts, state.last_gamma),
        last_accepted=jnp.where(active, na, state.last_accepted),
    )
    return state, _pad_entries((keys, values), gamma_max + 1)


def _speculative_round(
    target,
    draft,
    proposer,
    state,
    keys,
    prompt_lengths,
    *,
    schedule,
    sampling,
    max_new_tokens,
    eos_token_id,
    vocab_size,
):
    """One round: the schedule picks each row's γ, the proposer drafts, the target
    verifies as wide as the widest active row (a `lax.switch` over static widths).

    Inside the switch both caches are only read; the round's new entries come out of
    it and are written after, so XLA never copies a cache (a cache that is an output
    of a conditional would be copied every round).
    """
    gamma_max = schedule.max_gamma
    noise = _round_noise(keys, state.round + 1, gamma_max, sampling)
    active = ~state.done
    gammas = jnp.where(active, schedule(_schedule_stats(state, prompt_lengths, max_new_tokens)), 0)
    lengths = state.lengths
    target_cache, draft_cache = state.target_cache, state.draft_cache
    light = state.replace(target_cache=None, draft_cache=None)
    verify = functools.partial(
        _verify,
        target,
        target_cache,
        noise=noise,
        prompt_lengths=prompt_lengths,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
    )
    no_bad = jnp.zeros_like(active)

    def widest(counts):
        return jnp.clip(jnp.max(jnp.where(active, counts, 0)), 0, gamma_max)

    draft_entries = None
    if proposer is not None:  # model-free: propose, then verify as wide as needed
        proposed, found = proposer.propose(state.tokens, lengths, gamma_max)
        counts = jnp.minimum(found, gammas)
        width = widest(counts)
        branches = [
            functools.partial(
                verify, width=w, drafted=proposed, q=None, counts=counts, draft_bad=no_bad
            )
            for w in range(gamma_max + 1)
        ]
        light, target_entries = jax.lax.switch(width, branches, light)
    elif schedule.threshold is not None:  # confidence: early-exit draft, then verify
        drafted, q, counts, draft_entries, bad = _draft_until(
            draft,
            draft_cache,
            state.tokens,
            lengths,
            state.done,
            noise.draft_keys,
            threshold=schedule.threshold,
            sampling=sampling,
            vocab_size=vocab_size,
        )
        counts = jnp.minimum(counts, gammas)
        width = widest(counts)
        branches = [
            functools.partial(verify, width=w, drafted=drafted, q=q, counts=counts, draft_bad=bad)
            for w in range(gamma_max + 1)
        ]
        light, target_entries = jax.lax.switch(width, branches, light)
    else:
        constant = isinstance(schedule, Constant)
        width = gamma_max if constant else widest(gammas)
        if schedule.can_skip:
            # CostModel and Custom can pick γ = 0, a plain target step that skips the
            # draft (and start without a draft prefill), so the draft cache may have to
            # catch up before it drafts.
            draft_cache = _catch_up(draft, draft_cache, state.tokens, lengths, active & (width > 0))

        def round_of_width(w, light):
            if w == 0:
                none = jnp.zeros((gammas.shape[0], 0), jnp.int32)
                light, entries = verify(
                    light, drafted=none, q=None, counts=gammas, draft_bad=no_bad, width=0
                )
                return light, entries, _zero_entries(draft, gammas.shape[0], gamma_max + 1)
            drafted, q, d_entries, bad = _draft(
                draft,
                draft_cache,
                light.tokens,
                light.lengths,
                noise.draft_keys,
                gamma=w,
                sampling=sampling,
                vocab_size=vocab_size,
            )
            light, entries = verify(
                light, drafted=drafted, q=q, counts=gammas, draft_bad=bad, width=w
            )
            return light, entries, _pad_entries(d_entries, gamma_max + 1)

        if constant:
            light, target_entries, draft_entries = round_of_width(gamma_max, light)
        else:
            branches = [functools.partial(round_of_width, w) for w in range(gamma_max + 1)]
            light, target_entries, draft_entries = jax.lax.switch(width, branches, light)

    # The writes come after every read of the caches: their positions are made to depend
    # on the round's outcome, or XLA may write first and copy the caches to keep the
    # old values readable (see `nn.transformer._after`).
    after = light.lengths + 2**30  # > any position, but XLA cannot know it
    target_cache = write_entries(target_cache, *target_entries, jnp.minimum(lengths - 1, after))
    state = light.replace(target_cache=target_cache.replace(lengths=light.lengths - 1))
    if draft_entries is not None:
        # A round that drafted leaves the draft cache valid below `lengths - 2` (the
        # accepted drafts it saw are there); a γ = 0 round writes nothing and keeps it.
        drafted_now = width > 0
        start = jnp.minimum(jnp.where(drafted_now, lengths - 2, draft_cache.max_len), after)
        draft_cache = write_entries(draft_cache, *draft_entries, start)
        valid = jnp.where(drafted_now, light.lengths - 2, draft_cache.lengths)
        state = state.replace(draft_cache=draft_cache.replace(lengths=valid))
    return state


def _zero_entries(model, batch, size):
    c = model.config
    shape = (batch, size, c.num_kv_heads, c.head_dim)
    zeros = tuple(jnp.zeros(shape, c.jnp_dtype) for _ in range(c.num_layers))
    return zeros, zeros


def _decode_step(
    target, state, choose, prompt_lengths, *, sampling, max_new_tokens, eos_token_id, vocab_size
):
    """One plain target step, its cache written in place: `choose(logits, probs)` picks
    each row's token. Counted as a round of width 0."""
    pending = _gather_last(state.tokens, state.lengths, 1)
    cache = state.target_cache.replace(lengths=state.lengths - 1)
    logits, cache = target.decode(pending, cache)
    logits = logits[:, 0, :vocab_size]
    token = choose(logits, probs_from_logits(logits, sampling))
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
        gamma_rounds=s.gamma_rounds.at[0].add(1),
        nonfinite=s.nonfinite | (active & _nonfinite(logits)),
    )
    return state.replace(
        stats=stats,
        round=state.round + 1,
        last_gamma=jnp.where(active, 0, state.last_gamma),
        last_accepted=jnp.where(active, 0, state.last_accepted),
    )


def _autoregressive_step(target, state, keys, prompt_lengths, **common):
    round_keys = jax.vmap(lambda k: jax.random.fold_in(k, state.round + 1))(keys)
    sampling = common["sampling"]
    return _decode_step(
        target,
        state,
        lambda logits, probs: _choose(round_keys, logits, probs, sampling),
        prompt_lengths,
        **common,
    )


def _skipped_round(target, state, keys, prompt_lengths, *, gamma_max, **common):
    """A round of width 0 for the whole batch, as a plain step with the cache written
    in place: the same draw as `_verify` at width 0 (the round's `draws`), so a row's
    tokens do not depend on whether its neighbours drafted."""
    sampling = common["sampling"]
    draws = _round_noise(keys, state.round + 1, gamma_max, sampling).draws
    return _decode_step(
        target,
        state,
        lambda logits, probs: _draw(draws, logits, probs, sampling),
        prompt_lengths,
        **common,
    )


def _then_skipping(round_fn, target, keys, schedule, common):
    """After each round, plain steps (`_skipped_round`) for as long as the schedule asks
    every active row for γ = 0: a batch-wide γ = 0 then costs an autoregressive step,
    without the round's switch, catch-up check and entries written after it."""
    prompt_lengths, max_new_tokens = common["prompt_lengths"], common["max_new_tokens"]

    def skipping(state):
        gammas = schedule(_schedule_stats(state, prompt_lengths, max_new_tokens))
        return ~jnp.all(state.done) & ~jnp.any(~state.done & (gammas > 0))

    step = functools.partial(
        _skipped_round, target, keys=keys, gamma_max=schedule.max_gamma, **common
    )
    return lambda state: jax.lax.while_loop(skipping, step, round_fn(state))


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
        "proposer",
        "max_new_tokens",
        "schedule",
        "sampling",
        "eos_token_id",
        "vocab_size",
        "cache_len",
        "pad_token_id",
        "mesh",
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
    proposer,
    max_new_tokens,
    schedule,
    sampling,
    eos_token_id,
    vocab_size,
    cache_len,
    pad_token_id,
    mesh,
):
    """The whole generation as one XLA program (no schedule: autoregressive)."""
    if keys.dtype == jnp.uint32:  # key data, as placed on a mesh
        keys = jax.random.wrap_key_data(keys)
    target = nnx.merge(target_def, target_state)
    draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
    gamma_max = 0 if schedule is None else schedule.max_gamma
    buffer_len = prompts.shape[1] + max_new_tokens + gamma_max + 1
    state = _init_state(
        target,
        draft,
        prompts,
        prompt_lengths,
        keys,
        max_new_tokens=max_new_tokens,
        gamma_max=gamma_max,
        sampling=sampling,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        cache_len=cache_len,
        buffer_len=buffer_len,
        prefill_draft=schedule is not None and not schedule.can_skip,
        mesh=mesh,
    )
    common = dict(
        prompt_lengths=prompt_lengths,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
    )
    if schedule is None:
        body = functools.partial(_autoregressive_step, target, keys=keys, **common)
    else:
        body = functools.partial(
            _speculative_round, target, draft, proposer, keys=keys, schedule=schedule, **common
        )
        if schedule.can_skip:
            body = _then_skipping(body, target, keys, schedule, common)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return _finish(state, prompt_lengths, max_new_tokens, pad_token_id)


def _bind(target, draft, prompts, prompt_lengths, keys, **static):
    """Splits the models and binds every input: calling the result runs only the program."""
    models = [target] if draft is None else [target, draft]
    gamma_max = 0 if static["schedule"] is None else static["schedule"].max_gamma
    cache_len = min(
        int(prompt_lengths.max()) + static["max_new_tokens"] + gamma_max,
        *(m.config.max_len for m in models),
    )
    target_def, target_state = nnx.split(target)
    draft_def, draft_state = (None, None) if draft is None else nnx.split(draft)
    mesh = static["mesh"]
    if mesh is None:
        prompts, prompt_lengths = jnp.asarray(prompts), jnp.asarray(prompt_lengths)
    else:
        mesh = static["mesh"] = check_mesh(
            mesh,
            [("target", target.config)] + ([] if draft is None else [("draft", draft.config)]),
            batch=prompts.shape[0],
        )
        target_state = shard_state(target_state, mesh)
        draft_state = None if draft is None else shard_state(draft_state, mesh)
        prompts, prompt_lengths, keys = place_rows(
            mesh, prompts, prompt_lengths, np.asarray(jax.random.key_data(keys))
        )
    return functools.partial(
        _generate_program,
        target_def,
        target_state,
        draft_def,
        draft_state,
        prompts,
        prompt_lengths,
        keys,
        cache_len=cache_len,
        **static,
    )


def _checked(out: GenerationOutput) -> GenerationOutput:
    bad = out.stats.nonfinite
    if not bad.is_fully_addressable:  # several processes: every one gets the whole flag
        from jax.experimental import multihost_utils

        bad = multihost_utils.process_allgather(bad, tiled=True)
    bad = np.asarray(bad)
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
    draft: Transformer | NGram,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens: int,
    num_draft_tokens: int | None = None,
    schedule: Schedule | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    prompt_lengths=None,
    vocab_size: int | None = None,
    pad_token_id: int = 0,
    mesh: Mesh | None = None,
) -> Callable[[], GenerationOutput]:
    """The speculative program with its inputs validated and bound, not yet run.

    Arguments are those of `speculative_generate`. Calling the result runs only the
    compiled XLA program (no validation, no model splitting): for benchmarks and for
    generating repeatedly from the same inputs.
    """
    prompts, lengths, keys, max_new_tokens = _check_common(
        target, "target", prompts, prompt_lengths, key, max_new_tokens, sampling, eos_token_id
    )
    schedule = _check_schedule(num_draft_tokens, schedule)
    if isinstance(draft, NGram):
        proposer, draft = draft, None
        if vocab_size is not None:
            raise ValueError("vocab_size is only for a draft model, not an NGram proposer")
        if schedule.threshold is not None:
            raise ValueError(
                "the Confidence schedule needs a draft model's probabilities; an NGram "
                "proposer has none (use Constant, Heuristic, CostModel or Custom)"
            )
        vocab_size = target.config.vocab_size
    elif isinstance(draft, Transformer):
        proposer = None
        vocab_size = _shared_vocab(target, draft, vocab_size)
        if int(prompts.max()) >= vocab_size:
            raise ValueError(f"prompts have token ids >= vocab_size ({vocab_size})")
        _check_fits(draft, "draft", lengths, max_new_tokens)
    else:
        raise TypeError(
            "draft must be a jax_specdec.nn.Transformer or a proposer such as "
            f"jax_specdec.proposers.NGram(), got {type(draft).__name__}"
        )
    _check_fits(target, "target", lengths, max_new_tokens)
    return _bind(
        target,
        draft,
        prompts,
        lengths,
        keys,
        proposer=proposer,
        max_new_tokens=max_new_tokens,
        schedule=schedule,
        sampling=sampling,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        mesh=mesh,
    )


def _check_schedule(num_draft_tokens, schedule):
    if schedule is None:
        gamma = 4 if num_draft_tokens is None else num_draft_tokens
        return Constant(_check_int("num_draft_tokens", gamma, 1))
    if num_draft_tokens is not None:
        raise ValueError(
            "pass either num_draft_tokens or schedule, not both "
            "(num_draft_tokens=k is schedule=Constant(k))"
        )
    if not isinstance(schedule, SCHEDULES):
        raise TypeError(
            "schedule must be one of jax_specdec.schedules.Constant, Heuristic, Confidence, "
            f"CostModel or Custom, got {type(schedule).__name__}"
        )
    return schedule


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
    mesh: Mesh | None = None,
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
        proposer=None,
        max_new_tokens=max_new_tokens,
        schedule=None,
        sampling=sampling,
        eos_token_id=eos_token_id,
        vocab_size=target.config.vocab_size,
        pad_token_id=pad_token_id,
        mesh=mesh,
    )


def speculative_generate(
    target: Transformer,
    draft: Transformer | NGram,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens: int,
    num_draft_tokens: int | None = None,
    schedule: Schedule | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    prompt_lengths=None,
    vocab_size: int | None = None,
    pad_token_id: int = 0,
    mesh: Mesh | None = None,
) -> GenerationOutput:
    """Generates with speculative decoding; distributed exactly as sampling from `target`.

    Args:
      target: the model whose distribution the output follows.
      draft: the cheaper draft model (same tokenizer), or a model-free proposer such
        as `jax_specdec.proposers.NGram()` (prompt lookup, computed on device).
      prompts: a list of token-id lists (ragged), or an int array [B, P] with
        `prompt_lengths` [B] (right padding ignored).
      key: one `jax.random.key` (row b uses fold_in(key, b)) or an array of B keys.
      max_new_tokens: tokens to generate per row (fewer if the row emits EOS).
      num_draft_tokens: γ >= 1, tokens drafted per round (default 4); the same as
        `schedule=Constant(γ)`.
      schedule: how many tokens each row drafts per round, a
        `jax_specdec.schedules` policy (Constant, Heuristic, Confidence, CostModel,
        Custom); the round runs as wide as its widest active row.
      sampling: temperature / top-k / top-p, applied identically to target and draft.
      eos_token_id: a row stops after emitting it (it is kept); None: no EOS.
      prompt_lengths: [B] lengths when `prompts` is an array.
      vocab_size: the real vocabulary when target and draft differ only by padding
        (e.g. 32000 vs 32064): logits beyond it are dropped from both models, which is
        exact as long as the target gives padded ids no probability. Required when
        the two vocabulary sizes differ.
      pad_token_id: fills `tokens` after each row's end.
      mesh: a `jax.sharding.Mesh` with axes "data" and "model" (see
        `jax_specdec.sharding`): rows split over data, weights and caches' heads over
        model; still one program. Works under `jax.distributed` with several processes
        (every process passes the same inputs; the outputs are global arrays).

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
        schedule=schedule,
        sampling=sampling,
        eos_token_id=eos_token_id,
        prompt_lengths=prompt_lengths,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        mesh=mesh,
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
    mesh: Mesh | None = None,
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
        mesh=mesh,
    )
    return _checked(program())
