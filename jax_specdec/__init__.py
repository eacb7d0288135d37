"""jax_specdec: exact speculative decoding in JAX/XLA."""

from jax_specdec.acceptance import AcceptResult, accept
from jax_specdec.decode import (
    Drafter,
    GenerationOutput,
    GenerationStats,
    Generator,
    NGram,
    Run,
    as_drafter,
    autoregressive_generate,
    score,
    speculative_generate,
)
from jax_specdec.exact import one_position, round_distribution
from jax_specdec.io.draft import load_draft
from jax_specdec.io.heads import load_head, save_head
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.sampling import SamplingConfig, probs_from_logits
from jax_specdec.schedules import Auto, Confidence, Constant, CostModel, Custom, Heuristic

__all__ = [
    "AcceptResult",
    "Auto",
    "Confidence",
    "Constant",
    "CostModel",
    "Custom",
    "Drafter",
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
    "as_drafter",
    "autoregressive_generate",
    "load_draft",
    "load_head",
    "one_position",
    "probs_from_logits",
    "round_distribution",
    "save_head",
    "score",
    "speculative_generate",
]
