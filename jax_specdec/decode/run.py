"""A bound call: one generation with every input validated and placed (`Generator.bind`),
and the array arguments of the compiled program."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_specdec.decode import program
from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.request import Request
from jax_specdec.decode.stats import GenerationOutput, take_rows
from jax_specdec.sampling import RowSampling
from jax_specdec.schedules.auto import AutoInputs

__all__ = ["ProgramArgs", "Run"]


class ProgramArgs(NamedTuple):
    """The array arguments of `program.generate`, placed (on the mesh, if any)."""

    target_state: nnx.State
    draft_state: nnx.State | None
    prompts: jax.Array  # [B, P] int32
    prompt_lengths: jax.Array  # [B] int32
    keys: jax.Array  # [B] keys, or [B, 2] uint32 key data on a mesh
    budgets: jax.Array  # [B] int32 max_new_tokens per row (0: a padding row of slots)
    sampling: RowSampling  # [B] each row's sampling setting
    auto: AutoInputs | None = None  # what `schedules.Auto` chooses from


class Run:
    """One generation with every input validated and placed: calling it runs only the
    compiled program (for benchmarks, and for generating again from the same inputs).

    Attributes:
      config: the program's static `LoopConfig`.
      request: the validated inputs, on the host.
      args: the program's array arguments, as placed.
      memory_plan: what a device holds for it (`decode.memory.MemoryPlan`), or None.
      round_costs: for `schedules.Auto`, the costs it chooses from and where they came
        from (`decode.auto_costs.Costs`); None otherwise.
    """

    def __init__(
        self, config: LoopConfig, request: Request, args: ProgramArgs, order=None, memory_plan=None
    ):
        self.config, self.request, self.args = config, request, args
        self.memory_plan = memory_plan
        self.round_costs = None
        # With slots: the prompts' queue order (row i of args holds prompt order[i]).
        self._inverse = None if order is None else jnp.asarray(np.argsort(order), jnp.int32)

    @property
    def cache_len(self) -> int:
        """Positions per row of every KV cache."""
        return self.config.cache_len

    def __call__(self) -> GenerationOutput:
        out = program.generate(*self.args, config=self.config)
        if self._inverse is None:
            return out
        return take_rows(out, self._inverse)

    def replicated(self) -> GenerationOutput:
        """The output whole on every process, as NumPy arrays, for a mesh over several
        processes' devices. One program: the generation, the slots' rows put back in the
        prompts' order and the output replicated (eager ops on arrays that span processes
        cost a synchronised dispatch each)."""
        inverse = None if self._inverse is None else np.asarray(self._inverse)
        out = _replicated(self.args, inverse, config=self.config)
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), out)

    def autoregressive(self) -> Run:
        """This call as autoregressive decoding's program (no drafter: no draft prefill,
        no round switch; `round_costs` kept): `Generator` runs it where `Auto`'s first
        round would not draft (`Auto.drafts_first`)."""
        out = copy.copy(self)
        plain = self.request.prompts.shape[1] + self.request.max_new_tokens  # no γ_max room
        out.config = dataclasses.replace(
            self.config,
            draft_def=None,
            drafter=None,
            schedule=None,
            menu_acceptance=None,
            cache_len=min(self.config.cache_len, plain),
        )
        out.args = self.args._replace(draft_state=None, auto=None)
        return out

    def lower(self) -> jax.stages.Lowered:
        """The lowered program, e.g. `run.lower().compile().as_text()` for its HLO."""
        return program.generate.lower(*self.args, config=self.config)


@functools.partial(jax.jit, static_argnames="config")
def _replicated(args, inverse, *, config):
    out = program.generate(*args, config=config)
    if inverse is not None:
        out = take_rows(out, inverse)
    return jax.lax.with_sharding_constraint(out, NamedSharding(config.mesh, P()))
