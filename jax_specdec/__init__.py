"""jax_specdec: exact speculative decoding in JAX/XLA."""

from jax_specdec.acceptance import AcceptResult, accept
from jax_specdec.decode import (
    GenerationOutput,
    GenerationStats,
    autoregressive_generate,
    speculative_generate,
)
from jax_specdec.exact import one_position, round_distribution
from jax_specdec.sampling import SamplingConfig, probs_from_logits

__all__ = [
    "AcceptResult",
    "GenerationOutput",
    "GenerationStats",
    "autoregressive_generate",
    "speculative_generate",
    "SamplingConfig",
    "accept",
    "one_position",
    "probs_from_logits",
    "round_distribution",
]
