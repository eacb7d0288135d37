"""The program: prefill, then a `lax.while_loop` over rounds, all under one `jax.jit`.

Its only static argument is the `LoopConfig`; weights, prompts and keys are arrays,
so calls with the same config and shapes reuse the compiled program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafter import reads_features
from jax_specdec.decode.noise import choose, round_keys
from jax_specdec.decode.round import autoregressive_step, speculative_round, then_skipping
from jax_specdec.decode.state import LoopState, emit, finish, new_cache
from jax_specdec.decode.stats import GenerationOutput, init_stats, nonfinite
from jax_specdec.sampling import probs_from_logits

__all__ = ["generate", "init_state"]


def init_state(target, draft, prompts, prompt_lengths, keys, config: LoopConfig) -> LoopState:
    """Prefills the target (and the drafter) with the prompts [B, P] and emits each row's
    first token, drawn with fold_in(keys[b], 0)."""
    batch, width = prompts.shape
    features = reads_features(config.drafter)
    logits, target_cache, *hidden = target.decode(
        prompts, new_cache(target.config, batch, config), features=features
    )
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    last = last[:, : config.vocab_size]
    target_cache = target_cache.replace(lengths=prompt_lengths)
    draft_cache = None
    if config.drafter is not None:
        extra = {"features": hidden[0]} if features else {}
        draft_cache = config.drafter.init(draft, prompts, prompt_lengths, config, **extra)
    first = choose(
        round_keys(keys, 0), last, probs_from_logits(last, config.sampling), config.sampling
    )
    buffer_len = width + config.max_new_tokens + config.gamma_max + 1
    zeros = jnp.zeros((batch,), jnp.int32)
    state = LoopState(
        tokens=jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(prompts),
        lengths=prompt_lengths,
        prompt_lengths=prompt_lengths,
        keys=keys,
        target_cache=target_cache,
        draft_cache=draft_cache,
        done=jnp.zeros((batch,), bool),
        round=jnp.zeros((), jnp.int32),
        last_gamma=zeros,
        last_accepted=zeros,
        stats=init_stats(batch, config.gamma_max, nonfinite(last)),
    )
    return emit(state, first[:, None], jnp.ones((batch,), jnp.int32), config)


def _loop_body(target, draft, config: LoopConfig):
    if not config.speculative:
        return functools.partial(autoregressive_step, target, config=config)
    body = functools.partial(speculative_round, target, draft, config=config)
    # Rounds may skip drafting: plain steps then, unless the drafter reads the features
    # only the verify call gives.
    if config.schedule.min_gamma == 0 and not reads_features(config.drafter):
        body = then_skipping(body, target, config)
    return body


@functools.partial(jax.jit, static_argnames="config")
def generate(
    target_state, draft_state, prompts, prompt_lengths, keys, *, config: LoopConfig
) -> GenerationOutput:
    """The whole generation as one XLA program.

    Args:
      target_state: the target's `nnx.State` (weights).
      draft_state: the draft model's `nnx.State`, or None.
      prompts: [B, P] int32, right-padded.
      prompt_lengths: [B] int32.
      keys: [B] jax keys, or their [B, 2] uint32 key data (as placed on a mesh).
      config: the static `LoopConfig`.
    """
    if keys.dtype == jnp.uint32:
        keys = jax.random.wrap_key_data(keys)
    target = nnx.merge(config.target_def, target_state)
    draft = None if config.draft_def is None else nnx.merge(config.draft_def, draft_state)
    state = init_state(target, draft, prompts, prompt_lengths, keys, config)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), _loop_body(target, draft, config), state)
    return finish(state, config)
