"""The one-call forms: `speculative_generate` and `autoregressive_generate`, a `Generator`
built and called once."""

from __future__ import annotations

import jax

from jax_specdec.decode.api import Generator
from jax_specdec.decode.stats import GenerationOutput
from jax_specdec.nn import Transformer

__all__ = ["autoregressive_generate", "speculative_generate"]


def speculative_generate(
    target: Transformer,
    draft,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens,
    prompt_lengths=None,
    num_slots: int | None = None,
    sampling=None,
    **settings,
) -> GenerationOutput:
    """Generates with speculative decoding; distributed exactly as sampling from `target`.

    `Generator(target, draft, **settings)(prompts, key=..., max_new_tokens=...)`: see
    `Generator` for `schedule` (an int γ or a policy; `num_draft_tokens` is an alias),
    `eos_token_id`, `vocab_size`, `pad_token_id`, `mesh`, and `Generator.bind` for the
    prompts, key, budgets, `num_slots` and `sampling` (one setting or one per prompt;
    default greedy).

    Returns:
      GenerationOutput(tokens [B, max_new_tokens], lengths [B], stats).
    """
    if draft is None:
        raise TypeError(
            "draft must be a draft model or a proposer; for plain decoding use "
            "autoregressive_generate"
        )
    generator = Generator(target, draft, **settings)
    return generator(
        prompts,
        key=key,
        max_new_tokens=max_new_tokens,
        prompt_lengths=prompt_lengths,
        num_slots=num_slots,
        sampling=sampling,
    )


def autoregressive_generate(
    target: Transformer,
    prompts,
    *,
    key: jax.Array,
    max_new_tokens,
    prompt_lengths=None,
    num_slots: int | None = None,
    sampling=None,
    **settings,
) -> GenerationOutput:
    """Plain decoding, one target call per token: `Generator(target, **settings)` called on
    the prompts (`eos_token_id`, `pad_token_id`, `mesh`; `num_slots` and `sampling`, one
    setting or one per prompt, default greedy, as in `Generator.bind`)."""
    generator = Generator(target, **settings)
    return generator(
        prompts,
        key=key,
        max_new_tokens=max_new_tokens,
        prompt_lengths=prompt_lengths,
        num_slots=num_slots,
        sampling=sampling,
    )
