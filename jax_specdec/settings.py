"""The decoding flags `generate` and `batch` share, parsed and checked once into a frozen
`DecodeSettings`; what the models must agree with is checked where the models are
(`Generator`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports JAX only when a command runs
    from jax_specdec.decode.tree import Tree
    from jax_specdec.sampling import SamplingConfig

__all__ = [
    "MAX_SAMPLES",
    "SEED_LIMIT",
    "DecodeSettings",
    "check_gamma_flag",
    "check_seed",
    "parse_mesh",
    "round_args",
]

TREE_DEPTH = 4  # a --tree's depth when --num-draft-tokens is auto (on auto's menu)
SEED_LIMIT = 2**63  # seeds are 63-bit: the key of a seed is decode.request.seed_key_data
MAX_SAMPLES = 1 << 16  # --n and a batch row's n at most (a typo of 10**9 would hang)


def check_seed(seed: int) -> int:
    """--seed, checked before it becomes a key."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"--seed must lie in [0, 2**63), got {seed}")
    return seed


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """How to decode, from the flags.

    Attributes:
      target, draft: as given (`io.locate`, `io.draft.load_draft`); draft None: plain
        autoregressive decoding.
      num_draft_tokens: "auto" (`schedules.Auto`: a chain's width chosen every round from
        measured costs) or γ, a chain's length or a tree's depth (4 for a tree when
        "auto" was given).
      tree: the round's token tree (`--tree`, `--branch`), or None for a chain.
      acceptance: a chain's rule, "token" or "block".
      sampling: temperature, top-k and top-p.
      eos: "auto", "none" or token ids "ID[,ID...]", as given (`eos_token_id` resolves
        it).
      seed: the job's or the call's seed.
      mesh: "DATAxMODEL" or None (`parse_mesh`).
      dtype: the models' parameters and activations, "float32" or "bfloat16"; None:
        bfloat16 on an accelerator, on the CPU each checkpoint's own (bfloat16 ones stay
        bfloat16, others load as float32). Sampling, acceptance and residuals are float32
        whatever it is.
      n: samples per prompt (--n); sample 0 keyed as one sample is, sample i >= 1 by a
        seed derived from the seed and i alone.
      stop: stop strings (--stop): each text is cut at the earliest (`stop_strings`).
      logprobs: alternatives per token written with the log-probabilities (--logprobs;
        None: none); logprob_kind: "processed" or "raw" (`decode.logprobs`).
    """

    target: str
    draft: str | None
    num_draft_tokens: int | str
    tree: Tree | None
    acceptance: str
    sampling: SamplingConfig
    eos: str
    seed: int
    mesh: str | None = None
    dtype: str | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    logprob_kind: str = "processed"

    @classmethod
    def from_args(cls, args, *, draft: str | None) -> DecodeSettings:
        """The settings of parsed flags (`common.add_round_flags`,
        `common.add_sampling_flags`, `common.add_sample_flags`, --target,
        --num-draft-tokens, --seed); ValueError naming the flag."""
        from jax_specdec import stop_strings
        from jax_specdec.sampling import SamplingConfig

        gamma = check_gamma_flag(args.num_draft_tokens)
        # With auto, the tree (of depth TREE_DEPTH) joins auto's menu.
        depth = min(TREE_DEPTH, args.tree or TREE_DEPTH) if gamma == "auto" else gamma
        tree = _tree(args.tree, args.branch, max(depth, 1), args.lookup)
        if args.acceptance == "block" and tree is not None:
            raise ValueError("--acceptance block is for chains; a --tree round walks its tree")
        ids = args.eos.replace(" ", "").split(",")
        if args.eos not in ("auto", "none") and not all(i.isdigit() for i in ids):
            raise ValueError(
                f"--eos must be 'auto', 'none' or token ids (ID[,ID...]), got {args.eos!r}"
            )
        sampling = SamplingConfig(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=getattr(args, "min_p", 0.0),
            repetition_penalty=getattr(args, "repetition_penalty", 1.0),
            presence_penalty=getattr(args, "presence_penalty", 0.0),
            frequency_penalty=getattr(args, "frequency_penalty", 0.0),
            logit_bias=_logit_bias(getattr(args, "logit_bias", "")),
        )
        return cls(
            target=args.target,
            draft=draft,
            num_draft_tokens=gamma,
            tree=tree,
            acceptance=args.acceptance,
            sampling=sampling,
            eos=args.eos,
            seed=check_seed(args.seed),
            mesh=getattr(args, "mesh", None),
            dtype=None if getattr(args, "dtype", "auto") == "auto" else args.dtype,
            n=_check_n(getattr(args, "n", 1)),
            stop=stop_strings.check(getattr(args, "stop", None), "--stop"),
            logprobs=_check_logprobs(getattr(args, "logprobs", None)),
            logprob_kind=getattr(args, "logprob_kind", "processed"),
        )

    def check_context(self, max_len: int) -> None:
        """--num-draft-tokens below the models' context (each draft length up to it is a
        branch of the compiled round: a γ past the context would compile without end)."""
        gamma = self.num_draft_tokens
        if self.draft is not None and gamma != "auto" and gamma >= max_len:
            raise ValueError(
                f"--num-draft-tokens {self.num_draft_tokens} must be below the models' "
                f"context of {max_len} tokens"
            )

    def eos_token_id(self, loaded) -> int | tuple[int, ...] | None:
        """--eos for the loaded target (`io.draft.Loaded`): "auto" is every end-of-sequence
        and end-of-turn id the target states (`io.hf.stop_token_ids`), else its
        tokenizer's <|endoftext|>; "none" is no EOS; else the ids given. One id is an int,
        several a tuple."""
        if self.eos == "none":
            return None
        if self.eos == "auto":
            from jax_specdec.io.hf import stop_token_ids

            ids = stop_token_ids(loaded.target_dir)
            if not ids:
                return loaded.tokenizer.token_to_id("<|endoftext|>")
        else:
            ids = tuple(sorted({int(i) for i in self.eos.replace(" ", "").split(",")}))
        return ids[0] if len(ids) == 1 else ids

    def rounds(self) -> dict:
        """`Generator`'s drafting arguments (none for autoregressive decoding)."""
        if self.draft is None:
            return {}
        return round_args(self.num_draft_tokens, self.tree, self.acceptance)


def round_args(num_draft_tokens, tree, acceptance: str) -> dict:
    """`Generator`'s drafting arguments for --num-draft-tokens ("auto" or γ), a tree and
    a chain's acceptance rule."""
    if num_draft_tokens == "auto":
        return dict(schedule="auto", tree=tree, acceptance=acceptance)
    return dict(num_draft_tokens=num_draft_tokens, tree=tree, acceptance=acceptance)


def check_gamma_flag(value, name: str = "--num-draft-tokens") -> int | str:
    """--num-draft-tokens: "auto" or an int γ >= 1 (ValueError naming the flag, `name`)."""
    if value == "auto":
        return value
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        gamma = 0
    if isinstance(value, bool) or str(gamma) != str(value).strip() or gamma < 1:
        raise ValueError(f"{name} must be 'auto' or an integer >= 1, got {value!r}")
    return gamma


def _check_logprobs(top: int | None) -> int | None:
    from jax_specdec.decode.logprobs import MAX_TOP

    if top is not None and not 0 <= top <= MAX_TOP:
        raise ValueError(f"--logprobs must lie in [0, {MAX_TOP}], got {top}")
    return top


def _check_n(n: int) -> int:
    if not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"--n must lie in [1, {MAX_SAMPLES}], got {n}")
    return n


def _logit_bias(text: str) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID:BIAS[,ID:BIAS...] as (id, bias) pairs (checked by SamplingConfig)."""
    pairs = []
    for item in filter(None, (text or "").replace(" ", "").split(",")):
        token, _, bias = item.partition(":")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise ValueError(
                f"--logit-bias must be ID:BIAS[,ID:BIAS...] (e.g. 50256:-100), got {item!r}"
            ) from None
    return tuple(pairs)


def _tree(nodes: int | None, branch: int, depth: int, lookup: int) -> Tree | None:
    """--tree, --branch and --lookup as a `Tree` of `depth` (None without --tree)."""
    if nodes is None:
        if lookup:
            raise ValueError("--lookup grafts prompt lookup onto a --tree: give --tree too")
        return None
    if nodes < 1 or branch < 1:
        bad, value = ("--tree", nodes) if nodes < 1 else ("--branch", branch)
        raise ValueError(f"{bad} must be >= 1, got {value}")
    from jax_specdec.decode.tree import Tree

    if nodes < depth:
        raise ValueError(
            f"--tree ({nodes} nodes) cannot reach the depth of the draft tokens ({depth}): "
            "give at least that many nodes or fewer draft tokens"
        )
    if lookup < 0 or nodes - lookup < depth:
        raise ValueError(
            f"--lookup must be >= 0 and leave the head at least the draft depth ({depth}) of "
            f"the --tree's {nodes} nodes, got {lookup}"
        )
    return Tree(nodes, depth, branch, lookup=lookup)


def parse_mesh(text: str | None):
    """--mesh DATAxMODEL as a `jax.sharding.Mesh` over all devices (None: no mesh)."""
    import jax

    if text is None:
        return None
    try:
        data, model = (int(x) for x in text.lower().split("x"))
        if data < 1 or model < 1:
            raise ValueError("each axis needs at least one device")
        return jax.make_mesh((data, model), ("data", "model"))
    except ValueError as e:
        raise ValueError(
            f"--mesh must be DATAxMODEL with {jax.device_count()} devices in all, "
            f"got {text!r} ({e})"
        ) from None
