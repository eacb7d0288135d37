"""Slots: N prompts through S < N rows of the loop, each row refilled as it finishes.

The loop's rows are *slots*. After every round, slots whose row is done hand their
tokens and counters to the output (`retire`), and free slots take the next waiting
prompts (`load`): the prompt is prefilled, in chunks of `prefill.PREFILL_CHUNK` tokens,
into a fresh one-row cache whose entries
overwrite the slot's row of the big cache (nothing of the big cache is read or
copied), the drafter resets its row, and the first token is drawn with
fold_in(key, 0). A prompt keeps its own key and counts its rounds from its start, so
its tokens are those it gets alone, in any slot, beside any neighbours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters.base import reads_features, target_features
from jax_specdec.decode.logprobs import Logprobs, token_logprobs
from jax_specdec.decode.noise import choose, round_keys
from jax_specdec.decode.prefill import prefill_row
from jax_specdec.decode.state import LoopState, emit, load_row, new_cache
from jax_specdec.decode.stats import (
    ROW_FIELDS,
    GenerationOutput,
    GenerationStats,
    init_stats,
    nonfinite,
)
from jax_specdec.nn.transformer import feature_size
from jax_specdec.penalties import Seen, adjust
from jax_specdec.sampling import RowSampling

__all__ = ["Queue", "finish_slots", "init_slots", "refill", "running"]


@struct.dataclass
class Queue:
    """The prompts of a slotted run and their outputs (N rows, padded to a bucket).

    Attributes:
      prompts: [N, P] int32, right-padded.
      prompt_lengths: [N] int32.
      keys: [N] jax keys, one per prompt.
      sampling: [N] each prompt's sampling setting (`RowSampling`).
      budgets: [N] int32, max_new_tokens per prompt; 0 marks a padding row.
      next: [] int32, the next prompt to load (prompts load in order).
      row: [S] int32, the prompt each slot holds (-1: free).
      tokens: [N, max_new_tokens] int32, finished prompts' tokens (pad after the end).
      lengths: [N] int32, tokens generated per finished prompt.
      stats: `GenerationStats` whose per-row counters are per prompt.
      logprobs: [N, max_new_tokens] finished prompts' `Logprobs`, or None.
    """

    prompts: jax.Array
    prompt_lengths: jax.Array
    keys: jax.Array
    sampling: RowSampling
    budgets: jax.Array
    next: jax.Array
    row: jax.Array
    tokens: jax.Array
    lengths: jax.Array
    stats: GenerationStats
    logprobs: Logprobs | None = None

    @property
    def count(self) -> jax.Array:
        """[] the real prompts (padding rows have budget 0 and come last)."""
        return jnp.sum(self.budgets > 0).astype(jnp.int32)


def init_slots(
    target, draft, prompts, prompt_lengths, keys, budgets, sampling, config
) -> LoopState:
    """S free slots and the queue of all prompts, then the first S loaded."""
    slots, width = config.num_slots, prompts.shape[1]
    n, buffer_len = prompts.shape[0], width + config.max_new_tokens + config.gamma_max + 1
    ints = jnp.zeros((slots,), jnp.int32)
    draft_cache = None
    if config.drafter is not None:  # an empty cache of the drafter's shape
        draft_cache = _empty_draft_cache(target, draft, slots, config)
    queue = Queue(
        prompts=prompts,
        prompt_lengths=prompt_lengths,
        keys=keys,
        sampling=sampling,
        budgets=budgets,
        next=jnp.zeros((), jnp.int32),
        row=jnp.full((slots,), -1, jnp.int32),
        tokens=jnp.full((n, config.max_new_tokens), config.pad_token_id, jnp.int32),
        lengths=jnp.zeros((n,), jnp.int32),
        stats=init_stats(
            n, config.gamma_max, jnp.zeros((n,), bool), config.tree_depth, config.tree_ranks
        ),
        logprobs=_no_logprobs(config, n, config.max_new_tokens),
    )
    state = LoopState(
        tokens=jnp.zeros((slots, buffer_len), jnp.int32),
        lengths=ints + 1,
        prompt_lengths=ints + 1,
        budgets=ints,
        keys=keys[:slots],
        sampling=sampling.at(slice(0, slots)),
        target_cache=new_cache(target.config, slots, config),
        draft_cache=draft_cache,
        done=jnp.ones((slots,), bool),
        round=ints,
        last_gamma=ints,
        last_accepted=ints,
        stats=init_stats(
            slots, config.gamma_max, jnp.zeros((slots,), bool), config.tree_depth, config.tree_ranks
        ).replace(target_calls=jnp.zeros((), jnp.int32)),
        queue=queue,
        seen=Seen.empty(slots, config.vocab_size) if sampling.plan.penalties else None,
        logprobs=_no_logprobs(config, slots, buffer_len),
    )
    return refill(target, draft, state, config)


def _no_logprobs(config: LoopConfig, rows: int, length: int) -> Logprobs | None:
    spec = config.logprobs
    return None if spec is None else Logprobs.empty(rows, length, spec.top)


def _empty_draft_cache(target, draft, slots: int, config: LoopConfig):
    """The drafter's cache for S rows of a one-token dummy prompt (each slot's row is
    reset by `load` before use)."""
    dummy = jnp.zeros((slots, 1), jnp.int32)
    extra = {}
    if reads_features(config.drafter):
        size = feature_size(target.config, target_features(config.drafter))
        extra["features"] = jnp.zeros((slots, 1, size), jnp.float32)
    return config.drafter.init(draft, dummy, jnp.ones((slots,), jnp.int32), config, **extra)


def running(state: LoopState) -> jax.Array:
    """[] whether a slot still holds an unfinished prompt."""
    return jnp.any(state.queue.row >= 0)


def refill(target, draft, state: LoopState, config: LoopConfig) -> LoopState:
    """Retires the finished slots, then loads waiting prompts into free slots, one at a
    time, while there are both."""

    def more(state):
        q = state.queue
        return jnp.any(q.row < 0) & (q.next < q.count)

    body = lambda state: _retire(_load(target, draft, state, config))  # noqa: E731
    return jax.lax.while_loop(more, body, _retire(state))


def _load(target, draft, state: LoopState, config: LoopConfig) -> LoopState:
    """The next prompt into the first free slot: prefill, drafter reset, first token."""
    q = state.queue
    slot = jnp.argmax(q.row < 0).astype(jnp.int32)
    n = q.next
    prompt = jax.lax.dynamic_slice_in_dim(q.prompts, n, 1, axis=0)  # [1, P]
    length = jax.lax.dynamic_slice_in_dim(q.prompt_lengths, n, 1)  # [1]
    reads = reads_features(config.drafter)
    wanted = target_features(config.drafter)
    last, row, features = prefill_row(target, prompt, length[0], features=wanted)
    last = last[:, : config.vocab_size]  # [1, V]
    key = q.keys[n][None]
    sampling = q.sampling.at(n[None])
    seen = state.seen  # the slot's count starts again from its new prompt
    if seen is not None:
        seen = seen.reset(slot, prompt, length[0])
    one = None if seen is None else Seen.of(prompt, length, config.vocab_size)
    first_logits = adjust(last, sampling, one)
    first = choose(round_keys(key, 0), first_logits, sampling.probs(first_logits), sampling)
    scores = token_logprobs(
        last[:, None], first_logits[:, None], first[:, None], sampling, config.logprobs
    )
    draft_cache = state.draft_cache
    if config.drafter is not None:
        extra = {"features": features[:, : prompt.shape[1]]} if reads else {}
        draft_cache = config.drafter.load(draft, draft_cache, slot, prompt, length, config, **extra)
    state = state.replace(
        tokens=jax.lax.dynamic_update_slice(
            state.tokens, jnp.zeros((1, state.tokens.shape[1]), jnp.int32), (slot, 0)
        ),
        target_cache=load_row(state.target_cache, row, slot, length[0]),
        draft_cache=draft_cache,
        queue=q.replace(next=n + 1, row=q.row.at[slot].set(n)),
        seen=seen,
    )
    row = (prompt[0], length[0], q.budgets[n], q.keys[n], sampling)
    state = _reset_row(state, slot, row, last)
    here = jnp.arange(state.done.shape[0]) == slot
    if scores is not None:  # the slot's row; the others emit nothing
        scores = jax.tree.map(lambda a: jnp.broadcast_to(a, (here.shape[0],) + a.shape[1:]), scores)
    return emit(
        state, jnp.where(here, first[0], 0)[:, None], here.astype(jnp.int32), config, scores
    )


def _reset_row(state: LoopState, slot, row, last) -> LoopState:
    """Row `slot` of the state set to a new prompt `row` = (prompt [P], length, budget,
    key, sampling [1]), before its first token."""
    prompt, length, budget, key, sampling = row
    s = state.stats
    rows = {f: getattr(s, f).at[slot].set(0) for f in ROW_FIELDS if f != "nonfinite"}
    rows["nonfinite"] = s.nonfinite.at[slot].set(nonfinite(last)[0])
    return state.replace(
        tokens=jax.lax.dynamic_update_slice(state.tokens, prompt[None], (slot, 0)),
        lengths=state.lengths.at[slot].set(length),
        prompt_lengths=state.prompt_lengths.at[slot].set(length),
        budgets=state.budgets.at[slot].set(budget),
        keys=state.keys.at[slot].set(key),
        sampling=jax.tree.map(lambda a, b: a.at[slot].set(b[0]), state.sampling, sampling),
        done=state.done.at[slot].set(False),
        round=state.round.at[slot].set(0),
        last_gamma=state.last_gamma.at[slot].set(0),
        last_accepted=state.last_accepted.at[slot].set(0),
        stats=s.replace(**rows, target_calls=s.target_calls + 1),
    )


def _retire(state: LoopState) -> LoopState:
    """Finished slots hand their tokens and counters to their prompt's output row."""
    q = state.queue
    retiring = state.done & (q.row >= 0)
    to = jnp.where(retiring, q.row, q.tokens.shape[0])  # out of range: dropped
    width = q.tokens.shape[1]
    idx = jnp.arange(width, dtype=jnp.int32)
    generated = state.generated
    tokens = jnp.take_along_axis(state.tokens, state.prompt_lengths[:, None] + idx[None], axis=1)
    put = lambda out, new: out.at[to].set(new, mode="drop")  # noqa: E731
    stats = q.stats.replace(
        **{f: put(getattr(q.stats, f), getattr(state.stats, f)) for f in ROW_FIELDS}
    )
    logprobs = q.logprobs
    if logprobs is not None:
        new = state.logprobs.take(state.prompt_lengths[:, None] + idx[None])
        logprobs = jax.tree.map(put, logprobs, new)
    return state.replace(
        queue=q.replace(
            row=jnp.where(retiring, -1, q.row),
            tokens=put(q.tokens, tokens),
            lengths=put(q.lengths, generated),
            stats=stats,
            logprobs=logprobs,
        )
    )


def finish_slots(state: LoopState, config: LoopConfig) -> GenerationOutput:
    """The outputs of all N prompts; batch counters (target calls, widths, slot
    rounds) from the loop."""
    q, s = state.queue, state.stats
    stats = q.stats.replace(
        target_calls=s.target_calls, gamma_rounds=s.gamma_rounds, slot_rounds=s.slot_rounds
    )
    tokens = jnp.where(
        jnp.arange(q.tokens.shape[1])[None] < q.lengths[:, None], q.tokens, config.pad_token_id
    )
    return GenerationOutput(tokens=tokens, lengths=q.lengths, stats=stats, logprobs=q.logprobs)
