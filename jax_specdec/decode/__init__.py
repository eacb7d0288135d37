"""The generation loop, as one compiled XLA program per call.

The modules, in the order a round runs through them:

- `api`: `Generator` (models, drafter, schedule, sampling, tree; validated once);
  `oneshot`: the one-call forms `speculative_generate`, `autoregressive_generate`;
  `run`: a bound call `Run`; `memory`: its memory plan, checked before compiling.
- `request`: host-side input checks; prompts, keys and budget become a `Request`.
- `config`: `LoopConfig`, the program's one static argument.
- `program`: prefill, then a `lax.while_loop` over rounds under one `jax.jit`.
- `state`: `LoopState`, the loop's carry, and its updates (emitting tokens, counters).
- `noise`: each round's randomness from the rows' own keys.
- `round`: a speculative round (schedule → drafter → verify → cache writes) or a
  plain target step.
- `drafters/`: the drafter protocol (`base`), the drafters that implement it (a draft
  model and its early exit, n-gram lookup, a feature head, an EAGLE-3 head, head trees)
  and `as_drafter`, which decides what kind of draft a `Generator` was given.
- `verify`: the target scores the proposal; the acceptance step decides.
- `tree`, `tree_round`, `tree_accept`: token trees (shape, mask, walk), the tree round,
  their exact acceptance (the walk; recursive rejection for sampled trees).
- `stats`: `GenerationOutput` and `GenerationStats`.
- `score`: the log-likelihood of given continuations, one forward pass (no loop).
"""

from jax_specdec.decode.api import Generator, Run
from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters import (
    Drafter,
    DraftInputs,
    DraftModel,
    EarlyExit,
    NGram,
    Proposal,
    as_drafter,
)
from jax_specdec.decode.oneshot import autoregressive_generate, speculative_generate
from jax_specdec.decode.score import Scores, score
from jax_specdec.decode.stats import GenerationOutput, GenerationStats

__all__ = [
    "DraftInputs",
    "DraftModel",
    "Drafter",
    "EarlyExit",
    "GenerationOutput",
    "GenerationStats",
    "Generator",
    "LoopConfig",
    "NGram",
    "Proposal",
    "Run",
    "Scores",
    "as_drafter",
    "autoregressive_generate",
    "score",
    "speculative_generate",
]
