"""The program: prefill, then a `lax.while_loop` over rounds, all under one `jax.jit`
(with slots: each round followed by the refill of finished rows, `decode.slots`).

Its only static argument is the `LoopConfig`; weights, prompts and keys are arrays,
so calls with the same config and shapes reuse the compiled program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters.base import target_features
from jax_specdec.decode.logprobs import Logprobs, token_logprobs
from jax_specdec.decode.noise import choose, round_keys
from jax_specdec.decode.prefill import prefill_batch
from jax_specdec.decode.round import autoregressive_step, speculative_round, then_skipping
from jax_specdec.decode.slots import finish_slots, init_slots, refill, running
from jax_specdec.decode.state import LoopState, emit, finish, new_cache
from jax_specdec.decode.stats import GenerationOutput, init_stats, nonfinite
from jax_specdec.decode.tree_round import tree_round
from jax_specdec.penalties import Seen, adjust

__all__ = ["generate", "init_state"]


def init_state(
    target, draft, prompts, prompt_lengths, keys, budgets, sampling, config: LoopConfig
) -> LoopState:
    """Prefills the target (and the drafter) with the prompts [B, P] and emits each row's
    first token, drawn with fold_in(keys[b], 0) by the row's `sampling`."""
    batch, width = prompts.shape
    features = target_features(config.drafter)
    empty = new_cache(target.config, batch, config)
    last, target_cache, hidden = prefill_batch(
        target, prompts, prompt_lengths, empty, features=features
    )
    last = last[:, : config.vocab_size]
    draft_cache = None
    if config.drafter is not None:
        extra = {"features": hidden} if features else {}
        draft_cache = config.drafter.init(draft, prompts, prompt_lengths, config, **extra)
    seen = Seen.of(prompts, prompt_lengths, config.vocab_size) if sampling.plan.penalties else None
    adjusted = adjust(last, sampling, seen)
    first = choose(round_keys(keys, 0), adjusted, sampling.probs(adjusted), sampling)
    buffer_len = width + config.max_new_tokens + config.gamma_max + 1
    spec = config.logprobs
    logprobs = None if spec is None else Logprobs.empty(batch, buffer_len, spec.top)
    scores = token_logprobs(last[:, None], adjusted[:, None], first[:, None], sampling, spec)
    zeros = jnp.zeros((batch,), jnp.int32)
    state = LoopState(
        tokens=jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(prompts),
        lengths=prompt_lengths,
        prompt_lengths=prompt_lengths,
        budgets=budgets,
        keys=keys,
        sampling=sampling,
        target_cache=target_cache,
        draft_cache=draft_cache,
        done=jnp.zeros((batch,), bool),
        round=zeros,
        last_gamma=zeros,
        last_accepted=zeros,
        stats=init_stats(
            batch, config.gamma_max, nonfinite(last), config.tree_depth, config.tree_ranks
        ),
        seen=seen,
        logprobs=logprobs,
    )
    return emit(state, first[:, None], jnp.ones((batch,), jnp.int32), config, scores)


def _loop_body(target, draft, config: LoopConfig):
    if not config.speculative:
        body = functools.partial(autoregressive_step, target, config=config)
    elif config.tree is not None:
        body = functools.partial(tree_round, target, draft, config=config)
    else:
        body = functools.partial(speculative_round, target, draft, config=config)
        # Rounds may skip drafting: plain steps then, unless slots wait for a
        # finished row.
        if config.schedule.min_gamma == 0 and config.num_slots is None:
            body = then_skipping(body, target, draft, config)
    if config.num_slots is None:
        return body
    return lambda state: refill(target, draft, body(state), config)


@functools.partial(jax.jit, static_argnames="config")
def generate(
    target_state,
    draft_state,
    prompts,
    prompt_lengths,
    keys,
    budgets,
    sampling,
    auto=None,
    *,
    config: LoopConfig,
) -> GenerationOutput:
    """The whole generation as one XLA program.

    Args:
      target_state: the target's `nnx.State` (weights).
      draft_state: the draft model's `nnx.State`, or None.
      prompts: [B, P] int32, right-padded.
      prompt_lengths: [B] int32.
      keys: [B] jax keys, or their [B, 2] uint32 key data (as placed on a mesh).
      budgets: [B] int32, max_new_tokens per row (<= config.max_new_tokens); with
        slots, 0 marks padding rows after the real prompts.
      sampling: each row's sampling setting, a `RowSampling` [B] (its `SamplingPlan` is
        static: rows of any settings under one plan share the compiled program).
      auto: what `schedules.Auto` chooses from (`AutoInputs`: seconds per round of
        each width, prior acceptance per draft position); None for other schedules.
      config: the static `LoopConfig`.
    """
    if keys.dtype == jnp.uint32:
        keys = jax.random.wrap_key_data(keys)
    target = nnx.merge(config.target_def, target_state)
    draft = None if config.draft_def is None else nnx.merge(config.draft_def, draft_state)
    body = _loop_body(target, draft, config)
    if config.num_slots is not None:
        state = init_slots(target, draft, prompts, prompt_lengths, keys, budgets, sampling, config)
        state = state.replace(auto=auto)
        return finish_slots(jax.lax.while_loop(running, body, state), config)
    state = init_state(target, draft, prompts, prompt_lengths, keys, budgets, sampling, config)
    state = state.replace(auto=auto)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return finish(state, config)
