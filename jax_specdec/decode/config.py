"""The loop's one static configuration: everything the compiled program is specialised on.

A `LoopConfig` is frozen and hashable; it is the only static argument of the program
(`program.generate`) besides the rows' `SamplingPlan` (the static part of their
`RowSampling`), so a second call with an equal config and plan and same-shaped arrays
does not recompile. Sampling settings are arrays, one per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jax_specdec.acceptance import accept_with_noise

__all__ = ["LoopConfig"]


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of one generation program.

    Attributes:
      target_def: the target's `nnx.GraphDef` (its weights are an array argument).
      draft_def: the draft model's `nnx.GraphDef`, None for a model-free drafter or
        autoregressive decoding.
      drafter: how tokens are proposed (`decode.drafters.base.Drafter`); None: autoregressive.
      schedule: how many tokens each row drafts per round (`jax_specdec.schedules`);
        None: autoregressive.
      max_new_tokens: tokens generated per row (fewer after an EOS).
      eos_token_id: the ids a row stops after emitting (`request.stop_ids`); None: no EOS.
      vocab_size: logits beyond it are dropped (models padded beyond the tokenizer).
      pad_token_id: fills the output after each row's end.
      cache_len: positions per row of every KV cache.
      mesh: a ("data", "model") mesh the program is partitioned over, or None.
      num_slots: run the prompts through this many rows, each refilled with the next
        waiting prompt when its row finishes (`decode.slots`); None: one row per prompt.
      acceptance: the acceptance rule, a function with the signature of
        `jax_specdec.acceptance.accept_with_noise` (the exact rule, the default).
      menu_acceptance: the acceptance rule of the tree rounds of `Auto` with a tree on
        its menu (`decode.tree_accept.accept_tree`'s signature; the chains keep
        `acceptance`).
      tree: a `decode.tree.Tree`: every round drafts a token tree of that shape and
        verifies it in one call (`decode.tree_round`); its depth is the schedule's
        constant γ. None: chains.
      logprobs: record each emitted token's log-probability and its top alternatives
        (`decode.logprobs.LogprobSpec`); None: not recorded.
    """

    target_def: Any
    draft_def: Any
    drafter: Any
    schedule: Any
    max_new_tokens: int
    eos_token_id: tuple[int, ...] | None
    vocab_size: int
    pad_token_id: int
    cache_len: int
    mesh: Mesh | None = None
    num_slots: int | None = None
    acceptance: Callable = accept_with_noise
    tree: Any = None
    logprobs: Any = None
    menu_acceptance: Callable | None = None

    @property
    def gamma_max(self) -> int:
        """The widest round: the schedule's max γ (0 for autoregressive decoding)."""
        return 0 if self.schedule is None else self.schedule.max_gamma

    @property
    def menu_tree(self):
        """The tree among the shapes the schedule chooses from each round (`Auto.tree`),
        or None."""
        return getattr(self.schedule, "tree", None)

    @property
    def tree_depth(self) -> int:
        """The depth of `menu_tree` (0: none): the width of the tree rounds' counters."""
        return 0 if self.menu_tree is None else self.menu_tree.depth

    @property
    def tree_ranks(self) -> tuple[int, int]:
        """(depth, branch) of the rounds' tree, fixed or on the menu, for the counters of
        its children by rank (`GenerationStats.rank_tested`); (0, 0) without one."""
        tree = self.tree or self.menu_tree
        return (0, 0) if tree is None else (tree.depth, tree.branch)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None
