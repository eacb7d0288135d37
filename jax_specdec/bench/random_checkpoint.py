"""A Llama-shaped Hugging Face checkpoint of constant weights, written file by file, for
measuring loads and steps at a real model's shapes (a step's time does not depend on the
weights' values) where the model itself cannot be fetched or carried: written on the
machine that measures it."""

from __future__ import annotations

import json
import pathlib

import numpy as np

__all__ = ["LLAMA_1B", "LLAMA_8B", "write_llama_checkpoint"]

# Llama-3.1-8B's shapes, and TinyLlama-1.1B's (2.2 GB in bfloat16).
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    rope_theta=10000.0,
)


def _layer(c: dict) -> dict[str, tuple[int, ...]]:
    D, F = c["hidden_size"], c["intermediate_size"]
    kv = D // c["num_attention_heads"] * c["num_key_value_heads"]
    return {
        "input_layernorm.weight": (D,),
        "post_attention_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (D, D),
        "self_attn.k_proj.weight": (kv, D),
        "self_attn.v_proj.weight": (kv, D),
        "self_attn.o_proj.weight": (D, D),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }


def write_llama_checkpoint(
    directory, shape: dict, *, files: int = 4, dtype: str = "bfloat16", value: float = 0.01
) -> int:
    """Writes `LlamaForCausalLM` of `shape` (`LLAMA_8B`, `LLAMA_1B` or the like) into
    `directory` (created): config.json, `files` safetensors files and their index, every
    weight `value`; one file's tensors in memory at a time. Returns the bytes written."""
    import ml_dtypes
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True)
    c = shape
    D, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    parts: list[dict] = [{} for _ in range(files)]
    parts[0]["model.embed_tokens.weight"] = (V, D)
    for i in range(L):
        parts[i * files // L].update({f"model.layers.{i}.{k}": s for k, s in _layer(c).items()})
    parts[-1].update({"model.norm.weight": (D,), "lm_head.weight": (V, D)})
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    weight_map, size = {}, 0
    for n, shapes in enumerate(parts):
        name = f"model-{n + 1:05d}-of-{files:05d}.safetensors"
        tensors = {k: np.full(s, value, np_dtype) for k, s in shapes.items()}
        save_file(tensors, directory / name, metadata={"format": "pt"})
        del tensors
        size += (directory / name).stat().st_size
        weight_map.update(dict.fromkeys(shapes, name))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config = dict(c, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=dtype)
    config.update(max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return size
