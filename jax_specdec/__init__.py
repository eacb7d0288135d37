"""jax_specdec: exact speculative decoding in JAX/XLA."""

from jax_specdec.acceptance import AcceptResult, accept
from jax_specdec.decode import (
    GenerationOutput,
    GenerationStats,
    Generator,
    NGram,
    Run,
    autoregressive_generate,
    speculative_generate,
)
from jax_specdec.exact import one_position, round_distribution
from jax_specdec.io.heads import load_head, save_head
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.sampling import SamplingConfig, probs_from_logits
from jax_specdec.schedules import Confidence, Constant, CostModel, Custom, Heuristic

__all__ = [
    "AcceptResult",
    "Confidence",
    "Constant",
    "CostModel",
    "Custom",
    "FeatureHead",
    "FeatureHeadConfig",
    "GenerationOutput",
    "GenerationStats",
    "Generator",
    "Heuristic",
    "NGram",
    "Run",
    "SamplingConfig",
    "accept",
    "autoregressive_generate",
    "load_head",
    "one_position",
    "probs_from_logits",
    "round_distribution",
    "save_head",
    "speculative_generate",
]
