"""The resumable training loop that `training.lm` (models) and `training.head_train` (feature heads)
share: steps, a tqdm bar with the loss and tokens/s, evaluation, and orbax checkpoints of
the model and its optimizer.

A run's batches depend only on (seed, step), so a run killed and started again resumes
from its last checkpoint and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["Fit", "fit"]


@dataclasses.dataclass(frozen=True)
class Fit:
    """One run. `step(i)` trains on batch i and returns the loss; `evaluate()` returns
    (value, message), logged under `eval_key` every `eval_every` steps and at the end."""

    step: Callable[[int], jax.Array]
    evaluate: Callable[[], tuple[Any, str]]
    eval_key: str
    steps: int
    eval_every: int
    checkpoint_every: int
    tokens_per_step: int
    desc: str = "train"


def fit(model, optimizer, run: Fit, *, checkpoint_dir, progress=True, stop_after=None) -> dict:
    """Runs `run` on `model` and `optimizer` (updated in place), resuming from the latest
    checkpoint in `checkpoint_dir`; stops after step `stop_after` if given (for tests).

    Returns the log: `train_loss` and `run.eval_key` as [(step, value)], `seconds`
    (summed over resumed runs), `steps`, `resumed_from` (a step, or None)."""
    from tqdm.auto import tqdm

    checkpoint_dir = pathlib.Path(checkpoint_dir).absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    manager = ocp.CheckpointManager(checkpoint_dir, options=options)
    log, start = _resume(manager, model, optimizer, checkpoint_dir)
    log.setdefault(run.eval_key, [])
    end = run.steps if stop_after is None else min(run.steps, stop_after)
    bar = tqdm(
        range(start, end), initial=start, total=run.steps, desc=run.desc, disable=not progress
    )
    t0, seconds_before = time.perf_counter(), log["seconds"]
    for step in bar:
        loss = run.step(step)
        done = step + 1
        if done % 10 == 0 or done == end:
            log["train_loss"].append((done, float(loss)))
            tok_s = run.tokens_per_step * (done - start) / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{float(loss):.3f}", tok_s=f"{tok_s:.0f}")
        if done % run.eval_every == 0 or done == run.steps:
            value, message = run.evaluate()
            log[run.eval_key].append((done, value))
            bar.write(f"step {done}: {message}", file=sys.stderr)
        if done % run.checkpoint_every == 0 or done == end:
            log["seconds"] = seconds_before + time.perf_counter() - t0
            _save(manager, done, model, optimizer, log, checkpoint_dir)
    manager.wait_until_finished()
    manager.close()
    log["seconds"] = seconds_before + time.perf_counter() - t0
    log["steps"] = end
    return log


def _resume(manager, model, optimizer, checkpoint_dir: pathlib.Path) -> tuple[dict, int]:
    """Restores model and optimizer from the latest checkpoint, if any: (log, step). Log
    entries recorded after that checkpoint are dropped (the steps run again)."""
    log = {"train_loss": [], "seconds": 0.0, "resumed_from": None}
    latest = manager.latest_step()
    if latest is None:
        return log, 0
    template = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    try:
        restored = manager.restore(latest, args=ocp.args.StandardRestore(template))
    except (ValueError, TypeError, KeyError) as e:  # orbax: shapes or trees differ
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{checkpoint_dir} holds a checkpoint (step {latest}) of another model or "
            f"optimizer ({first}): give another checkpoint directory, or delete it"
        ) from None
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    log_path = checkpoint_dir / "log.json"
    if log_path.exists():
        log = json.loads(log_path.read_text())
        for key, value in log.items():
            if isinstance(value, list):
                log[key] = [x for x in value if x[0] <= latest]
    log["resumed_from"] = latest
    return log, latest


def _save(manager, step, model, optimizer, log, checkpoint_dir: pathlib.Path) -> None:
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    manager.save(step, args=ocp.args.StandardSave(state), force=True)
    manager.wait_until_finished()
    (checkpoint_dir / "log.json").write_text(json.dumps(log))
