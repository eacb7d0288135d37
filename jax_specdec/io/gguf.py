"""GGUF import (llama.cpp's file format): config, dequantized weights, conversion.

`load_gguf_model(path)` reads a `.gguf` file with the `gguf` package (llama.cpp's own
reader, which memory-maps the file), builds the `TransformerConfig` from the file's
metadata and dequantizes one tensor at a time into the requested dtype, so the peak
memory stays near one dequantized copy of the weights. `jax_specdec.io.hf.load_model`
calls it for `.gguf` paths. `convert_gguf(path, out_dir)` writes the same weights as a
Hugging Face directory.

Architectures: `llama` (llama.cpp stores Mistral models under it too), `qwen2`,
`qwen3` (its per-head q/k norms are `attn_q_norm`/`attn_k_norm`), `gemma2` and `gemma3`
(their switches and names: `io.gguf_gemma`). llama.cpp permutes the rows of the llama
q/k projections for its rotary kernel (`convert_hf_to_gguf.py`, `LlamaModel.permute`);
they are permuted back here. The other architectures' files are not permuted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jax_specdec.io import gguf_gemma
from jax_specdec.io.gguf_file import GGUFError, brief, field, open_gguf
from jax_specdec.io.hf_config import config_to_hf, default_dtype, dtype_name
from jax_specdec.io.layout import build_model, hf_entries
from jax_specdec.nn import Transformer, TransformerConfig

Path_ = str | os.PathLike

__all__ = [
    "ARCHITECTURES",
    "GGUFError",
    "config_from_gguf",
    "convert_gguf",
    "load_gguf_model",
    "open_gguf",
]

# GGUF general.architecture -> the Hugging Face architecture whose tensors it holds.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **gguf_gemma.GEMMA,
}
_PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp permutes

_MLP = ("gate", "up", "down")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"attn_{x}.{k}": f"self_attn.{x}_proj.{k}" for x in "qkv" for k in ("weight", "bias")},
    **{
        f"ffn_{x}.{k}": f"mlp.{x}_proj.{k}"
        for x in ("gate", "up", "down")
        for k in ("weight", "bias")
    },
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Files whose presence makes a directory a model (`convert_gguf` will not mix two).
_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "head_config.json",
    "tokenizer.json",
)


def config_from_gguf(reader, *, dtype=None) -> tuple[TransformerConfig, str]:
    """`(config, Hugging Face architecture)` from a GGUF file's metadata and tensor names."""
    file = reader.data.filename
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{file}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)}; Mistral models are stored as llama)"
        )
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    names = {t.name for t in reader.tensors}
    gemma = arch in gguf_gemma.GEMMA  # Gemma 3's linear scaling: gguf_gemma
    if (scaling not in ("none", "") and not gemma) or "rope_freqs.weight" in names:
        raise GGUFError(f"{file}: rope scaling ({scaling}) is not supported")

    def need(key):
        return field(reader, f"{arch}.{key}")

    d, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = field(reader, f"{arch}.attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = field(reader, "llama.rope.dimension_count", None)
    vocab = field(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(field(reader, "tokenizer.ggml.tokens"))
    bias = "blk.0.attn_q.bias" in names
    head_dim = int(head_dim or (d // heads if heads > 0 else 0))
    layers = int(need("block_count"))
    switches = dict(qk_norm=arch == "qwen3")
    if gemma:
        switches = gguf_gemma.gemma_switches(reader, arch, d, heads, head_dim, layers)
    try:
        config = TransformerConfig.llama(
            vocab_size=int(vocab),
            d_model=d,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            mlp_dim=int(need("feed_forward_length")),
            max_len=int(need("context_length")),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
            qkv_bias=bias,
            out_bias=bias and arch != "qwen2",  # qwen3's attention_bias covers o_proj
            mlp_bias="blk.0.ffn_up.bias" in names,
            tie_embeddings="output.weight" not in names,
            dtype=dtype_name(dtype or default_dtype()),
            param_dtype=dtype_name(dtype or default_dtype()),
            **switches,
        )
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{file}: metadata does not describe a valid model ({brief(e)})") from e
    return config, ARCHITECTURES[arch]


def _layer_names(arch: str) -> dict[str, str]:
    """GGUF -> Hugging Face names of a layer's tensors in a file of `arch`."""
    return {**_LAYER_NAMES, **gguf_gemma.LAYER_NAMES} if arch in gguf_gemma.GEMMA else _LAYER_NAMES


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor in a file of `arch` (its
    `general.architecture`), or None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m, names = _BLOCK.fullmatch(gguf_name), _layer_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF name of a Hugging Face tensor (inverse of `hf_tensor_name`)."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    for gguf_suffix, suffix in _layer_names(arch).items():
        if m and m.group(2) == suffix:
            return f"blk.{m.group(1)}.{gguf_suffix}"
    return hf_name


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head, pairs (i, i + hd/2) interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(path: Path_):
    """`(config, arch, iterator of (hf name, float32 array))` for a GGUF file.

    Names, shapes and tensor types are all checked before the iterator is returned;
    the iterator dequantizes one tensor per step.
    """
    reader = open_gguf(path)
    config, arch = config_from_gguf(reader)
    shapes = {name: shape for name, shape, _ in hf_entries(config, arch)}
    gguf_arch = field(reader, "general.architecture")
    tensors = _check_tensors(reader, shapes, gguf_arch)
    kv_heads = config.num_kv_heads

    def read() -> Iterator[tuple[str, np.ndarray]]:
        for hf_name, t in tensors:
            w = _dequantize(reader, t).reshape(shapes[hf_name])
            if gguf_arch in _PERMUTED:
                if ".q_proj." in hf_name:
                    w = unpermute_rotary(w, config.num_heads)
                elif ".k_proj." in hf_name:
                    w = unpermute_rotary(w, kv_heads)
            elif gguf_arch in gguf_gemma.GEMMA and hf_name.endswith("norm.weight"):
                w = w - 1.0  # stored as the multiplier 1 + w
            yield hf_name, w

    return config, arch, read()


def load_gguf_model(path: Path_, *, dtype=None, weights: bool = True, mesh=None) -> Transformer:
    """Load a `.gguf` file as a `Transformer`, every tensor dequantized into `dtype`.

    Args:
        path: the GGUF file.
        dtype: "float32" or "bfloat16"; None: bfloat16 on an accelerator, float32 on the
            CPU (`io.hf_config.default_dtype`).
        weights: False checks the file but reads no tensor (an abstract model, as
            `io.hf.load_model(weights=False)`).
        mesh: a `Mesh` to load onto: each tensor, dequantized whole on the host one at a
            time, is placed by slices (`io.onto_mesh.place_parts`).

    Raises:
        FileNotFoundError: no such file.
        GGUFError (a ValueError): unreadable or truncated file, unsupported architecture,
            tensor type or rope scaling, missing/unexpected tensors or wrong shapes.
    """
    config, arch, tensors = hf_tensors(path)
    config = config.replace(dtype=dtype_name(dtype or default_dtype()))
    config = config.replace(param_dtype=config.dtype)
    if not weights:
        return build_model(config, None)
    converts = {name: convert for name, _, convert in hf_entries(config, arch)}
    parts = (converts[name](w) for name, w in tensors)
    if mesh is not None:
        from jax_specdec.io.onto_mesh import place_parts

        return place_parts(config, parts, mesh, str(path))
    return build_model(config, parts)


# The special tokens tokenizer_config.json names (bos_token, ...): eot/eom have no key there.
_HF_SPECIAL = ("bos", "eos", "unk", "pad")


def convert_gguf(path: Path_, out_dir: Path_, *, overwrite: bool = False) -> Path:
    """Write a GGUF file as a Hugging Face directory (float32 weights).

    Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json.
    Everything is read and checked before anything is written: on error, `out_dir`
    is left as it was. A directory that already holds a model is refused unless
    `overwrite` (its other files, a README say, are then left beside the new ones).
    Returns `out_dir`.
    """
    from safetensors.numpy import save_file

    from jax_specdec.io.gguf_tokenizer import load_gguf_tokenizer, special_token_ids

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    held = sorted(n for n in _MODEL_FILES if (out / n).exists()) if out.is_dir() else []
    if held and not overwrite:
        raise ValueError(
            f"output {out} already holds a model ({', '.join(held)}): choose another "
            "directory, or overwrite it with --force"
        )
    tokenizer = load_gguf_tokenizer(path)
    config, arch, tensors = hf_tensors(path)
    weights = {name: np.ascontiguousarray(w, dtype=np.float32) for name, w in tensors}
    hf = config_to_hf(config)
    if hf["architectures"] != [arch]:  # config_to_hf picks from the biases
        raise GGUFError(f"{path}: cannot be written as {arch} (got {hf['architectures']})")
    special = special_token_ids(open_gguf(path))
    hf.update({f"{k}_token_id": v for k, v in special.items() if k in ("bos", "eos", "pad")})
    stops = sorted({special[k] for k in ("eos", "eot", "eom") if k in special})
    if len(stops) > 1:  # end of turn and end of message too, as Hugging Face configs list them
        hf["eos_token_id"] = stops
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    names = {k: tokenizer.id_to_token(v) for k, v in special.items() if k in _HF_SPECIAL}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    tok_config.update({f"{k}_token": v for k, v in names.items() if v is not None})
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def _check_tensors(reader, shapes: dict[str, tuple[int, ...]], arch: str) -> list:
    file = reader.data.filename
    found, unexpected = {}, []
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None or name not in shapes:
            unexpected.append(t.name)
            continue
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if shape != shapes[name]:
            raise GGUFError(f"{file}: tensor {t.name} has shape {shape}, expected {shapes[name]}")
        if not _can_dequantize(t.tensor_type):
            raise GGUFError(f"{file}: tensor {t.name} has unsupported type {t.tensor_type.name}")
        found[name] = t
    if unexpected:
        raise GGUFError(f"{file}: unexpected tensors {', '.join(unexpected[:8])}")
    missing = [n for n in shapes if n not in found]
    if missing:
        names = ", ".join(gguf_tensor_name(n, arch) for n in missing[:8])
        raise GGUFError(f"{file}: missing tensors {names}")
    return [(name, found[name]) for name in shapes]


def _can_dequantize(qtype) -> bool:
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    return qtype in (T.F32, T.F16) or qtype in quants._type_traits


def _dequantize(reader, t) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except Exception as e:
        raise GGUFError(f"{reader.data.filename}: tensor {t.name} is corrupt ({brief(e)})") from e
