"""NNX model code: the transformer, its config and its key/value cache."""

from jax_specdec.nn.cache import KVCache, init_cache, write_entries
from jax_specdec.nn.config import TransformerConfig
from jax_specdec.nn.transformer import Transformer

__all__ = ["KVCache", "Transformer", "TransformerConfig", "init_cache", "write_entries"]
