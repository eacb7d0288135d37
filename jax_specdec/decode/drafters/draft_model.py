"""Drafting with a draft model: a fixed number of steps (`DraftModel`), or until the
draft's confidence falls below a threshold (`EarlyExit`).

The draft cache is valid below `lengths - 2` at the start of a round: the first draft
step feeds the row's last two tokens, re-writing an identical entry when only one is
new, so a fully accepted round (whose last draft the draft never saw) has the same
static shapes as any other. A round's entries are kept aside while drafting and
written after the round; a rejection is rolled back by the length alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_specdec.decode.drafters.base import DraftInputs, Proposal
from jax_specdec.decode.noise import choose
from jax_specdec.decode.prefill import prefill_batch, prefill_row
from jax_specdec.decode.state import gather_last, load_row, new_cache, pad_entries, written_after
from jax_specdec.decode.stats import nonfinite
from jax_specdec.nn import write_entries

__all__ = ["DraftModel", "EarlyExit"]


def _step(model, config, sampling, cache, recent, tokens, key):
    """One draft call on `tokens` with a read-only cache: x [B], q [B, V], the new entries,
    a NaN flag [B] and the draft's confidence in x (`_confidence`)."""
    width = tokens.shape[1]  # the first step feeds two: the LM head on the last only
    last = jnp.full(tokens.shape[:1], width - 1, jnp.int32) if width > 1 else None
    logits, keys, values = model.decode_entries(tokens, cache, recent, logits_at=last)
    logits = logits[:, -1, : config.vocab_size]
    bad = nonfinite(logits)
    logits = sampling.adjust(logits)  # the rows' bias and penalties (seen: `_count`)
    q = sampling.probs(logits)  # [B, V]
    x = choose(key, logits, q, sampling)
    conf = jnp.take_along_axis(_confidence(logits, q, sampling), x[:, None], axis=1)[:, 0]
    return x, q, (keys, values), bad, conf


def _count(sampling, x):
    """`sampling` with the drafted tokens x [B] counted as seen (for the next step's q)."""
    if sampling.seen is None:
        return sampling
    return sampling.replace(seen=sampling.seen.emit(x[:, None], jnp.ones_like(x)))


def _confidence(logits, q, sampling):
    """[B, V] q, or for a greedy row (q one-hot) the softmax of its raw logits."""
    if sampling.greedy:
        return jax.nn.softmax(logits, axis=-1)
    if not sampling.plan.any_greedy:
        return q
    greedy = (sampling.temperature == 0.0)[:, None]
    return jnp.where(greedy, jax.nn.softmax(logits, axis=-1), q)


def _first_step(model, config, cache, inputs: DraftInputs):
    """The first draft step: the row's last two tokens on the cache set to `lengths - 2`."""
    cache = cache.replace(lengths=inputs.lengths - 2)
    last_two = gather_last(inputs.tokens, inputs.lengths, 2)
    return cache, _step(model, config, inputs.sampling, cache, None, last_two, inputs.keys[:, 0])


def _zero_entries(model, batch: int, size: int):
    c = model.config
    zeros = tuple(
        jnp.zeros((batch, size, c.num_kv_heads, c.head_dim), c.jnp_dtype)
        for _ in range(c.num_layers)
    )
    return zeros, zeros


def _catch_up(model, cache, tokens, lengths, needed):
    """Brings the cache to `lengths - 2` valid positions in the rows where `needed`:
    after rounds that did not draft (γ = 0), or from empty (no draft prefill). Feeds
    chunks of 32 tokens while a row is 16 or more behind, then of 4; a no-op check when
    nothing is behind."""
    goal = jnp.where(needed, lengths - 2, 0)
    width = tokens.shape[1]

    def feed(chunk):
        def body(cache):
            idx = cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)
            chunk_tokens = jnp.take_along_axis(tokens, jnp.minimum(idx, width - 1), axis=1)
            _, new = model.decode(chunk_tokens, cache)  # only the cache: no LM head compiled
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


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """γ draft steps per round, each token sampled from the draft's q (argmax if greedy).

    Attributes:
      catch_up: the schedule may skip drafting (γ = 0), so the cache may lag: start
        without a draft prefill and catch up before a round that drafts.
    """

    catch_up: bool = False

    def init(self, model, prompts, prompt_lengths, config):
        cache = new_cache(model.config, prompts.shape[0], config)
        if self.catch_up:
            return cache
        return prefill_batch(model, prompts, prompt_lengths, cache, logits=False)[1]

    def load(self, model, cache, slot, prompt, prompt_length, config):
        if self.catch_up:  # filled by the catch-up before the row's first drafting round
            return cache.replace(lengths=cache.lengths.at[slot].set(0))
        _, row, _ = prefill_row(model, prompt, prompt_length[0], logits=False)
        return load_row(cache, row, slot, prompt_length[0])

    def prepare(self, model, cache, inputs: DraftInputs, config):
        if self.catch_up:
            needed = ~inputs.done & (inputs.want > 0)
            cache = _catch_up(model, cache, inputs.tokens, inputs.lengths, needed)
        return cache, None, None

    def propose(self, model, cache, inputs: DraftInputs, prepared, width: int, config):
        batch = inputs.lengths.shape[0]
        if width == 0:
            entries = _zero_entries(model, batch, config.gamma_max + 1)
            return Proposal(
                jnp.zeros((batch, 0), jnp.int32), None, jnp.zeros((batch,), bool), entries
            )
        cache, (x, q, entries, bad, _) = _first_step(model, config, cache, inputs)
        xs, qs = [x], [q]
        sampling = inputs.sampling
        # Unrolled: γ is small, and a rolled loop cost more on CPU.
        for i in range(1, width):
            recent = (*entries, jnp.full_like(inputs.lengths, entries[0][0].shape[1]))
            sampling = _count(sampling, x)
            x, q, new, step_bad, _ = _step(
                model, config, sampling, cache, recent, x[:, None], inputs.keys[:, i]
            )
            entries = tuple(
                tuple(jnp.concatenate([a, b], axis=1) for a, b in zip(old, fresh, strict=True))
                for old, fresh in zip(entries, new, strict=True)
            )
            xs.append(x)
            qs.append(q)
            bad = bad | step_bad
        entries = pad_entries(entries, config.gamma_max + 1)
        return Proposal(jnp.stack(xs, axis=1), jnp.stack(qs, axis=1), bad, entries)

    def commit(self, cache, prepared, entries, before, after, width, config):
        # A round that drafted leaves the cache valid below `lengths - 2` (the accepted
        # drafts it saw are there); a γ = 0 round writes nothing and keeps it.
        drafted = width > 0
        start = jnp.where(drafted, before - 2, cache.max_len)
        cache = write_entries(cache, *entries, written_after(start, after))
        return cache.replace(lengths=jnp.where(drafted, after - 2, cache.lengths))


@dataclasses.dataclass(frozen=True)
class EarlyExit(DraftModel):
    """Up to γ_max draft steps in an early-exit loop: a row stops after a token to which
    the draft gave probability below `threshold` (that token is still verified).

    Exact: whether position i+1 is drafted depends only on tokens already drafted, each
    verified against the q it was drawn from.
    """

    threshold: float = 0.4

    def prepare(self, model, cache, inputs: DraftInputs, config):
        cache, _, _ = super().prepare(model, cache, inputs, config)
        drafted, probs, counts, entries, bad = self._draft_until(model, cache, inputs, config)
        return cache, (drafted, probs, entries, bad), counts

    def propose(self, model, cache, inputs: DraftInputs, prepared, width: int, config):
        drafted, probs, _, bad = prepared
        return Proposal(drafted[:, :width], probs[:, :width], bad)

    def commit(self, cache, prepared, entries, before, after, width, config):
        return super().commit(cache, None, prepared[2], before, after, width, config)

    def _draft_until(self, model, cache, inputs: DraftInputs, config):
        """Returns drafted [B, γ_max], q [B, γ_max, V], counts [B], entries (γ_max + 1
        per layer, for positions lengths - 2 …) and a NaN flag [B]."""
        batch, gamma_max = inputs.keys.shape
        cache, (x, q, entries, bad, conf) = _first_step(model, config, cache, inputs)
        entries = pad_entries(entries, gamma_max + 1)
        drafted = jnp.zeros((batch, gamma_max), jnp.int32).at[:, 0].set(x)
        probs = jnp.zeros((batch, gamma_max, q.shape[-1]), jnp.float32).at[:, 0].set(q)
        carry = _Carry(
            jnp.int32(1),
            x,
            drafted,
            probs,
            entries,
            conf >= self.threshold,
            jnp.ones((batch,), jnp.int32),
            bad,
            _count(inputs.sampling, x),
        )

        def cond(c: _Carry):
            return (c.i < gamma_max) & jnp.any(c.going & ~inputs.done)

        def body(c: _Carry):
            key = jax.lax.dynamic_index_in_dim(inputs.keys, c.i, axis=1, keepdims=False)
            recent = (*c.entries, jnp.full_like(inputs.lengths, c.i + 1))
            x, q, new, step_bad, conf = _step(
                model, config, c.sampling, cache, recent, c.x[:, None], key
            )
            put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, c.i + 1, axis=1)  # noqa: E731
            return _Carry(
                i=c.i + 1,
                x=x,
                drafted=jax.lax.dynamic_update_index_in_dim(c.drafted, x, c.i, axis=1),
                probs=jax.lax.dynamic_update_index_in_dim(c.probs, q, c.i, axis=1),
                entries=jax.tree.map(put, c.entries, new),
                going=c.going & (conf >= self.threshold),
                counts=c.counts + c.going,
                bad=c.bad | (c.going & step_bad),
                sampling=_count(c.sampling, x),
            )

        c = jax.lax.while_loop(cond, body, carry)
        return c.drafted, c.probs, c.counts, c.entries, c.bad


class _Carry(NamedTuple):
    """The early-exit draft loop's carry."""

    i: jax.Array  # [] next draft position
    x: jax.Array  # [B] the last drafted token
    drafted: jax.Array  # [B, γ_max]
    probs: jax.Array  # [B, γ_max, V]
    entries: tuple  # per layer (keys, values) [B, γ_max + 1, K, hd]
    going: jax.Array  # [B] still drafting
    counts: jax.Array  # [B] tokens drafted
    bad: jax.Array  # [B] NaN/inf met
    sampling: Any  # the rows' `RowSampling`, the drafts so far counted as seen
