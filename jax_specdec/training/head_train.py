"""Training a drafter head on a frozen target's features (`training.head_data`): a
feature head (`FeatureHead`) or an EAGLE-3 head (`Eagle3Head`).

Entry i of a window feeds (the target's feature before token i, x_i) and is trained to
give the target's next-token distribution at i, restricted to the kept tokens
(cross-entropy against the softmax of the target's own output rows at f_i, the top
layer's feature after the final norm). A feature head reads f_{i-1} and is also
trained, weighted, on a smooth-L1 regression of f_i scaled by the features' RMS; an
EAGLE-3 head reads its layers' hidden states at i - 1 and learns from the
cross-entropy alone, as EAGLE-3 does. With `unroll` n, passes 2 … n train draft steps
2 … n as the loop runs them (the heads' `unrolled`): the head's own output in, the
target's features behind it, EAGLE-3's "training-time test". Where the data marks the
prompt (`FeatureSet.start`), only rounds whose pending position is the last prompt token
or later count (as in the loop), in the loss and in the agreement.

Batches depend only on (seed, step), and checkpoints (model and optimizer, orbax)
carry the step, so a run killed and restarted ends with the same weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_specdec.nn.feature_head import FeatureHead, previous_features
from jax_specdec.training.fit import Fit, fit
from jax_specdec.training.head_data import FeatureSet

__all__ = ["HeadTrainConfig", "agreement", "init_from_target", "output_rows", "train_head"]


@dataclasses.dataclass(frozen=True)
class HeadTrainConfig:
    """Optimisation settings and the objective of a feature head."""

    steps: int = 2000
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 250
    ce_weight: float = 1.0
    feature_weight: float = 0.1
    unroll: int = 1

    def __post_init__(self):
        for name in ("steps", "batch_size", "checkpoint_every", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadTrainConfig.{name} must be an integer >= 1, got {value!r}")
        if (
            not isinstance(self.unroll, int)
            or isinstance(self.unroll, bool)
            or not (1 <= self.unroll <= 8)
        ):
            raise ValueError(
                f"HeadTrainConfig.unroll must be an integer in [1, 8], got {self.unroll!r}"
            )

    def optimizer(self) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, self.learning_rate, self.warmup_steps, max(self.steps, self.warmup_steps + 1)
        )
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(schedule, weight_decay=self.weight_decay),
        )


def output_rows(target) -> jax.Array:
    """The target's output matrix [V, D] (its embedding when tied)."""
    return target.embed[...] if target.lm_head is None else target.lm_head[...].T


def init_from_target(head: FeatureHead, target, vocab_map: np.ndarray) -> None:
    """Sets the head's kept tokens and starts its LM head and norm from the target's:
    a head that predicted the target's feature exactly would give the target's logits."""
    head.vocab_map.set_value(jnp.asarray(vocab_map, jnp.int32))
    head.lm_head.set_value(output_rows(target)[vocab_map].T.astype(head.lm_head[...].dtype))
    head.norm.scale.set_value(target.final_norm.scale[...])


def _batch(data: FeatureSet, rows: np.ndarray):
    """(tokens, features, greedy, head input [B, T, ·], counted [B, T] bool) of `rows`."""
    tokens, features, greedy = (jnp.asarray(a[rows]) for a in data[:3])
    inputs = features if data.aux is None else jnp.asarray(data.aux[rows])
    T = tokens.shape[1]
    start = np.zeros(len(rows), np.int32) if data.start is None else data.start[rows]
    counted = np.arange(T)[None] >= np.maximum(start - 1, 0)[:, None]
    return tokens, features, greedy, inputs, jnp.asarray(counted)


def _random_batch(data: FeatureSet, size: int, seed: int, step: int):
    return _batch(data, np.random.default_rng([seed, step]).integers(0, len(data), size=size))


def _masked_mean(values: jax.Array, counted: jax.Array) -> jax.Array:
    return jnp.sum(values * counted) / jnp.maximum(jnp.sum(counted), 1)


def _step_mask(counted: jax.Array, s: int) -> jax.Array:
    """Entries i that draft step s + 1 is trained at: those whose round's pending
    position i - s is counted (a round starts at the last prompt token or later)."""
    return jnp.pad(counted[:, : counted.shape[1] - s], ((0, 0), (s, 0)))


def _loss(head, batch, embed, out_rows, scale, config: HeadTrainConfig):
    tokens, features, _, inputs, counted = batch
    features = features.astype(jnp.float32)
    kept_rows = jax.lax.stop_gradient(out_rows[head.vocab_map[...]])  # [K, D]
    soft = jax.nn.softmax(jnp.einsum("btd,kd->btk", features, kept_rows), axis=-1)
    prev = previous_features(inputs.astype(jnp.float32))
    regress = isinstance(head, FeatureHead)
    loss = 0.0
    for s, (logits, predicted) in enumerate(head.unrolled(prev, tokens, embed, config.unroll)):
        mask = _step_mask(counted, s)
        loss = loss + config.ce_weight * _masked_mean(
            optax.softmax_cross_entropy(logits, soft), mask
        )
        if regress:
            reg = optax.huber_loss(predicted / scale, features / scale).mean(-1)
            loss = loss + config.feature_weight * _masked_mean(reg, mask)
    return loss


@nnx.jit(static_argnames="config")
def _train_step(head, optimizer, batch, embed, out_rows, scale, config):
    loss_fn = lambda h: _loss(h, batch, embed, out_rows, scale, config)  # noqa: E731
    loss, grads = nnx.value_and_grad(loss_fn)(head)
    optimizer.update(head, grads)
    return loss


@nnx.jit(static_argnames="steps")
def _agree(head, batch, embed, steps: int):
    """Per draft step: (entries where the head's argmax is the target's greedy token,
    entries counted), over entries whose round has a counted pending position ≥ 1."""
    tokens, _, greedy, inputs, counted = batch
    prev = previous_features(inputs.astype(jnp.float32))
    hits, counts = [], []
    for s, (logits, _) in enumerate(head.unrolled(prev, tokens, embed, steps)):
        guess = head.vocab_map[...][jnp.argmax(logits, axis=-1)]
        mask = _step_mask(counted, s).at[:, : s + 1].set(False)
        hits.append(jnp.sum((guess == greedy) & mask))
        counts.append(jnp.sum(mask))
    return jnp.stack(hits), jnp.stack(counts)


def agreement(head, data: FeatureSet, embed, *, steps: int = 2, batch: int = 8) -> list[float]:
    """Teacher-forced agreement with the target's greedy token on every window of `data`
    (its generated part, where it marks one): [first draft (true features in), second
    (the head's own output in), …], each as the loop runs it (the head's `unrolled`)."""
    if not 1 <= steps < data.tokens.shape[1]:
        raise ValueError(f"steps must lie in [1, window length), got {steps}")
    hits, counts = np.zeros(steps), np.zeros(steps)
    for i in range(len(data) // batch):
        part = _batch(data, np.arange(i * batch, (i + 1) * batch))
        h, c = _agree(head, part, embed, steps)
        hits, counts = hits + np.asarray(h), counts + np.asarray(c)
    return (hits / np.maximum(counts, 1)).round(4).tolist()


def feature_scale(data: FeatureSet) -> float:
    """RMS of the target's features (the regression's unit)."""
    sample = data.features[: min(len(data), 64)].astype(np.float32)
    return float(np.sqrt(np.mean(sample**2)))


def train_head(
    head: FeatureHead,
    target,
    train: FeatureSet,
    validation: FeatureSet,
    config: HeadTrainConfig,
    *,
    checkpoint_dir,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Trains `head` in place, resuming from `checkpoint_dir` if it holds a checkpoint.

    Args:
      head: the head (its current weights are the start unless resumed).
      target: the frozen target (its embedding and output rows are read).
      train, validation: `FeatureSet`s of the frozen target.
      config: optimisation settings and objective.
      checkpoint_dir: orbax checkpoints every `config.checkpoint_every` steps.
      progress: a tqdm bar with the loss and tokens/s.
      stop_after: stop (after checkpointing) at this step; for tests.

    Returns:
      A log dict: train losses, validation agreement per draft step, seconds, steps.
    """
    if config.unroll >= train.tokens.shape[1]:
        raise ValueError(
            f"unroll {config.unroll} needs windows longer than it; these have "
            f"{train.tokens.shape[1]} tokens"
        )
    types = sorted({str(w.dtype) for w in jax.tree.leaves(nnx.state(head, nnx.Param))})
    if types != ["float32"]:
        raise ValueError(
            f"train_head needs float32 weights (optimizer state in 16 bits underflows); "
            f"the head has {types}: load it with load_head(path, param_dtype='float32')"
        )
    optimizer = nnx.Optimizer(head, config.optimizer(), wrt=nnx.Param)
    scale, embed, out_rows = feature_scale(train), target.embed[...], output_rows(target)

    def step(i):
        batch = _random_batch(train, config.batch_size, config.seed, i)
        return _train_step(head, optimizer, batch, embed, out_rows, scale, config)

    def evaluate():
        value = agreement(head, validation, embed, steps=max(2, config.unroll))
        return value, f"agreement per draft step {value}"

    run = Fit(
        step,
        evaluate,
        "agreement",
        config.steps,
        config.eval_every,
        config.checkpoint_every,
        tokens_per_step=config.batch_size * train.tokens.shape[1],
    )
    return fit(
        head,
        optimizer,
        run,
        checkpoint_dir=checkpoint_dir,
        progress=progress,
        stop_after=stop_after,
    )
