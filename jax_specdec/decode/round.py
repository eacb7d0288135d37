"""One round of the loop: speculative (schedule → drafter → verify → cache writes) or a
plain target step (autoregressive decoding, and batch-wide γ = 0 rounds).

A speculative round runs as wide as its widest active row, picked by `lax.switch`
among statically shaped rounds (w = 0 … γ_max), so a w = 2 round costs a w = 2 round.
Inside the switch both caches are only read; the round's new entries come out of it
and are written after, so XLA never copies a cache (a cache that is an output of a
conditional would be copied every round).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters.base import DraftInputs, reads_features, target_features
from jax_specdec.decode.logprobs import token_logprobs
from jax_specdec.decode.noise import choose, draw, round_keys, round_noise
from jax_specdec.decode.state import (
    LoopState,
    drafter_sampling,
    emit,
    gather_last,
    pad_entries,
    record_round,
    schedule_stats,
    written_after,
)
from jax_specdec.decode.stats import nonfinite
from jax_specdec.decode.tree_accept import accept_tree
from jax_specdec.decode.tree_round import tree_noise, walked_tree
from jax_specdec.decode.verify import verify
from jax_specdec.nn import write_entries
from jax_specdec.penalties import adjust

__all__ = ["autoregressive_step", "speculative_round", "then_skipping"]


def _widest(counts, active, gamma_max: int):
    return jnp.clip(jnp.max(jnp.where(active, counts, 0)), 0, gamma_max)


def _round_widths(config: LoopConfig, fixed: bool) -> tuple[int, ...]:
    """The widths compiled as branches of the round's switch, increasing, ending at γ_max.

    Every branch is a full target verify to compile (30 unrolled layers on SmolLM2), so a
    model-free drafter under a constant schedule gets only 0 and γ_max: every row asks for
    γ_max and is cut short only where the drafter cannot propose (n-gram: no match, or a
    match that ends within γ of the history's end, which is rare). A round then runs at
    the smallest width that holds its widest row; rows test only their own drafts, so the
    output does not depend on the widths compiled."""
    if fixed and config.draft_def is None:
        return (0, config.gamma_max)
    menu = tuple(getattr(config.schedule, "widths", ()))  # a schedule with a menu (Auto)
    if menu[:1] == (0,) and menu[-1:] == (config.gamma_max,):
        return menu
    return tuple(range(config.gamma_max + 1))


def speculative_round(target, draft, state: LoopState, config: LoopConfig) -> LoopState:
    """One round: the schedule picks each row's γ, the drafter proposes (capped by what
    it can propose), the target verifies as wide as the widest active row."""
    drafter, schedule, gamma_max = config.drafter, config.schedule, config.gamma_max
    noise = round_noise(state.keys, state.round + 1, gamma_max, state.sampling)
    active = ~state.done
    gammas = jnp.where(active, schedule(schedule_stats(state, config)), 0)
    if config.menu_tree is not None:  # `Auto`'s tree: γ_max + 1, the whole batch's round
        tree_chosen = jnp.any(gammas > gamma_max)
        gammas = jnp.minimum(gammas, gamma_max)
    fixed = schedule.min_gamma == schedule.max_gamma  # static: a constant γ
    want = jnp.int32(gamma_max) if fixed else _widest(gammas, active, gamma_max)
    inputs = DraftInputs(
        state.tokens, state.lengths, state.done, noise.draft_keys, want, drafter_sampling(state)
    )
    draft_cache, prepared, cap = drafter.prepare(draft, state.draft_cache, inputs, config)
    counts = gammas if cap is None else jnp.minimum(gammas, cap)
    target_cache = state.target_cache
    light = state.replace(target_cache=None, draft_cache=None)

    def round_of_width(w, light):
        proposal = drafter.propose(draft, draft_cache, inputs, prepared, w, config)
        light, entries, features = verify(
            target, target_cache, light, proposal, counts, noise, config
        )
        return light, entries, proposal.entries, features

    if fixed and cap is None:
        width = gamma_max
        light, target_entries, draft_entries, features = round_of_width(gamma_max, light)
    else:
        widest = want if cap is None else _widest(counts, active, gamma_max)
        widths = _round_widths(config, fixed)
        index = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < widest).astype(jnp.int32)
        branches = [functools.partial(round_of_width, w) for w in widths]
        if config.menu_tree is not None:
            index = jnp.where(tree_chosen, len(widths), index)
            widths += (config.menu_tree.depth,)
            tree = functools.partial(_menu_tree, target, draft, target_cache, draft_cache)
            branches.append(functools.partial(tree, prepared=prepared, config=config))
        width = jnp.asarray(widths, jnp.int32)[index]
        light, target_entries, draft_entries, features = jax.lax.switch(index, branches, light)

    before, after = state.lengths, light.lengths
    target_cache = write_entries(target_cache, *target_entries, written_after(before - 1, after))
    extra = {"features": features} if reads_features(drafter) else {}
    draft_cache = drafter.commit(
        draft_cache, prepared, draft_entries, before, after, width, config, **extra
    )
    return light.replace(
        target_cache=target_cache.replace(lengths=after - 1), draft_cache=draft_cache
    )


def _menu_tree(target, draft, target_cache, draft_cache, light, *, prepared, config):
    """The tree round of `Auto`'s menu as a branch of the round's switch: its outputs
    shaped as a chain round's (entries and features padded to γ_max + 1; no draft
    entries: a drafter that builds trees keeps none)."""
    rule = config.menu_acceptance or accept_tree
    tree_config = dataclasses.replace(config, tree=config.menu_tree, acceptance=rule)
    noise = tree_noise(light, tree_config)
    light, walked, features = walked_tree(
        target, draft, target_cache, draft_cache, light, prepared, noise, tree_config, menu=True
    )
    size = config.gamma_max + 1
    if features is not None:
        features = jnp.pad(features, ((0, 0), (0, size - features.shape[1]), (0, 0)))
    return light, pad_entries(walked, size), None, features


def _plain_step(target, state: LoopState, config: LoopConfig, pick, draft=None) -> LoopState:
    """One target step on the pending token, its cache written in place: `pick(logits,
    probs)` chooses each row's token. Counted as a round of width 0. A drafter that
    reads features (then `draft` is its model) absorbs the step's."""
    pending = gather_last(state.tokens, state.lengths, 1)
    cache = state.target_cache.replace(lengths=state.lengths - 1)
    absorbs = draft is not None and reads_features(config.drafter)
    wanted = target_features(config.drafter) if absorbs else False
    logits, cache, *features = target.decode(pending, cache, features=wanted)
    logits = logits[:, 0, : config.vocab_size]
    bad = nonfinite(logits)
    adjusted = adjust(logits, state.sampling, state.seen)
    token = pick(adjusted, state.sampling.probs(adjusted))
    scores = token_logprobs(
        logits[:, None], adjusted[:, None], token[:, None], state.sampling, config.logprobs
    )
    active = ~state.done
    ones = jnp.ones_like(state.lengths)
    before = state.lengths
    state = emit(state.replace(target_cache=cache), token[:, None], ones, config, scores)
    if absorbs:
        draft_cache = config.drafter.absorb(
            draft, state.draft_cache, state.tokens, before, state.lengths, features[0]
        )
        state = state.replace(draft_cache=draft_cache)
    none = jnp.zeros_like(state.lengths)
    return record_round(state, active=active, width=0, counts=none, accepted=none, bad=bad)


def autoregressive_step(target, state: LoopState, config: LoopConfig) -> LoopState:
    """One token per row, drawn with fold_in(keys[b], round)."""
    keys = round_keys(state.keys, state.round + 1)
    pick = lambda logits, probs: choose(keys, logits, probs, state.sampling)  # noqa: E731
    return _plain_step(target, state, config, pick)


def _skipped_round(target, draft, state: LoopState, config: LoopConfig) -> LoopState:
    """A round of width 0 for the whole batch, as a plain step: the same draw as `verify`
    at width 0 (the round's `draws`), so a row's tokens do not depend on whether its
    neighbours drafted."""
    draws = round_noise(state.keys, state.round + 1, config.gamma_max, state.sampling).draws
    pick = lambda logits, probs: draw(draws, logits, probs, state.sampling)  # noqa: E731
    return _plain_step(target, state, config, pick, draft)


def then_skipping(round_fn, target, draft, config: LoopConfig):
    """`round_fn`, then plain steps for as long as the schedule asks every active row for
    γ = 0: a batch-wide γ = 0 then costs an autoregressive step, without the round's
    switch, catch-up check and entries written after it (a drafter that reads features
    absorbs each step's, `Drafter.absorb`)."""

    def skipping(state):
        gammas = config.schedule(schedule_stats(state, config))
        return ~jnp.all(state.done) & ~jnp.any(~state.done & (gammas > 0))

    step = functools.partial(_skipped_round, target, draft, config=config)
    return lambda state: jax.lax.while_loop(skipping, step, round_fn(state))
