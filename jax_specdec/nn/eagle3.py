"""An EAGLE-3 draft head, as the `speculators` library defines it (Li et al. 2025, EAGLE-3,
arXiv 2503.01840).

The head reads the target's hidden states from a few of its layers (`aux_layer_ids`,
by default a low, a middle and a high one), concatenated [B, T, n·Ht] and projected
by `fc` to its width H. Entry i pairs that feature of position i - 1 with the
embedding of token i, as `FeatureHead` does. Its first decoder layer attends over
[input_layernorm(embedding); hidden_norm(hidden)] (2H wide: q, k and v take 2H in),
its residual is the hidden part (normed first with `norm_before_residual`); further
layers are plain decoder layers. The layer's output is the head's new hidden state:
for a later draft step it takes the place of the fused feature (EAGLE-3 feeds its
own output back). Logits cover a draft vocabulary of K tokens: `vocab_map` [K] holds
their target ids, draft id d being target id d + d2t[d] in the files' terms.

The norms of `speculators`' variants: `norm_before_fc` (one RMSNorm over the
concatenated features before `fc`), `fc_norm` (one RMSNorm per target layer's
feature), `norm_output` (the final norm is applied to the hidden state that is fed
back, not only to the logits' input). A "qwen3" layer has RMSNorms over each query and
key head before the rotary embedding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_specdec.nn.cache import KVCache, write_entries
from jax_specdec.nn.config import TransformerConfig
from jax_specdec.nn.feature_head import decode_layers, previous_features, unrolled_pass
from jax_specdec.nn.products import matmul
from jax_specdec.nn.transformer import Attention, Dense, Mlp, Norm

__all__ = ["Eagle3Config", "Eagle3Head", "default_aux_layer_ids"]

_F32 = jnp.float32
STYLES = ("llama", "qwen3")


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads when its config names none: a low, a
    middle and a high one (2, L // 2, L - 3), as `speculators` and vLLM choose them.
    Layer id l is the residual stream entering the target's decoder layer l (Hugging
    Face's `hidden_states[l]`; l = L is the last layer's output before the final norm).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 6:
        raise ValueError(
            f"num_layers must be an integer >= 6 for the default EAGLE-3 layers "
            f"(2, L // 2, L - 3), got {num_layers!r}: name the layers explicitly"
        )
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Shape and variant of an EAGLE-3 head; frozen and hashable.

    Attributes:
      layer: the decoder layers' shape (d_model H, heads, MLP, rotary base, norm_eps,
        num_layers), with vocab_size the target's vocabulary V.
      draft_vocab_size: K, the tokens the head scores (1 <= K <= V).
      style: "llama" or "qwen3" (q/k norms).
      aux_layer_ids: the target layers read; () for `default_aux_layer_ids` (three).
      target_hidden_size: the target's width Ht (fc reads n·Ht); 0 for H.
      norm_before_residual, norm_before_fc, fc_norm, norm_output: see the module doc.
      has_embed: the head stores its own token embedding [V, H] (else the target's is
        passed in).
      verifier: the target's name or path, as the head's files name it.
      verifier_architectures: the target's architectures, as its config.json says.
      speculative_tokens: the draft length the head was published with.
    """

    layer: TransformerConfig
    draft_vocab_size: int
    style: str = "llama"
    aux_layer_ids: tuple[int, ...] = ()
    target_hidden_size: int = 0
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    has_embed: bool = True
    verifier: str = ""
    verifier_architectures: tuple[str, ...] = ()
    speculative_tokens: int = 3

    def __post_init__(self):
        if not isinstance(self.layer, TransformerConfig):
            raise TypeError(f"Eagle3Config.layer must be a TransformerConfig, got {self.layer!r}")
        c = self.layer
        if (c.norm, c.position, c.mlp) != ("rms", "rope", "swiglu"):
            raise ValueError("Eagle3Config.layer must be Llama-style (rms, rope, swiglu)")
        k, v = self.draft_vocab_size, c.vocab_size
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
            raise ValueError(f"Eagle3Config.draft_vocab_size must be in [1, {v}], got {k!r}")
        if self.style not in STYLES:
            raise ValueError(f"Eagle3Config.style must be one of {STYLES}, got {self.style!r}")
        ids = self.aux_layer_ids
        if not isinstance(ids, tuple) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(
                f"Eagle3Config.aux_layer_ids must be a tuple of layer ids >= 0, got {ids!r}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"Eagle3Config.aux_layer_ids must be distinct, got {ids!r}")
        if not isinstance(self.target_hidden_size, int) or self.target_hidden_size < 0:
            raise ValueError(
                f"Eagle3Config.target_hidden_size must be an integer >= 0, "
                f"got {self.target_hidden_size!r}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config.norm_before_fc and fc_norm exclude each other")
        if self.features_size == c.d_model:
            raise ValueError(
                f"Eagle3Config: the fused features ({self.features_size}) must differ in size "
                f"from the head's hidden state ({c.d_model}), which takes their place later"
            )

    @property
    def d_model(self) -> int:
        return self.layer.d_model

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size V."""
        return self.layer.vocab_size

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) or 3

    @property
    def features_size(self) -> int:
        """The width of the target's concatenated features, fc's input."""
        return self.num_aux * (self.target_hidden_size or self.layer.d_model)

    def replace(self, **overrides) -> Eagle3Config:
        return dataclasses.replace(self, **overrides)


class Eagle3Layer(nnx.Module):
    """A decoder layer; the first one (`first`) reads [embedding; hidden] (2H)."""

    def __init__(self, config: Eagle3Config, *, first: bool, key, scale):
        c = config.layer
        keys = jax.random.split(key, 7)
        self.attn_norm = Norm(c)  # input_layernorm: of the embedding in the first layer
        self.hidden_norm = Norm(c) if first else None
        d_in = 2 * c.d_model if first else c.d_model
        qk_norm = config.style == "qwen3"
        self.attn = Attention(c, d_in=d_in, qk_norm=qk_norm, keys=keys[:4], scale=scale)
        self.mlp_norm = Norm(c)  # post_attention_layernorm
        self.mlp = Mlp(c, keys=keys[4:], scale=scale)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(self, x: jax.Array, embeds: jax.Array | None):
        """(residual [B, T, H], attention input [B, T, H or 2H])."""
        if self.hidden_norm is None:
            return x, self.attn_norm(x)
        hidden = self.hidden_norm(x)
        residual = hidden if self.norm_before_residual else x
        return residual, jnp.concatenate([self.attn_norm(embeds), hidden], axis=-1)


class Eagle3Head(nnx.Module):
    """fc (n·Ht -> H), decoder layers, norm; logits over the K draft tokens."""

    def __init__(self, config: Eagle3Config, *, rngs: nnx.Rngs, init_scale: float = 0.02):
        """Random weights ~ N(0, init_scale), norms 1; `vocab_map` starts as the first K
        ids."""
        if not isinstance(config, Eagle3Config):
            raise TypeError(f"config must be an Eagle3Config, got {type(config).__name__}")
        c = config.layer
        self.config = config
        k_fc, k_head, k_embed, k_layers = jax.random.split(rngs.params(), 4)
        d, f, n = c.d_model, config.features_size, config.num_aux
        self.input_norm = Norm(c.replace(d_model=f)) if config.norm_before_fc else None
        per_layer = c.replace(d_model=f // n)
        self.fc_norm = nnx.List([Norm(per_layer) for _ in range(n)]) if config.fc_norm else None
        self.fc = Dense(f, d, bias=False, config=c, key=k_fc, scale=init_scale)
        layer_keys = jax.random.split(k_layers, c.num_layers)
        self.layers = nnx.List(
            [
                Eagle3Layer(config, first=i == 0, key=k, scale=init_scale)
                for i, k in enumerate(layer_keys)
            ]
        )
        self.norm = Norm(c)
        head = init_scale * jax.random.normal(k_head, (d, config.draft_vocab_size), _F32)
        self.lm_head = nnx.Param(head.astype(c.jnp_param_dtype))
        embed = init_scale * jax.random.normal(k_embed, (c.vocab_size, d), _F32)
        self.embed = nnx.Param(embed.astype(c.jnp_param_dtype)) if config.has_embed else None
        self.vocab_map = nnx.Variable(jnp.arange(config.draft_vocab_size, dtype=jnp.int32))

    def fuse(self, features: jax.Array) -> jax.Array:
        """[B, T, n·Ht] the target's concatenated layer features -> [B, T, H]."""
        x = features.astype(self.config.layer.jnp_dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            parts = jnp.split(x, len(self.fc_norm), axis=-1)
            x = jnp.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, H] hidden states (as `decode_entries` returns them) -> [B, T, K] float32
        logits of the draft tokens."""
        normed = hidden if self.config.norm_output else self.norm(hidden)
        return matmul(normed, self.lm_head[...], preferred_element_type=_F32)

    def target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> the target's ids (d + d2t[d])."""
        return self.vocab_map[...][draft_ids]

    def _embedding(self, embed):
        if embed is None:
            if self.embed is None:
                raise ValueError("embed is required: this head stores no token embedding")
            return self.embed[...]
        return jnp.asarray(embed)

    def _hidden(self, hidden: jax.Array) -> jax.Array:
        """The target's features are fused; the head's own hidden state passes as it is."""
        size, c = hidden.shape[-1], self.config
        if size == c.features_size:
            return self.fuse(hidden)
        if size != c.d_model:
            raise ValueError(
                f"hidden must be the target's features [.., {c.features_size}] or the head's "
                f"hidden state [.., {c.d_model}], got last dimension {size}"
            )
        return hidden.astype(c.layer.jnp_dtype)

    def unrolled(self, prev_features, tokens, embed, steps: int):
        """Teacher-forced passes for draft steps 1 … `steps` (training, no cache), each
        entry attending to what it attends to in the loop, as `FeatureHead.unrolled`
        says: pass 1 reads the target's features before each token (`prev_features`
        [B, T, n·Ht], zeros first), pass s + 1 the hidden states pass s gave the entry
        before (EAGLE-3's "training-time test").

        Returns:
          per step, (logits [B, T, K] float32, hidden states [B, T, H]); step s + 1 at
          entry i < s has no round behind it.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        embeds = self._embedding(embed)[tokens]
        earlier, out, prev = [], [], prev_features  # earlier[m][layer] = (k, v)
        for _ in range(steps):
            x = self._hidden(prev)
            inputs = lambda layer, x: layer.attention_input(x, embeds.astype(x.dtype))  # noqa: E731
            x, this = unrolled_pass(self.layers, x, inputs, earlier)
            earlier.append(this)
            hidden = self.norm(x) if self.config.norm_output else x
            out.append((self.logits(hidden), hidden))
            prev = previous_features(hidden)
        return out

    def decode_entries(self, hidden, tokens, embed, cache: KVCache, start, recent=(), own=None):
        """Entries at positions start[b] + t on a read-only cache; their keys and values
        are returned for the caller to write.

        Args:
          hidden: [B, T, n·Ht] the target's features before each token (fused here), or
            [B, T, H] the head's own hidden states (later draft steps).
          tokens: [B, T] token ids (the target's vocabulary).
          embed: [V, H] the token embedding, or None for the head's own.
          cache: the head's cache; row b's first cache.lengths[b] positions are attended.
          start: [B] int32, the position of each row's first new entry (the others
            follow it), or [B, T] the position of each entry.
          recent: entries not yet in the cache, attended too: a sequence of
            (keys, values, valid), keys and values per layer [B, R, K, hd], valid
            [B, R] bool (for every new entry) or [B, T, R] (per new entry).
          own: [B or 1, T, T] bool, which new entries each attends to; None: causal.

        Returns:
          the new hidden states [B, T, H] (what `logits` reads and a next draft step is
          fed), and per layer the new keys and values [B, T, K, hd].
        """
        x = self._hidden(hidden)
        embeds = self._embedding(embed)[tokens].astype(x.dtype)
        x, keys, values = decode_layers(
            self.layers,
            x,
            lambda layer, x: layer.attention_input(x, embeds),
            cache,
            start,
            recent,
            own,
        )
        return (self.norm(x) if self.config.norm_output else x), keys, values

    def decode(self, hidden, tokens, cache: KVCache, *, embed=None):
        """T entries per row appended at positions cache.lengths[b] + t.

        Args:
          hidden, tokens, embed: as `decode_entries`.
          cache: the head's `KVCache` (`init_cache(config.layer, ...)`).

        Returns:
          (logits [B, T, K] float32 over the draft vocabulary, the new hidden states
          [B, T, H], the cache with the entries written and lengths + T).
        """
        lengths = cache.lengths.astype(jnp.int32)
        out, keys, values = self.decode_entries(hidden, tokens, embed, cache, lengths)
        cache = write_entries(cache, keys, values, lengths)
        return self.logits(out), out, cache.replace(lengths=lengths + tokens.shape[1])
