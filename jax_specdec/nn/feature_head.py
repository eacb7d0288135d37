"""A draft head that reads the target's hidden states (EAGLE-style), with a truncated
vocabulary.

Entry i of the head pairs the target's feature at position i - 1 (its top layer's
hidden state after the final norm; zeros for i = 0) with the embedding of token i.
One dense layer maps the pair [2D] to D, decoder layers (with their own key/value
cache) follow, and a norm gives the head's prediction of the target's feature at
position i. Its logits cover K kept tokens only: `vocab_map` [K] lists their ids in
the target's vocabulary (the drafter scatters them into V, zero probability
elsewhere). The token embedding is the target's own, passed in, never stored here.

Li et al. 2024 (EAGLE, arXiv 2401.15077) for the head; Zhao et al. 2025 (FR-Spec,
arXiv 2502.14856) for the truncated vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_specdec.nn.attention import (
    cached_attention,
    heads_first,
    live_index,
    live_sizes,
    position_bytes,
)
from jax_specdec.nn.cache import KVCache
from jax_specdec.nn.config import TransformerConfig
from jax_specdec.nn.products import matmul
from jax_specdec.nn.transformer import Block, Dense, Norm

__all__ = ["FeatureHead", "FeatureHeadConfig", "previous_features"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class FeatureHeadConfig:
    """Shape of a feature head, and which target it drafts for.

    Attributes:
      layer: the decoder layers' shape: d_model is the target's hidden size, vocab_size
        the target's vocabulary, num_layers the head's depth.
      kept: K, the number of tokens the head scores (1 <= K <= layer.vocab_size).
      target: a name for the target it was trained for (shown in errors).
      tokenizer_sha256: SHA-256 of the target tokenizer's JSON, or "" if unknown.
      tree_acceptance: the head's measured acceptance in sampled trees, by depth and
        child rank (`decode.tree_accept.static_shape`'s `rates`), read from the
        `tree_acceptance.json` beside its weights (`io.head_acceptance`); () unmeasured.
        A measurement of these weights, not part of the head's shape: `to_dict` leaves
        it out, so a head trained further does not inherit it.
    """

    layer: TransformerConfig
    kept: int
    target: str = ""
    tokenizer_sha256: str = ""
    tree_acceptance: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        if not isinstance(self.layer, TransformerConfig):
            raise TypeError(
                f"FeatureHeadConfig.layer must be a TransformerConfig, got {type(self.layer)}"
            )
        object.__setattr__(self, "tree_acceptance", _rates(self.tree_acceptance))
        k, v = self.kept, self.layer.vocab_size
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
            raise ValueError(f"FeatureHeadConfig.kept must be an integer in [1, {v}], got {k!r}")

    @property
    def d_model(self) -> int:
        return self.layer.d_model

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size."""
        return self.layer.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer.to_dict(),
            "kept": self.kept,
            "target": self.target,
            "tokenizer_sha256": self.tokenizer_sha256,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureHeadConfig:
        unknown = sorted(set(data) - {"layer", "kept", "target", "tokenizer_sha256"})
        if unknown:
            raise ValueError(f"unknown FeatureHeadConfig fields: {unknown}")
        layer = TransformerConfig.from_dict(data["layer"])
        return cls(layer, data["kept"], data.get("target", ""), data.get("tokenizer_sha256", ""))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def for_target(
        cls, config: TransformerConfig, kept: int, *, target: str = "", tokenizer_sha256="", **layer
    ) -> FeatureHeadConfig:
        """A head shaped like the target's layers (`config`: d, heads, MLP), one layer
        unless `layer` overrides it; its layers attend globally (no sliding window)."""
        fields = {"num_layers": 1, "tie_embeddings": False, "sliding_window": None,
                  "local_layers": (), **layer}  # fmt: skip
        return cls(config.replace(**fields), kept, target, tokenizer_sha256)


def _rates(table) -> tuple[tuple[float, ...], ...]:
    """`FeatureHeadConfig.tree_acceptance` as a tuple of non-empty tuples of floats in
    [0, 1] (what `static_shape` grows a tree from); raises ValueError naming it."""
    try:
        rows = tuple(tuple(float(r) for r in row) for row in table)
    except (TypeError, ValueError):
        rows = None
    if rows is None or not all(rows) or not all(0 <= r <= 1 for row in rows for r in row):
        raise ValueError(
            "FeatureHeadConfig.tree_acceptance must be rows of rates in [0, 1] (depth by "
            f"child rank, no NaN) or (), got {table!r}"
        )
    return rows


def previous_features(features: jax.Array) -> jax.Array:
    """[B, T, D] features of positions 0 … T-1 -> the feature before each entry: entry
    i gets feature i - 1, entry 0 zeros."""
    return jnp.pad(features[:, :-1], ((0, 0), (1, 0), (0, 0)))


def decode_layers(layers, x, attention_input, cache: KVCache, start, recent=(), own=None):
    """A head's decoder `layers` over T new entries `x` [B, T, ·] at positions start[b] + t
    (or start [B, T]), attending to the cache's live entries, the `recent` ones and, per
    `own` (None: causal), each other. `attention_input(layer, x)` is (residual, the
    attention's input). Returns x [B, T, H] and per layer the new keys and values."""
    T = x.shape[1]
    positions = jnp.asarray(start).astype(jnp.int32)
    if positions.ndim == 1:
        positions = positions[:, None] + jnp.arange(T, dtype=jnp.int32)
    sizes = live_sizes(cache.max_len, position_bytes=position_bytes(cache.keys[0]))
    index = live_index(cache.lengths, sizes)
    own = jnp.tril(jnp.ones((T, T), bool))[None] if own is None else own
    recent = [(rk, rv, ok if ok.ndim == 3 else ok[:, None]) for rk, rv, ok in recent]
    keys, values = [], []
    for i, layer in enumerate(layers):
        residual, inputs = attention_input(layer, x)
        q, k, v = layer.attn.project(inputs, positions)
        others = [(heads_first(rk[i]), heads_first(rv[i]), ok) for rk, rv, ok in recent]
        others.append((heads_first(k), heads_first(v), own))
        attended = cached_attention(
            q, cache.keys[i], cache.values[i], cache.lengths, others, sizes, index,
            scale=layer.attn.score_scale, softcap=layer.attn.softcap,  # as `unrolled_pass`
        )  # fmt: skip
        x = residual + layer.attn.output(attended)
        x = x + layer.mlp(layer.mlp_norm(x))
        keys.append(k)
        values.append(v)
    return x, tuple(keys), tuple(values)


def unrolled_parts(earlier, layer: int, k: jax.Array, v: jax.Array):
    """The key/value parts (k, v, mask) that pass s + 1 = len(earlier) + 1 of a head's
    `unrolled` attends to in `layer`, its own keys k, v [B, K, T, hd]: pass 1's keys
    below a causal mask lagging by s, each earlier pass m + 1's on one diagonal, and its
    own entry's."""
    s, T = len(earlier), k.shape[2]
    rows, cols = jnp.arange(T)[:, None], jnp.arange(T)[None]
    parts = [(*(earlier[0][layer] if s else (k, v)), (cols <= rows - s)[None])]
    parts += [(*earlier[m][layer], (cols == rows - s + m)[None]) for m in range(1, s)]
    return parts + ([(k, v, (cols == rows)[None])] if s else [])


def unrolled_pass(layers, x, attention_input, earlier):
    """Pass s + 1 = len(earlier) + 1 of a head's `unrolled` (training, no cache): its
    decoder `layers` over x [B, T, ·] at positions 0 … T − 1, attending as
    `unrolled_parts` says; `attention_input(layer, x)` is (residual, the attention's
    input). Returns x [B, T, H] and this pass's keys and values per layer."""
    B, T = x.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    this = []
    for i, layer in enumerate(layers):
        residual, inputs = attention_input(layer, x)
        q, k, v = layer.attn.project(inputs, positions)
        k, v = heads_first(k), heads_first(v)
        this.append((k, v))
        x = residual + layer.attn.attend(q, unrolled_parts(earlier, i, k, v))
        x = x + layer.mlp(layer.mlp_norm(x))
    return x, this


class FeatureHead(nnx.Module):
    """FC (2D -> D), decoder layers, norm; logits over the K kept tokens."""

    def __init__(self, config: FeatureHeadConfig, *, rngs: nnx.Rngs, init_scale: float = 0.02):
        """Random weights ~ N(0, init_scale); `vocab_map` starts as the first K ids."""
        if not isinstance(config, FeatureHeadConfig):
            raise TypeError(f"config must be a FeatureHeadConfig, got {type(config).__name__}")
        c = config.layer
        self.config = config
        k_fc, k_head, k_blocks = jax.random.split(rngs.params(), 3)
        d = c.d_model
        self.fc = Dense(2 * d, d, bias=False, config=c, key=k_fc, scale=init_scale)
        block_keys = jax.random.split(k_blocks, c.num_layers)
        self.blocks = nnx.List([Block(c, key=k, scale=init_scale) for k in block_keys])
        self.norm = Norm(c)
        head = init_scale * jax.random.normal(k_head, (d, config.kept), _F32)
        self.lm_head = nnx.Param(head.astype(c.jnp_param_dtype))
        self.vocab_map = nnx.Variable(jnp.arange(config.kept, dtype=jnp.int32))

    def logits(self, predicted: jax.Array) -> jax.Array:
        """[B, T, D] predicted features -> [B, T, K] float32 logits of the kept tokens."""
        return matmul(predicted, self.lm_head[...], preferred_element_type=_F32)

    def _inputs(self, prev_features, tokens, embed):
        dtype = self.config.layer.jnp_dtype
        tokens_in = jnp.asarray(embed)[tokens].astype(dtype)
        return self.fc(jnp.concatenate([prev_features.astype(dtype), tokens_in], axis=-1))

    def __call__(self, prev_features: jax.Array, tokens: jax.Array, embed: jax.Array):
        """Teacher-forced pass over whole sequences (training), no cache.

        Args:
          prev_features: [B, T, D], the target's feature before each token (zeros first).
          tokens: [B, T] token ids.
          embed: [V, D] the target's token embedding.

        Returns:
          (logits [B, T, K] float32, predicted features [B, T, D]).
        """
        return self.unrolled(prev_features, tokens, embed, 1)[0]

    def unrolled(self, prev_features, tokens, embed, steps: int):
        """Teacher-forced passes for draft steps 1 … `steps`, each entry attending to
        what it attends to in the loop.

        In the loop, draft s + 1 of a round whose pending position is p comes from the
        entry at i = p + s fed (the head's step-s prediction at i - 1, x_i); it
        attends to the entries of positions ≤ p made from the target's own features,
        and to the round's earlier draft entries p + 1 … i - 1 (step m at p + m - 1).
        So pass s + 1 reuses pass 1's keys and values below a causal mask lagging by
        s, and each earlier pass m + 1's keys on one diagonal (EAGLE-3's
        "training-time test", Li et al. 2025, arXiv 2503.01840).

        Args:
          prev_features, tokens, embed: as `__call__` (pass 1's input).
          steps: number of draft steps.

        Returns:
          per step, (logits [B, T, K] float32, predicted features [B, T, D]); step s + 1
          at entry i < s has no round behind it.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        earlier, out, prev = [], [], prev_features  # earlier[m][layer] = (k, v)
        for _ in range(steps):
            x = self._inputs(prev, tokens, embed)
            x, this = unrolled_pass(self.blocks, x, lambda b, x: (x, b.attn_norm(x)), earlier)
            earlier.append(this)
            predicted = self.norm(x)
            out.append((self.logits(predicted), predicted))
            prev = previous_features(predicted)
        return out

    def decode_entries(
        self, prev_features, tokens, embed, cache: KVCache, start, recent=(), own=None
    ):
        """Entries at positions start[b] + t on a read-only cache; their keys and values
        are returned for the caller to write.

        Args:
          prev_features: [B, T, D]; tokens: [B, T]; embed: [V, D] (as `__call__`).
          cache: the head's cache; row b's first cache.lengths[b] positions are attended.
          start: [B] int32, the position of each row's first new entry (the others
            follow it), or [B, T] the position of each entry.
          recent: entries not yet in the cache, attended too: a sequence of
            (keys, values, valid), keys and values per layer [B, R, K, hd], valid
            [B, R] bool (for every new entry) or [B, T, R] (per new entry).
          own: [B or 1, T, T] bool, which new entries each attends to; None: the
            causal mask (itself and those before it).

        Returns:
          predicted features [B, T, D] and per layer the new keys and values
          [B, T, K, hd]. Logits are the caller's (`logits`), for the entries it drafts
          from only: the LM head is most of a draft step's weights.
        """
        x = self._inputs(prev_features, tokens, embed)
        x, keys, values = decode_layers(
            self.blocks, x, lambda block, x: (x, block.attn_norm(x)), cache, start, recent, own
        )
        return self.norm(x), keys, values
