"""Training with optax (AdamW, warmup + cosine decay, gradient clipping) and draft distillation.

`train` fits a model to a token stream (next-token cross-entropy) or, given a
`teacher`, distils it towards the teacher's distributions (DistillSpec, Zhou et al.
2023): a divergence between the teacher's and the student's next-token distributions
on corpus text, after the same temperature. Checkpoints go through an orbax
`CheckpointManager`, so an interrupted run resumes from its last checkpoint and, as
batches depend only on (seed, step), ends with the same weights as an uninterrupted
run.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_specdec.decode.request import INT32_MAX
from jax_specdec.nn import Transformer
from jax_specdec.training.corpus import sample_windows
from jax_specdec.training.fit import Fit, fit

__all__ = ["TrainConfig", "train", "evaluate_loss", "DIVERGENCES"]

DIVERGENCES = ("ce", "kl", "tvd", "jsd")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; `divergence` "ce" is plain next-token training."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 100
    divergence: str = "ce"
    distill_temperature: float = 1.0

    def __post_init__(self):
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= INT32_MAX:
                raise ValueError(f"{name} must be an integer in [1, {INT32_MAX}], got {value!r}")
        if not (0 <= self.warmup_steps < self.steps):
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if not 0 <= self.seed < 2**32:  # it becomes a PRNG key
            raise ValueError(f"seed must lie in [0, 2**32), got {self.seed}")
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")

    def optimizer(self) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=self.steps,
            end_value=self.learning_rate * self.min_lr_ratio,
        )
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=self.weight_decay),
        )


def _loss(model, teacher, windows, config: TrainConfig):
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(inputs)  # [B, T, V] float32
    if teacher is None or config.divergence == "ce":
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    t = config.distill_temperature
    p = jax.nn.softmax(jax.lax.stop_gradient(teacher(inputs)) / t, axis=-1)  # teacher
    log_q = jax.nn.log_softmax(logits / t, axis=-1)
    if config.divergence == "kl":  # KL(p || q), forward
        return jnp.sum(p * (jnp.log(jnp.maximum(p, 1e-30)) - log_q), axis=-1).mean()
    q = jnp.exp(log_q)
    if config.divergence == "tvd":  # 1 - α at this position
        return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1).mean()
    m = 0.5 * (p + q)
    log_m = jnp.log(jnp.maximum(m, 1e-30))
    kl_pm = jnp.sum(p * (jnp.log(jnp.maximum(p, 1e-30)) - log_m), axis=-1)
    kl_qm = jnp.sum(q * (log_q - log_m), axis=-1)
    return (0.5 * (kl_pm + kl_qm)).mean()


@nnx.jit(static_argnames=("config",))
def _train_step(model, optimizer, teacher, windows, config):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m, teacher, windows, config))(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _eval_loss(model, windows):
    logits = model(windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def evaluate_loss(model: Transformer, stream: np.ndarray, config: TrainConfig) -> float:
    """Mean next-token cross-entropy (nats) on `eval_batches` fixed windows of `stream`."""
    losses = [
        float(
            _eval_loss(
                model,
                jnp.asarray(
                    sample_windows(
                        stream,
                        batch=config.batch_size,
                        length=config.seq_len,
                        seed=10_000 + config.seed,
                        step=i,
                    )
                ),
            )
        )
        for i in range(config.eval_batches)
    ]
    return float(np.mean(losses))


def train(
    model: Transformer,
    train_stream: np.ndarray,
    validation_stream: np.ndarray,
    config: TrainConfig,
    *,
    checkpoint_dir: str | pathlib.Path,
    teacher: Transformer | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Trains `model` in place; resumes from `checkpoint_dir` if it holds a checkpoint.

    Args:
      model: the model to train (its current weights are the start unless resumed).
      train_stream, validation_stream: int32 token streams (see `data.encode_files`).
      config: optimisation settings.
      checkpoint_dir: orbax checkpoints (model + optimizer state), one per
        `config.checkpoint_every` steps, the last two kept.
      teacher: for distillation (config.divergence != "ce"): the model to match.
      progress: show a tqdm bar with loss and tokens/s.
      stop_after: stop (after checkpointing) once this step is reached; for tests.

    Returns:
      A log dict: steps, train losses, validation losses, seconds, tokens seen.
    """
    _check_teacher(model, teacher, config)
    optimizer = nnx.Optimizer(model, config.optimizer(), wrt=nnx.Param)
    window = dict(batch=config.batch_size, length=config.seq_len, seed=config.seed)

    def step(i):
        windows = jnp.asarray(sample_windows(train_stream, step=i, **window))
        return _train_step(model, optimizer, teacher, windows, config)

    def evaluate():
        loss = evaluate_loss(model, validation_stream, config)
        return loss, f"validation loss {loss:.4f}"

    run = Fit(
        step,
        evaluate,
        "validation_loss",
        config.steps,
        config.eval_every,
        config.checkpoint_every,
        tokens_per_step=config.batch_size * config.seq_len,
        desc="distill" if teacher is not None else "train",
    )
    log = fit(
        model,
        optimizer,
        run,
        checkpoint_dir=checkpoint_dir,
        progress=progress,
        stop_after=stop_after,
    )
    log["tokens_seen"] = log["steps"] * run.tokens_per_step
    return log


def _check_teacher(model, teacher, config: TrainConfig) -> None:
    if config.divergence != "ce" and teacher is None:
        raise ValueError(f"divergence {config.divergence!r} needs a teacher model")
    if teacher is not None and teacher.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"teacher vocabulary {teacher.config.vocab_size} differs from the student's "
            f"{model.config.vocab_size}"
        )
