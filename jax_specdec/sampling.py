"""Sampling transforms: logits -> the float32 distribution that tokens are drawn from.

Speculative decoding is exact only when the target's p and the draft's q come out
of the *same* transforms, so every sampling path in the library goes through
`probs_from_logits`. The transforms are applied in this order:

1. temperature: logits / temperature (temperature 0 means greedy, see below);
2. top-k: keep the tokens whose logit is >= the k-th largest logit (ties at the
   boundary are all kept, so the result never depends on sort order);
3. top-p (nucleus): on the softmax of what top-k kept, keep the smallest set of
   most probable tokens whose mass reaches top_p; every token tied with the
   least probable kept token is kept too;
4. min-p: keep the tokens whose probability is at least min_p times the most probable
   token's (as `transformers`' MinPLogitsWarper and vLLM, after top-k and top-p);
5. softmax of the kept logits, renormalised, in float32.

Greedy (temperature 0) is one-hot on the argmax of the raw logits, the lowest
index winning ties; top-k and top-p do not change an argmax.

Before them, a row's logit bias and its repetition, presence and frequency penalties
change the logits (`jax_specdec.penalties`): the penalties depend on the tokens before
the position, so only the generation loop, which knows them, applies them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_specdec.penalties import adjust, bias_pairs

__all__ = [
    "RowSampling",
    "SamplingConfig",
    "SamplingPlan",
    "probs_from_logits",
    "sample",
    "sample_with_uniforms",
]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are sampled; hashable, so it can be a static argument of `jax.jit`.

    Attributes:
      temperature: >= 0; 0 means greedy (argmax, lowest index on ties).
      top_k: >= 0; 0 means off.
      top_p: in (0, 1]; 1.0 means off.
      min_p: in [0, 1); 0.0 means off.
      repetition_penalty: > 0; 1.0 means off (`transformers`' multiplicative penalty on
        the tokens of the prompt and the output so far).
      presence_penalty, frequency_penalty: finite, in [-2, 2] as the OpenAI API's; 0.0
        means off (subtracted once for a token generated before / per time it was).
      logit_bias: (token id, bias) pairs, ids distinct and >= 0, biases finite in
        [-100, 100]; a dict {id: bias} is accepted and stored as sorted pairs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if math.isinf(t):
            raise ValueError(f"temperature must be finite, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {p!r}")
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 <= m < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0.0 = off), got {m!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "min_p", float(m))
        r = self.repetition_penalty
        if not _number(r) or not (0.0 < r < math.inf):
            raise ValueError(f"repetition_penalty must be a number > 0 (1.0 = off), got {r!r}")
        object.__setattr__(self, "repetition_penalty", float(r))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2] (0.0 = off), got {v!r}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))

    @property
    def penalised(self) -> bool:
        """Whether a penalty depending on the tokens before is on (not the logit bias)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: jax.Array, config: SamplingConfig = SamplingConfig()) -> jax.Array:
    """Maps logits [..., V] (any float dtype, e.g. bfloat16) to float32 probabilities [..., V].

    Args:
      logits: raw model outputs, [..., V].
      config: the sampling transforms; a static Python value.

    Returns:
      float32 probabilities [..., V] summing to 1 over the last axis.

    Raises:
      ValueError: `config` has a repetition, presence or frequency penalty, which depends
        on the tokens before the position (the generation loop applies those).
    """
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    if config.penalised:
        raise ValueError(
            "probs_from_logits has no tokens to count: repetition, presence and frequency "
            "penalties are applied by the generation loop (jax_specdec.penalties.adjust)"
        )
    logits = _checked_logits(logits)
    if config.logit_bias:
        ids, values = zip(*config.logit_bias, strict=True)
        logits = logits.at[..., list(ids)].add(jnp.asarray(values, jnp.float32), mode="drop")
    return _one_setting(logits, config)


@functools.partial(jax.jit, static_argnames="config")
def _one_setting(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """`_transform` with every row at `config` (one program per shape when called eagerly)."""
    one = lambda value, dtype: jnp.full((1,) * logits.ndim, value, dtype)  # noqa: E731
    rows = (
        one(config.temperature, jnp.float32),
        one(config.top_k, jnp.int32),
        one(config.top_p, jnp.float32),
        one(config.min_p, jnp.float32),
    )
    return _transform(logits, rows, SamplingPlan.of([config]))


def _checked_logits(logits) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    return logits.astype(jnp.float32)


def _transform(logits: jax.Array, rows, plan: SamplingPlan) -> jax.Array:
    """The transforms of the module docstring on float32 logits [..., V] with each row's
    (temperature, top_k, top_p, min_p) broadcastable to [..., 1]; `plan` says statically which
    of them any row uses, so a program of greedy rows computes only an argmax."""
    vocab = logits.shape[-1]
    greedy = _argmax_one_hot(logits)
    if plan.greedy:
        return greedy
    temperature, top_k, top_p, min_p = rows
    is_greedy = temperature == 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, temperature)
    largest = min(plan.top_k, vocab)
    if largest > 0:
        top = jax.lax.top_k(scaled, largest)[0]  # [..., k] descending
        k = jnp.broadcast_to(top_k, top.shape[:-1] + (1,))
        kth = jnp.take_along_axis(top, jnp.clip(k - 1, 0, largest - 1), axis=-1)
        filters = (k > 0) & (k < vocab)
        scaled = jnp.where(filters & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if plan.top_p:
        probs = _nucleus(probs, top_p)
    if plan.min_p:
        kept = jnp.where(probs >= min_p * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)
        probs = jnp.where(min_p > 0.0, kept / jnp.sum(kept, axis=-1, keepdims=True), probs)
    if plan.any_greedy:
        probs = jnp.where(is_greedy, greedy, probs)
    return probs


def _argmax_one_hot(logits: jax.Array) -> jax.Array:
    """One-hot [..., V] on the argmax, the lowest index winning ties (NaN logits: the last
    index): a max and a min over V, 7x cheaper on a CPU than `argmax` + `one_hot`."""
    vocab = logits.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    top = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, iota, vocab - 1), axis=-1, keepdims=True)
    return (iota == first).astype(jnp.float32)


def _nucleus(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-p on probs [..., V] for rows whose top_p < 1 (the others are kept as they are):
    the smallest set of most probable tokens whose mass reaches top_p, ties with the least
    probable kept token kept, renormalised.

    That set is {p >= τ} for τ the largest float v with mass(p >= v) >= top_p, found by
    bisection on the bits of v (non-negative floats order as their int32 bits): 31
    masked sums over V instead of a sort (a sort cost 27x more on a CPU at V = 4,096,
    and sorts are slow on TPUs too)."""
    bits = lambda v: jax.lax.bitcast_convert_type(v, jnp.int32)  # noqa: E731
    mass = lambda v: jnp.sum(jnp.where(probs >= v, probs, 0.0), axis=-1, keepdims=True)  # noqa: E731

    def halve(_, bounds):  # mass(p >= lo) >= top_p > mass(p >= hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = mass(jax.lax.bitcast_convert_type(mid, jnp.float32)) >= top_p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    hi = bits(jnp.max(probs, axis=-1, keepdims=True)) + 1
    lo, _ = jax.lax.fori_loop(0, 31, halve, (jnp.zeros_like(hi), hi))
    kept = jnp.where(probs >= jax.lax.bitcast_convert_type(lo, jnp.float32), probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    return jnp.where(top_p < 1.0, kept, probs)


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """Which transforms any row of a program uses: the static part of per-row sampling
    (`RowSampling`), so rows of several settings share one compiled program.

    Attributes:
      greedy: every row is greedy (nothing is drawn; an argmax is all that is computed).
      any_greedy: some row is greedy.
      top_k: the largest top-k of any row (0: no row uses top-k).
      top_p: some row uses top-p.
      min_p: some row uses min-p.
      penalties: some row uses a repetition, presence or frequency penalty (the loop
        then keeps count of the tokens seen, `penalties.Seen`).
      bias: the most logit-bias entries of any row (0: none).
    """

    greedy: bool
    any_greedy: bool
    top_k: int
    top_p: bool
    min_p: bool = False
    penalties: bool = False
    bias: int = 0

    @classmethod
    def of(cls, settings) -> SamplingPlan:
        """The plan of a sequence of `SamplingConfig`s."""
        return cls(
            greedy=all(s.greedy for s in settings),
            any_greedy=any(s.greedy for s in settings),
            top_k=max(0 if s.greedy else s.top_k for s in settings),
            top_p=any(not s.greedy and s.top_p < 1.0 for s in settings),
            min_p=any(not s.greedy and s.min_p > 0.0 for s in settings),
            penalties=any(s.penalised for s in settings),
            bias=max((len(s.logit_bias) for s in settings), default=0),
        )

    def covers(self, other: SamplingPlan) -> bool:
        """Whether rows of plan `other` can run under this one (with the same tokens)."""
        if self.greedy:
            return (
                other.greedy and self.bias >= other.bias and (self.penalties or not other.penalties)
            )
        return (
            (self.any_greedy or not other.any_greedy)
            and self.top_k >= other.top_k
            and (self.top_p or not other.top_p)
            and (self.min_p or not other.min_p)
            and (self.penalties or not other.penalties)
            and self.bias >= other.bias
        )


@struct.dataclass
class RowSampling:
    """Each row's sampling setting as arrays [B] (a pytree; `plan` is its static part).

    A row gets exactly the probabilities `probs_from_logits` gives for its own
    `SamplingConfig`, whatever its neighbours ask for: every transform is applied per row,
    and one a row does not use leaves its probabilities as they are.

    Attributes:
      temperature: [B] float32, 0 for a greedy row.
      top_k: [B] int32, 0 off.
      top_p: [B] float32, 1 off.
      min_p: [B] float32, 0 off.
      repetition_penalty: [B] float32, 1 off.
      presence_penalty, frequency_penalty: [B] float32, 0 off.
      bias_ids: [B, K] int32, each row's logit-bias ids (-1 pads; K = `plan.bias`).
      bias_values: [B, K] float32, their biases.
      plan: the `SamplingPlan` of the rows (static).
      seen: the rows' `penalties.Seen` (the tokens before their next position), as the
        loop hands it to a drafter; None: no count of them (their penalties unapplied).
      stop_tokens: [B, S, M] int32, each row's stop sequences (`decode.stop_tokens`:
        right-aligned, -1 pads); None: none (`with_stops`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    plan: SamplingPlan = struct.field(pytree_node=False)
    seen: Any = None
    stop_tokens: Any = None

    @classmethod
    def of(cls, settings, plan: SamplingPlan | None = None) -> RowSampling:
        """Host arrays (numpy) of a sequence of B `SamplingConfig`s, under `plan` (one
        plan for every call of a job keeps it one program) or their own."""
        settings = list(settings)
        for b, s in enumerate(settings):
            if not isinstance(s, SamplingConfig):
                raise TypeError(f"sampling[{b}] must be a SamplingConfig, got {type(s).__name__}")
        own = SamplingPlan.of(settings)
        if plan is not None and not plan.covers(own):
            raise ValueError(f"plan {plan} does not cover these rows' settings ({own})")
        plan = own if plan is None else plan
        ids = np.full((len(settings), plan.bias), -1, np.int32)
        values = np.zeros((len(settings), plan.bias), np.float32)
        for b, s in enumerate(settings):
            for k, (token, bias) in enumerate(s.logit_bias):
                ids[b, k], values[b, k] = token, bias
        column = lambda name, dtype: np.array([getattr(s, name) for s in settings], dtype)  # noqa: E731
        return cls(
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            min_p=column("min_p", np.float32),
            repetition_penalty=column("repetition_penalty", np.float32),
            presence_penalty=column("presence_penalty", np.float32),
            frequency_penalty=column("frequency_penalty", np.float32),
            bias_ids=ids,
            bias_values=values,
            plan=plan,
        )

    @property
    def greedy(self) -> bool:
        """Every row is greedy (static)."""
        return self.plan.greedy

    def probs(self, logits: jax.Array) -> jax.Array:
        """Float32 probabilities [B, ..., V] of logits [B, ..., V], row b by its setting."""
        logits = _checked_logits(logits)
        shape = (-1,) + (1,) * (logits.ndim - 1)
        arrays = (self.temperature, self.top_k, self.top_p, self.min_p)
        rows = tuple(a.reshape(shape) for a in arrays)
        return _transform(logits, rows, self.plan)

    def adjust(self, logits: jax.Array) -> jax.Array:
        """Logits [B, V] or [B, T, V] with each row's logit bias and, where `seen` is set,
        its penalties for the tokens seen (`penalties.adjust`; no drafts counted): what
        a drafter's q is computed from."""
        if not self.plan.bias and (self.seen is None or not self.plan.penalties):
            return logits
        seen = self.seen if self.plan.penalties else None
        return adjust(logits, self if seen is not None else _without_penalties(self), seen)

    def with_stops(self, stop_tokens) -> RowSampling:
        """The same rows, ending at their stop sequences [B, S, M] (`decode.stop_tokens`)."""
        return self.replace(stop_tokens=stop_tokens)

    def at(self, index) -> RowSampling:
        """The rows at `index` (an int array or slice), same plan."""
        return jax.tree.map(lambda a: a[index], self)


def _without_penalties(rows: RowSampling) -> RowSampling:
    """`rows` under a plan that applies only their logit bias."""
    return rows.replace(plan=dataclasses.replace(rows.plan, penalties=False))


def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row from probs [B, V] with keys [B], by inverse CDF: int32 [B].

    One uniform per row (cheaper than Gumbel-max's V draws, which matters in the
    draft's inner loop). See `sample_with_uniforms`.
    """
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # [B]
    return sample_with_uniforms(u, probs)


def sample_with_uniforms(uniforms: jax.Array, weights: jax.Array) -> jax.Array:
    """Inverse CDF with the randomness given: for each row the first index with weight
    whose cumulative weight exceeds u * total, int32 [B]. uniforms [B] in [0, 1); weights
    [B, V] >= 0, not necessarily normalised (a residual max(0, p - q) is drawn from as
    it is).

    A token with zero weight is never drawn, whatever order XLA sums the cumulative
    weights in; if u * total is not below the total, the last index with weight is
    taken. u = 0 gives the first index with weight (the argmax of a one-hot). The
    uniforms are float32, so a token's probability is resolved to about 6e-8 of the
    total (as `sample` draws).
    """
    weights = weights.astype(jnp.float32)
    cdf = jnp.cumsum(weights, axis=-1)  # [B, V]
    threshold = (uniforms.astype(jnp.float32) * cdf[:, -1])[:, None]
    hit = (cdf > threshold) & (weights > 0)
    index = jnp.arange(weights.shape[-1], dtype=jnp.int32)
    last = jnp.maximum(jnp.max(jnp.where(weights > 0, index, -1), axis=-1), 0)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last).astype(jnp.int32)
