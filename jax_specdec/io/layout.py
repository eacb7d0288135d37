"""The tensor layout shared by Hugging Face and GGUF import: every Hugging Face tensor a
`TransformerConfig` implies, with its shape and how it maps onto our parameters, and the
model built from such parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec.nn import Transformer, TransformerConfig

__all__ = ["Direct", "Entry", "build_model", "hf_entries"]

# One HF tensor -> our parameters: (hf name, hf shape, convert(array) -> {our path: array}).
Entry = tuple[str, tuple[int, ...], Callable[[np.ndarray], dict[tuple, np.ndarray]]]


def hf_entries(config: TransformerConfig, arch: str) -> list[Entry]:
    """Every HF tensor the config implies, with its shape and how it maps to our params."""
    if arch == "GPT2LMHeadModel":
        return _gpt2_entries(config)
    return llama_entries(config)


@dataclasses.dataclass(frozen=True)
class Direct:
    """The convert of a tensor that is one parameter (transposed: HF's [out, in] for our
    [in, out] kernel); a loader onto a mesh reads such a tensor by slices."""

    path: tuple
    transpose: bool = False

    def __call__(self, array: np.ndarray) -> dict[tuple, np.ndarray]:
        return {self.path: array.T if self.transpose else array}


class Entries(list):
    """A list of `Entry`, with `add` for the tensors that map onto one parameter."""

    def add(self, name, shape, path, transpose=False):
        self.append((name, shape, Direct(path, transpose)))


def _gpt2_entries(c: TransformerConfig) -> list[Entry]:
    D, F, V = c.d_model, c.mlp_dim, c.vocab_size
    entries = Entries()
    entries.add("transformer.wte.weight", (V, D), ("embed",))
    entries.add("transformer.wpe.weight", (c.max_len, D), ("pos_embed",))
    for i in range(c.num_layers):
        h, b = f"transformer.h.{i}.", ("blocks", i)

        def split(a, b=b):  # c_attn holds q, k and v side by side
            q, k, v = np.split(a, 3, axis=-1)
            kind = "kernel" if a.ndim == 2 else "bias"
            return {(*b, "attn", n, kind): x for n, x in zip("qkv", (q, k, v), strict=True)}

        entries.add(h + "ln_1.weight", (D,), (*b, "attn_norm", "scale"))
        entries.add(h + "ln_1.bias", (D,), (*b, "attn_norm", "bias"))
        entries.append((h + "attn.c_attn.weight", (D, 3 * D), split))
        entries.append((h + "attn.c_attn.bias", (3 * D,), split))
        for name, ours, shape in (
            ("attn.c_proj.weight", ("attn", "o", "kernel"), (D, D)),
            ("attn.c_proj.bias", ("attn", "o", "bias"), (D,)),
            ("ln_2.weight", ("mlp_norm", "scale"), (D,)),
            ("ln_2.bias", ("mlp_norm", "bias"), (D,)),
            ("mlp.c_fc.weight", ("mlp", "up", "kernel"), (D, F)),
            ("mlp.c_fc.bias", ("mlp", "up", "bias"), (F,)),
            ("mlp.c_proj.weight", ("mlp", "down", "kernel"), (F, D)),
            ("mlp.c_proj.bias", ("mlp", "down", "bias"), (D,)),
        ):
            entries.add(h + name, shape, (*b, *ours))
    entries.add("transformer.ln_f.weight", (D,), ("final_norm", "scale"))
    entries.add("transformer.ln_f.bias", (D,), ("final_norm", "bias"))
    if not c.tie_embeddings:
        entries.add("lm_head.weight", (V, D), ("lm_head",), transpose=True)
    return entries


# HF norm name -> ours. Llama's post_attention_layernorm is the MLP's input norm; Gemma's
# (post_norms) normalises the attention's output, pre_feedforward_layernorm the MLP's input.
_LLAMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"))
_GEMMA_NORMS = (
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "attn_post_norm"),
    ("pre_feedforward_layernorm", "mlp_norm"),
    ("post_feedforward_layernorm", "mlp_post_norm"),
)


def llama_entries(c: TransformerConfig) -> list[Entry]:
    """Llama's tensors (Qwen2/3, Mistral and Gemma 2/3 included: the MLP's gate_proj is
    GeGLU's gate for Gemma, Qwen3 and Gemma 3 add the q/k norms, Gemma its post norms)."""
    D, F, V = c.d_model, c.mlp_dim, c.vocab_size
    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    entries = Entries()
    entries.add("model.embed_tokens.weight", (V, D), ("embed",))
    for i in range(c.num_layers):
        h, b = f"model.layers.{i}.", ("blocks", i)
        for name, ours in _GEMMA_NORMS if c.post_norms else _LLAMA_NORMS:
            entries.add(f"{h}{name}.weight", (D,), (*b, ours, "scale"))
        for module, name, dim_in, dim_out, bias in (
            ("self_attn", "q", D, qd, c.qkv_bias),
            ("self_attn", "k", D, kvd, c.qkv_bias),
            ("self_attn", "v", D, kvd, c.qkv_bias),
            ("self_attn", "o", qd, D, c.out_bias),
            ("mlp", "gate", D, F, c.mlp_bias),
            ("mlp", "up", D, F, c.mlp_bias),
            ("mlp", "down", F, D, c.mlp_bias),
        ):
            ours = (*b, "attn" if module == "self_attn" else "mlp", name)
            entries.add(
                f"{h}{module}.{name}_proj.weight", (dim_out, dim_in), (*ours, "kernel"), True
            )
            if bias:
                entries.add(f"{h}{module}.{name}_proj.bias", (dim_out,), (*ours, "bias"))
        for name in ("q_norm", "k_norm") if c.qk_norm else ():  # Qwen3's per-head norms
            entries.add(f"{h}self_attn.{name}.weight", (c.head_dim,), (*b, "attn", name, "scale"))
    entries.add("model.norm.weight", (D,), ("final_norm", "scale"))
    if not c.tie_embeddings:
        entries.add("lm_head.weight", (V, D), ("lm_head",), transpose=True)
    return entries


def build_model(
    config: TransformerConfig, parts: Iterable[dict[tuple, np.ndarray]] | None
) -> Transformer:
    """A `Transformer` built abstractly, then filled from `parts`.

    Each part maps parameter paths (as in `nnx.to_flat_state`) to host arrays; it is
    cast to the parameter dtype as it arrives, so only one host tensor lives at a time
    when `parts` is a generator. Every parameter must be covered exactly once. `parts`
    None returns the abstract model (every parameter a `jax.ShapeDtypeStruct`).
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    if parts is None:
        return abstract
    graphdef, abstract_state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(abstract_state))
    values: dict[tuple, jax.Array] = {}
    for part in parts:
        for param_path, array in part.items():
            dtype = targets[param_path].get_value().dtype
            values[param_path] = jnp.asarray(array, dtype=dtype)
    if set(values) != set(targets):  # a mapping bug, not a user error
        raise AssertionError(f"unmapped parameters: {sorted(set(targets) - set(values))}")
    for param_path, leaf in targets.items():
        leaf.set_value(values[param_path])
    return nnx.merge(graphdef, abstract_state)
