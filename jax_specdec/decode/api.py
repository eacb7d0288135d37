"""The public API: a `Generator` (models, drafter, schedule and sampling, validated once)
and its bound calls (`Run`); `decode.oneshot` holds the one-call forms."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_specdec.decode.auto_costs import with_round_costs
from jax_specdec.decode.config import LoopConfig
from jax_specdec.decode.drafters.base import target_features
from jax_specdec.decode.drafters.resolve import as_drafter
from jax_specdec.decode.logprobs import LogprobSpec
from jax_specdec.decode.memory import CallShape, MemoryPlan, device_memory, plan_memory
from jax_specdec.decode.request import (
    Request,
    check_int,
    longest_first,
    make_request,
    queue_rows,
    stop_ids,
)
from jax_specdec.decode.round_args import (
    acceptance_rule,
    menu_tree,
    resolve_schedule,
    static_schedule,
)
from jax_specdec.decode.run import ProgramArgs, Run
from jax_specdec.decode.stats import GenerationOutput
from jax_specdec.decode.stop_tokens import per_row, stop_array
from jax_specdec.decode.tree import Tree, as_tree
from jax_specdec.decode.tree_accept import accept_tree
from jax_specdec.nn import Transformer
from jax_specdec.nn.transformer import feature_size
from jax_specdec.sampling import SamplingConfig
from jax_specdec.schedules import Auto
from jax_specdec.sharding import check_mesh, kv_repeats, place_rows, repeat_kv_heads, shard_state

__all__ = ["Generator"]

GREEDY = SamplingConfig(temperature=0.0)


class Generator:
    """A target, how to draft for it, and how to sample: validated once, then called on
    prompts. Without a draft it decodes autoregressively (the baseline, built like the
    speculative loop: one program, the same cache code).

    Args:
      target: the model whose distribution the output follows.
      draft: a draft model (same tokenizer), a `FeatureHead` trained for this target
        (it drafts from the target's hidden states), an EAGLE-3 `Eagle3Head` for it
        (`nn.eagle3`; from three target layers), a drafter of the protocol
        (`decode.drafters.base.Drafter`: `NGram()` or one of your own; a
        `(drafter, model)` pair if it drafts with a model), a path or name to load
        (`io.draft.load_draft`: "ngram", a model or head directory, a .gguf file), or
        None for autoregressive decoding (`decode.drafters.resolve.as_drafter`).
      schedule: tokens drafted per row and round: "auto" (the default; `Auto()`: the
        width chosen every round from round costs measured on this machine for the
        call's shapes, at the first call of each shape, and the acceptance seen so far;
        drafting switches itself off where it does not pay), an int γ >= 1, or a
        `jax_specdec.schedules` policy (Auto, Constant, Heuristic, CostModel, Custom). A
        `Confidence(threshold, max_gamma)` drafts up to max_gamma tokens and stops a
        row's drafting below the threshold (it needs a draft model).
      num_draft_tokens: an alias of `schedule=γ`.
      sampling: temperature / top-k / top-p for target and draft alike; default greedy.
      eos_token_id: a row stops after emitting it (it is kept): an id, or a sequence of
        ids (a chat model's end-of-turn and end-of-text, say; the first one emitted
        stops the row); None: no EOS.
      vocab_size: the real vocabulary when target and draft differ only by padding
        (e.g. 32000 vs 32064): logits beyond it are dropped from both, which is exact
        as long as the target gives padded ids no probability.
      pad_token_id: fills the output after each row's end.
      mesh: a `Mesh` with axes "data" and "model": rows over data, weights and the
        caches' heads over model; still one program (also under `jax.distributed`).
      acceptance: a chain's acceptance rule, both exact: "token" (token by token,
        Leviathan et al.) or "block" (block verification: no fewer tokens kept on
        average). A tree round walks its tree (recursive rejection for sampled trees).
      tree: draft a token tree each round and verify it in one target call
        (`decode.tree`): an int N of nodes, its depth the schedule's γ (an int; 4
        when no schedule is given), or a `Tree(nodes, depth, branch)`. With
        schedule="auto" (or an `Auto`) the tree joins auto's menu (an int N: depth
        min(N, 4)), chosen for a round when its expected time is the least; without a
        schedule, every round is the tree's (depth 4). An `NGram`, a feature head or an
        EAGLE-3 head builds trees.
      device_memory: bytes one device holds, for the memory plan each call is checked
        against before compiling (`decode.memory`); None: what the backend reports (GPU,
        TPU), no check where it reports nothing (CPU).
    """

    def __init__(
        self,
        target: Transformer,
        draft=None,
        *,
        schedule=None,
        num_draft_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        vocab_size: int | None = None,
        pad_token_id: int = 0,
        mesh: Mesh | None = None,
        acceptance: str = "token",
        tree: int | Tree | None = None,
        device_memory: int | None = None,
        _rule: Callable | None = None,
        _tree_rule: Callable | None = None,
    ):
        if not isinstance(target, Transformer):
            raise TypeError(
                f"target must be a jax_specdec.nn.Transformer, got {type(target).__name__}"
            )
        self.sampling = GREEDY if sampling is None else sampling
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        self.target, self.draft_model = target, None
        self.vocab_size = target.config.vocab_size
        self.drafter, self.schedule, self.tree = None, None, None
        if draft is not None:
            self._set_drafter(draft, resolve_schedule(num_draft_tokens, schedule, tree), vocab_size)
            if isinstance(self.schedule, Auto):  # a tree joins the menu
                self.schedule = menu_tree(self.schedule, tree, self.drafter)
            elif tree is not None:
                self.tree = as_tree(tree, self.schedule, self.drafter)
        elif any(a is not None for a in (schedule, num_draft_tokens, vocab_size, tree)):
            raise ValueError("schedule, num_draft_tokens, vocab_size and tree need a draft")
        self._stop_ids = stop_ids(eos_token_id, self.vocab_size)
        if not 0 <= check_int("pad_token_id", pad_token_id, 0) < self.vocab_size:
            raise ValueError(f"pad_token_id must lie in [0, {self.vocab_size}), got {pad_token_id}")
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.acceptance = acceptance_rule(acceptance, _rule, self.tree)
        self._tree_rule = accept_tree if _tree_rule is None else _tree_rule  # auto's tree
        if device_memory is not None:
            check_int("device_memory", device_memory, 1)
        self.device_memory = device_memory
        self._split(mesh)

    def _set_drafter(self, draft, schedule, vocab_size):
        limit = self.target.config.max_len
        if schedule.max_gamma >= limit:  # every width up to it is a branch to compile
            raise ValueError(
                f"the schedule's largest γ ({schedule.max_gamma}) must be below the target's "
                f"context of {limit} tokens"
            )
        drafting = as_drafter(draft, self.target, schedule=schedule, vocab_size=vocab_size)
        self.drafter, self.draft_model = drafting.drafter, drafting.model
        self.vocab_size, self.schedule = drafting.vocab_size, drafting.schedule

    def _split(self, mesh):
        models = [("target", self.target)]
        if self.draft_model is not None:
            models.append(("draft", self.draft_model))
        if mesh is not None:  # a model axis wider than a model's KV heads repeats them
            models = [(n, _fit_kv_heads(m, mesh)) for n, m in models]
        self._models = models
        self.mesh = None if mesh is None else check_mesh(mesh, [(n, m.config) for n, m in models])
        self._defs, self._states = [], []
        for _, model in models:
            graphdef, state = nnx.split(model)
            self._defs.append(graphdef)
            self._states.append(state if self.mesh is None else shard_state(state, self.mesh))
        if len(models) == 1:
            self._defs.append(None)
            self._states.append(None)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a row (`eos_token_id` as a sorted tuple; empty: none)."""
        return self._stop_ids or ()

    def bind(
        self,
        prompts,
        *,
        key: jax.Array,
        max_new_tokens,
        prompt_lengths=None,
        num_slots=None,
        sampling=None,
        logprobs: int | None = None,
        logprob_kind: str = "processed",
        stop_sequences=None,
    ) -> Run:
        """Validates and places one call's inputs; returns the `Run` that generates.

        Args:
          prompts: a list of token-id lists (ragged), or an int array [B, P] with
            `prompt_lengths` [B] (right padding ignored).
          key: one `jax.random.key` (row b uses fold_in(key, b)) or an array of B keys.
          max_new_tokens: tokens to generate per row (fewer if the row emits EOS): one
            int, or one per prompt.
          prompt_lengths: [B] lengths when `prompts` is an array.
          num_slots: run the B prompts through this many rows (1 <= S <= B), a finished
            row taking the next waiting prompt inside the program (largest budget
            first); every prompt gets the tokens it gets alone. The prompts are padded
            to S·2^k rows, so a different B in the same bucket reuses the compiled
            program. None: one row per prompt.
          sampling: one `SamplingConfig`, one per prompt, or a `RowSampling` of one row
            per prompt (rows of several settings run in one program, each row sampled
            by its own); None: the Generator's.
          logprobs: record each generated token's log-probability and its `logprobs`
            most likely alternatives (0: the token's alone; at most 20), from the target
            calls the generation makes anyway (`decode.logprobs`); in the output's
            `logprobs`. None: not recorded.
          logprob_kind: "processed" (the distribution the row samples from: bias,
            penalties, temperature, top-k/top-p/min-p; a greedy row's at temperature 1)
            or "raw" (the model's own).
          stop_sequences: token-id sequences that end a row as soon as its generated
            tokens end with one (kept, as an EOS): one list for every row, or one list
            per prompt (`decode.stop_tokens`; a stop string's tokenization, say: its text
            is still to be cut by the caller). None: none.
        """
        sampling = self.sampling if sampling is None else sampling
        request = make_request(
            prompts, prompt_lengths, key, max_new_tokens, sampling, vocab_size=self.vocab_size
        )
        request = self._with_stops(request, stop_sequences)
        limit = min(m.config.max_len for _, m in self._models)
        if request.prompts.shape[1] + request.max_new_tokens > limit:  # padding too wide
            request = request.trimmed()
        num_slots = _check_slots(num_slots, request.batch)
        for name, model in self._models:
            _check_fits(model, name, request)
        spec = None if logprobs is None else LogprobSpec(logprobs, logprob_kind)
        if spec is not None and spec.top > self.vocab_size:
            raise ValueError(f"logprobs ({spec.top}) exceeds the vocabulary ({self.vocab_size})")
        config = dataclasses.replace(self._config(request, num_slots), logprobs=spec)
        order = None if num_slots is None else longest_first(request.budgets)
        args = ProgramArgs(*self._states, *self._place(request, num_slots, order))
        plan = self._memory_plan(config, num_slots or args.prompts.shape[0], args.prompts.shape)
        plan.check()  # before anything is compiled
        run = Run(config, request, args, order, memory_plan=plan)
        if isinstance(self.schedule, Auto):  # its costs: an input, measured once per shape
            models = [m for _, m in self._models]
            run, run.round_costs = with_round_costs(run, self.schedule, models)
            costs = run.round_costs
            inputs = self.schedule.inputs(costs.per_width, costs.alpha, costs.tree_alpha)
            starting = request.budgets if order is None else request.budgets[order][:num_slots]
            if self.schedule.fallback and not self.schedule.drafts_first(inputs, starting):
                run = run.autoregressive()
        return run

    def _with_stops(self, request: Request, stop_sequences) -> Request:
        """`request` with the rows' stop sequences (`decode.stop_tokens`), if any."""
        if stop_sequences is None:
            return request
        stops = stop_array(per_row(stop_sequences, request.batch), self.vocab_size)
        return dataclasses.replace(request, sampling=request.sampling.with_stops(stops))

    def _memory_plan(self, config: LoopConfig, rows: int, prompts: tuple) -> MemoryPlan:
        width = 1 if self.schedule is None else self.schedule.max_gamma + 1
        tree = self.tree or getattr(self.schedule, "tree", None)  # or a tree on auto's menu
        if tree is not None:
            width = max(width, tree.nodes + 1)
        available = self.device_memory if self.device_memory is not None else device_memory()
        call = CallShape(
            rows=rows,
            cache_len=config.cache_len,
            width=width,
            vocab_size=self.vocab_size,
            prompt=prompts[1],
            slots=config.num_slots is not None,
            kept=_logprob_bytes(config, rows, prompts[0]),
            features=_feature_bytes(self._models[0][1].config, self.drafter),
        )
        states = [s for s in self._states if s is not None]
        models = [m for _, m in self._models]
        return plan_memory(states, models, call, mesh=self.mesh, available=available)

    def _config(self, request: Request, num_slots: int | None) -> LoopConfig:
        """The program's static configuration for this call's shapes."""
        gamma_max = 0 if self.schedule is None else self.schedule.max_gamma
        cache_len = min(
            request.prompts.shape[1] + request.max_new_tokens + gamma_max,
            *(m.config.max_len for _, m in self._models),
        )
        return LoopConfig(
            target_def=self._defs[0],
            draft_def=self._defs[1],
            drafter=self.drafter,
            schedule=static_schedule(self.schedule),
            max_new_tokens=request.max_new_tokens,
            eos_token_id=self._stop_ids,
            vocab_size=self.vocab_size,
            pad_token_id=self.pad_token_id,
            cache_len=cache_len,
            mesh=self.mesh,
            num_slots=num_slots,
            acceptance=self.acceptance,
            tree=self.tree,
            menu_acceptance=self._tree_rule,
        )

    def _place(self, request: Request, num_slots: int | None, order):
        r = request
        arrays = (r.prompts, r.prompt_lengths, r.keys, r.budgets, r.sampling)
        if num_slots is not None:
            data = 1 if self.mesh is None else self.mesh.shape["data"]
            if num_slots % data:
                raise ValueError(
                    f"the mesh's data axis ({data}) does not divide num_slots ({num_slots})"
                )
            ordered = (*(a[order] for a in arrays[:4]), r.sampling.at(order))
            arrays = queue_rows(ordered, num_slots)
        if self.mesh is None:
            return tuple(jax.tree.map(jnp.asarray, a) for a in arrays)
        check_mesh(self.mesh, [], batch=arrays[0].shape[0])
        key_data = np.asarray(jax.random.key_data(arrays[2]))
        leaves, treedef = jax.tree.flatten(arrays[4])
        placed = place_rows(self.mesh, arrays[0], arrays[1], key_data, arrays[3], *leaves)
        return (*placed[:4], jax.tree.unflatten(treedef, placed[4:]))

    def __call__(
        self,
        prompts,
        *,
        key: jax.Array,
        max_new_tokens,
        prompt_lengths=None,
        num_slots=None,
        sampling=None,
        logprobs: int | None = None,
        logprob_kind: str = "processed",
        stop_sequences=None,
    ):
        """Generates: `bind(...)` and run, with a warning if NaN/inf logits were met."""
        run = self.bind(
            prompts,
            key=key,
            max_new_tokens=max_new_tokens,
            prompt_lengths=prompt_lengths,
            num_slots=num_slots,
            sampling=sampling,
            logprobs=logprobs,
            logprob_kind=logprob_kind,
            stop_sequences=stop_sequences,
        )
        return _checked(run())


def _feature_bytes(config, drafter) -> int:
    """Bytes of one position's target features, where `drafter` reads them (else 0)."""
    features = target_features(drafter)
    return feature_size(config, features) * config.jnp_dtype.itemsize if features else 0


def _logprob_bytes(config: LoopConfig, rows: int, prompts: int) -> int:
    """What the log-probabilities take: the state's buffer of `rows` rows and, with slots,
    the output of every prompt (a float32 value, top ids and values per position)."""
    if config.logprobs is None:
        return 0
    per_position = 4 + 8 * config.logprobs.top
    kept = rows + (prompts if config.num_slots is not None else 0)
    return kept * (config.cache_len + 1) * per_position


def _check_slots(num_slots, batch: int) -> int | None:
    if num_slots is None:
        return None
    num_slots = check_int("num_slots", num_slots, 1)
    if num_slots > batch:
        raise ValueError(f"num_slots ({num_slots}) exceeds the number of prompts ({batch})")
    return num_slots


def _check_fits(model, name: str, request: Request) -> None:
    limit = model.config.max_len
    if request.longest + request.max_new_tokens > limit:
        raise ValueError(
            f"prompt length ({request.longest}) + max_new_tokens ({request.max_new_tokens}) "
            f"exceeds the {name} model's maximum length config.max_len={limit}"
        )


def _checked(out: GenerationOutput) -> GenerationOutput:
    bad = out.stats.nonfinite
    if not bad.is_fully_addressable:  # several processes: every one gets the whole flag
        from jax.experimental import multihost_utils

        bad = multihost_utils.process_allgather(bad, tiled=True)
    bad = np.asarray(bad)
    if bad.any():
        warnings.warn(
            f"NaN/inf logits met in rows {np.flatnonzero(bad).tolist()}; their tokens are "
            "not samples of the model's distribution",
            RuntimeWarning,
            stacklevel=3,
        )
    return out


def _fit_kv_heads(model, mesh):
    """A Transformer with its KV heads repeated to the mesh's model axis where that is
    wider (`sharding.kv_repeats`); any other model as it is."""
    if not isinstance(model, Transformer) or "model" not in getattr(mesh, "shape", {}):
        return model
    return repeat_kv_heads(model, kv_repeats(model.config, mesh.shape["model"]))
