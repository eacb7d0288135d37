"""The loop state (one pytree carried by the `lax.while_loop`) and its updates.

Conventions (see docs/design.md, "The compiled loop"):
- `tokens` [B, L] holds each row's prompt followed by its generated tokens; `lengths`
  [B] counts them. The last one (the *pending* token) has been run through neither
  model yet, so the target's cache holds `lengths - 1` positions.
- Rejected drafts are rolled back by lengths alone, never by copying a cache.
- Row b's randomness comes from `keys[b]` only: the row's round r uses
  fold_in(keys[b], r) (r = 0 is the prefill's first token, r counts from the row's
  start), so a row's tokens depend on its key and prompt, never on its batch
  neighbours or on the slot it runs in.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.stats import GenerationOutput, GenerationStats
from jax_specdec.decode.stop_tokens import first_stop
from jax_specdec.nn import KVCache, TransformerConfig, init_cache
from jax_specdec.sampling import RowSampling
from jax_specdec.schedules import ScheduleStats
from jax_specdec.sharding import cache_spec

__all__ = [
    "LoopState",
    "emit",
    "finish",
    "drafter_sampling",
    "gather_last",
    "load_row",
    "new_cache",
    "pad_entries",
    "record_round",
    "schedule_stats",
    "written_after",
]


@struct.dataclass
class LoopState:
    """Everything that changes from round to round.

    Attributes:
      tokens: [B, L] int32, prompt + generated tokens (L = P + max_new_tokens + γ_max + 1).
      lengths: [B] int32, valid tokens per row; the last one is pending.
      prompt_lengths: [B] int32.
      budgets: [B] int32, tokens each row may generate (its max_new_tokens).
      keys: [B] jax keys, one per row.
      sampling: each row's sampling setting (`RowSampling`, arrays [B]).
      target_cache: the target's `KVCache`, valid below `lengths - 1`.
      draft_cache: whatever the drafter keeps (its own cache), or None.
      done: [B] bool, rows that hit EOS or their budget (their tokens are frozen).
      round: [B] int32, rounds run since the row started.
      last_gamma: [B] int32, tokens the row drafted in its previous round.
      last_accepted: [B] int32, how many of them were accepted.
      stats: `GenerationStats`, the per-row counters returned to the caller.
      queue: with slots, the prompts waiting and the finished rows' outputs
        (`slots.Queue`); None without.
      seen: the tokens before each row's next position (`penalties.Seen`) when a row
        uses a penalty (`sampling.plan.penalties`); None otherwise.
      logprobs: the log-probabilities of `tokens` (`decode.logprobs.Logprobs` [B, L])
        when `config.logprobs` asks for them; None otherwise.
      auto: the program's input for `schedules.Auto` (`AutoInputs`: round costs and
        prior acceptance); None otherwise.
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    budgets: jax.Array
    keys: jax.Array
    sampling: RowSampling
    target_cache: KVCache
    draft_cache: Any
    done: jax.Array
    round: jax.Array
    last_gamma: jax.Array
    last_accepted: jax.Array
    stats: GenerationStats
    queue: Any = None
    seen: Any = None
    logprobs: Any = None
    auto: Any = None

    @property
    def generated(self) -> jax.Array:
        """[B] tokens generated so far (the prefill's first token counted)."""
        return self.lengths - self.prompt_lengths


def new_cache(model_config: TransformerConfig, batch: int, config: LoopConfig) -> KVCache:
    """An empty cache of `config.cache_len` positions; on a mesh, rows over the data
    axis and key/value heads over the model axis."""
    cache = init_cache(model_config, batch=batch, max_len=config.cache_len)
    if config.mesh is None:
        return cache
    spec = NamedSharding(config.mesh, cache_spec())
    place = lambda arrays: tuple(jax.lax.with_sharding_constraint(a, spec) for a in arrays)  # noqa: E731
    return cache.replace(keys=place(cache.keys), values=place(cache.values))


def load_row(cache: KVCache, row: KVCache, slot: jax.Array, length: jax.Array) -> KVCache:
    """`cache` with row `slot` overwritten by the one-row cache `row` (its first
    positions; the rest of the slot's old entries stay but lie beyond `length`)."""

    # Positions past the big cache's size (chunk padding) are beyond `length`: cut.
    def put(big, small):
        return jax.lax.dynamic_update_slice(
            big, small[:, :, : big.shape[2]].astype(big.dtype), (slot, 0, 0, 0)
        )

    return cache.replace(
        keys=tuple(map(put, cache.keys, row.keys)),
        values=tuple(map(put, cache.values, row.values)),
        lengths=cache.lengths.at[slot].set(length),
    )


def pad_entries(entries, size: int):
    """Per-layer cache entries [B, T, K, hd] padded with zeros to T = size."""
    pad = lambda a: jnp.pad(a, ((0, 0), (0, size - a.shape[1]), (0, 0), (0, 0)))  # noqa: E731
    return tuple(tuple(map(pad, part)) for part in entries)


def written_after(positions: jax.Array, lengths: jax.Array) -> jax.Array:
    """`positions`, unchanged, but made to depend on the round's outcome `lengths`.

    A round's cache writes must come after every read of the caches. Without a data
    dependency XLA may write first and copy the whole cache to keep the old values
    readable; lengths + 2**30 exceeds any position, but XLA cannot know it.
    """
    return jnp.minimum(positions, lengths + 2**30)


def drafter_sampling(state: LoopState) -> RowSampling:
    """The rows' sampling as a drafter sees it: with the tokens seen, so that its q takes
    the rows' penalties (`RowSampling.adjust`)."""
    return state.sampling if state.seen is None else state.sampling.replace(seen=state.seen)


def gather_last(tokens: jax.Array, lengths: jax.Array, count: int) -> jax.Array:
    """tokens[b, lengths[b] - count : lengths[b]] -> [B, count]."""
    idx = lengths[:, None] - count + jnp.arange(count, dtype=jnp.int32)
    return jnp.take_along_axis(tokens, idx, axis=1)


def _ended(state: LoopState, new_tokens, count, config: LoopConfig):
    """(count [B] cut after the first stop among each row's first count[b] new tokens,
    whether the row stopped [B]): a stop id (`config.eos_token_id`) or the completion of
    one of the row's stop sequences (`decode.stop_tokens`)."""
    batch, width = new_tokens.shape
    idx = jnp.arange(width, dtype=jnp.int32)
    ended = jnp.zeros((batch,), bool)
    if config.eos_token_id is not None:
        is_eos = functools.reduce(
            jnp.logical_or, [new_tokens == i for i in config.eos_token_id]
        ) & (idx[None] < count[:, None])
        ended = jnp.any(is_eos, axis=1)
        count = jnp.where(ended, jnp.argmax(is_eos, axis=1).astype(jnp.int32) + 1, count)
    stops = state.sampling.stop_tokens
    if stops is not None:
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        at = state.lengths[:, None] + idx
        written = state.tokens.at[rows, at].set(new_tokens, mode="drop")
        hit, first = first_stop(written, state.lengths, state.prompt_lengths, width, stops)
        hit = hit & (first < count)
        count = jnp.where(hit, first + 1, count)
        ended = ended | hit
    return count, ended


def emit(state: LoopState, new_tokens, num_new, config: LoopConfig, scores=None) -> LoopState:
    """Appends the first num_new[b] of new_tokens [B, W] to each active row (and their
    log-probabilities `scores`, a `Logprobs` [B, W], when the state keeps them); a row
    ends at its first EOS, any of `config.eos_token_id` (kept), at the last token of one
    of its stop sequences (kept), or at its budget, and later tokens are dropped."""
    batch, width = new_tokens.shape
    idx = jnp.arange(width, dtype=jnp.int32)
    count = jnp.minimum(num_new, state.budgets - state.generated)
    count, ended = _ended(state, new_tokens, count, config)
    count = jnp.where(state.done, 0, count)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    # Positions past the buffer are dropped (a negative index would wrap around).
    skip = state.tokens.shape[1]
    positions = jnp.where(idx[None] < count[:, None], state.lengths[:, None] + idx, skip)
    tokens = state.tokens.at[rows, positions].set(new_tokens, mode="drop")
    lengths = state.lengths + count
    done = state.done | ended | (lengths - state.prompt_lengths >= state.budgets)
    seen = None if state.seen is None else state.seen.emit(new_tokens, count)
    logprobs = state.logprobs
    if logprobs is not None:
        logprobs = logprobs.put(rows, positions, scores)
    return state.replace(tokens=tokens, lengths=lengths, done=done, seen=seen, logprobs=logprobs)


def record_round(
    state: LoopState,
    *,
    active,
    width: int,
    counts,
    accepted,
    bad,
    menu_tree: bool = False,
    ranks=None,
) -> LoopState:
    """Counts one round of static `width` (0: a plain target step) in which each
    `active` row tested counts[b] drafts and accepted[b]; `bad` [B] flags NaN/inf.
    `menu_tree`: a tree round of `Auto`'s menu, counted in the tree's own counters
    (`GenerationStats.tree_accepted_at`, the last of `gamma_rounds`). `ranks`: a tree
    round's (tested, kept) children [B, D, K] by rank (`decode.tree.rank_counts`)."""
    s = state.stats
    on = active.astype(jnp.int32)
    ended = (accepted < counts)[:, None]
    positions = lambda counter: jnp.arange(counter.shape[1], dtype=jnp.int32)[None]  # noqa: E731

    def outcomes(kept, first_rejected):  # per position: accepted, and the first rejected
        at = positions(kept)
        kept = kept + (at < accepted[:, None]) * on[:, None]
        return kept, first_rejected + ((at == accepted[:, None]) & ended) * on[:, None]

    if menu_tree:
        kept, rejected = outcomes(s.tree_accepted_at, s.tree_rejected_at)
        per_position = dict(tree_accepted_at=kept, tree_rejected_at=rejected)
        width = s.gamma_rounds.shape[0] - 1
    else:
        kept, rejected = outcomes(s.accepted_at, s.rejected_at)
        drafted_at = s.drafted_at + (positions(s.drafted_at) < counts[:, None]) * on[:, None]
        per_position = dict(drafted_at=drafted_at, accepted_at=kept, rejected_at=rejected)
    if ranks is not None:
        tested, kept_rank = ranks
        on_ranks = on[:, None, None]
        per_position |= dict(
            rank_tested=s.rank_tested + tested * on_ranks,
            rank_kept=s.rank_kept + kept_rank * on_ranks,
        )
    stats = s.replace(
        **per_position,
        rounds=s.rounds + on,
        target_calls=s.target_calls + 1,
        drafted=s.drafted + counts * on,
        accepted=s.accepted + accepted * on,
        rejected=s.rejected + (accepted < counts) * on,
        gamma_rounds=s.gamma_rounds.at[width].add(1),
        slot_rounds=s.slot_rounds + active.shape[0],
        nonfinite=s.nonfinite | (active & bad),
    )
    return state.replace(
        stats=stats,
        round=state.round + 1,
        last_gamma=jnp.where(active, counts, state.last_gamma),
        last_accepted=jnp.where(active, accepted, state.last_accepted),
    )


def schedule_stats(state: LoopState, config: LoopConfig) -> ScheduleStats:
    """What a schedule sees before a round."""
    s = state.stats
    generated = state.generated
    return ScheduleStats(
        round=state.round,
        active=~state.done,
        generated=generated,
        remaining=jnp.where(state.done, 0, state.budgets - generated),
        rounds=s.rounds,
        drafted=s.drafted,
        accepted=s.accepted,
        rejected=s.rejected,
        accepted_at=s.accepted_at,
        rejected_at=s.rejected_at,
        tree_accepted_at=s.tree_accepted_at,
        tree_rejected_at=s.tree_rejected_at,
        last_gamma=state.last_gamma,
        last_accepted=state.last_accepted,
        auto=state.auto,
    )


def finish(state: LoopState, config: LoopConfig) -> GenerationOutput:
    """The generated tokens [B, max_new_tokens] (padded after each row's end)."""
    idx = jnp.arange(config.max_new_tokens, dtype=jnp.int32)
    generated = state.generated
    out = jnp.take_along_axis(state.tokens, state.prompt_lengths[:, None] + idx[None], axis=1)
    out = jnp.where(idx[None] < generated[:, None], out, config.pad_token_id)
    logprobs = state.logprobs
    if logprobs is not None:
        logprobs = logprobs.take(state.prompt_lengths[:, None] + idx[None])
    return GenerationOutput(tokens=out, lengths=generated, stats=state.stats, logprobs=logprobs)
