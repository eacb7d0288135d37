"""Import and export of Hugging Face checkpoints (safetensors only, never pickle).

Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM and
GPT2LMHeadModel. A model directory holds `config.json`, `model.safetensors` (or a
sharded `model.safetensors.index.json`) and optionally `tokenizer.json`.

Loading reads tensor names and shapes from the safetensors headers first, checks
them against the config, and only then reads the data into a model that was built
abstractly (`nnx.eval_shape`): a failed load allocates no parameters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_specdec.hf_config import (
    SUPPORTED_ARCHITECTURES,
    _architecture,
    config_from_hf,
    config_to_hf,
)
from jax_specdec.nn import Transformer, TransformerConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "eos_token_id",
    "load_model",
    "load_tokenizer",
    "save_model",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some checkpoints carry that are not parameters (recomputed by the model).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

Path_ = str | os.PathLike

# One HF tensor -> our parameters: (hf name, hf shape, convert(array) -> {our path: array}).
_Entry = tuple[str, tuple[int, ...], Callable[[np.ndarray], dict[tuple, np.ndarray]]]


# ------------------------------------------------------------------- weight layouts


def _hf_entries(config: TransformerConfig, arch: str) -> list[_Entry]:
    """Every HF tensor the config implies, with its shape and how it maps to our params."""
    if arch == "GPT2LMHeadModel":
        return _gpt2_entries(config)
    return _llama_entries(config)


class _Entries(list):
    """A list of `_Entry`, with `add` for the tensors that map onto one parameter."""

    def add(self, name, shape, path, transpose=False):
        self.append((name, shape, lambda a, p=path, t=transpose: {p: a.T if t else a}))


def _gpt2_entries(c: TransformerConfig) -> list[_Entry]:
    D, F, V = c.d_model, c.mlp_dim, c.vocab_size
    entries = _Entries()
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


def _llama_entries(c: TransformerConfig) -> list[_Entry]:
    D, F, V = c.d_model, c.mlp_dim, c.vocab_size
    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    entries = _Entries()
    entries.add("model.embed_tokens.weight", (V, D), ("embed",))
    for i in range(c.num_layers):
        h, b = f"model.layers.{i}.", ("blocks", i)
        entries.add(h + "input_layernorm.weight", (D,), (*b, "attn_norm", "scale"))
        entries.add(h + "post_attention_layernorm.weight", (D,), (*b, "mlp_norm", "scale"))
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
    entries.add("model.norm.weight", (D,), ("final_norm", "scale"))
    if not c.tie_embeddings:
        entries.add("lm_head.weight", (V, D), ("lm_head",), transpose=True)
    return entries


# ------------------------------------------------------------------------- loading


def load_model(path: Path_, *, dtype: str | jnp.dtype | None = None) -> Transformer:
    """Load a Hugging Face model directory (safetensors weights) as a `Transformer`.

    Args:
        path: directory with config.json and model.safetensors (or a sharded
            model.safetensors.index.json), or a `.gguf` file (see `jax_specdec.gguf`).
        dtype: "float32" or "bfloat16" for parameters and activations; None keeps
            bfloat16 checkpoints in bfloat16 and loads everything else as float32.

    Returns:
        The model, with every parameter read from the checkpoint.

    Raises:
        FileNotFoundError: the directory, config.json or a weight file is missing.
        ValueError: unsupported architecture, pickle-only weights, or tensors that
            are missing, unexpected or of the wrong shape for the config.
    """
    if is_gguf(path):
        from jax_specdec.gguf import load_gguf_model

        return load_gguf_model(path, dtype=dtype)
    directory = _directory(path)
    hf = _read_json(directory / "config.json")
    arch = _architecture(hf)
    config = config_from_hf(hf, dtype=dtype)
    found = _tensor_headers(_weight_files(directory), arch)
    entries = _hf_entries(config, arch)
    _check_tensors(directory, found, entries, config)

    def read():
        for name, _, convert in entries:
            # One short-lived handle per tensor: safe_open maps the file, and mapped pages
            # count as resident until unmapped; this keeps the peak near one model copy.
            with safe_open(found[name][0], framework="np") as handle:
                raw = handle.get_tensor(_stored_name(handle, name))
            yield convert(raw)

    return build_model(config, read())


def _tensor_headers(files: list[Path], arch: str) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Canonical tensor name -> (file, shape), from the safetensors headers only."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[_canonical(name, arch)] = (file, tuple(f.get_slice(name).get_shape()))
    return found


def _check_tensors(directory: Path, found, entries: list[_Entry], config) -> None:
    """ValueError for tensors missing, unexpected or of the wrong shape for the config."""
    wanted = {name for name, _, _ in entries}
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensors: {_preview(missing)}")
    unexpected = sorted(
        n
        for n in set(found) - wanted
        if not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and config.tie_embeddings)
    )
    if unexpected:
        raise ValueError(f"checkpoint {directory} has unexpected tensors: {_preview(unexpected)}")
    for name, shape, _ in entries:
        if found[name][1] != shape:
            raise ValueError(
                f"tensor {name} has shape {found[name][1]} but the config implies {shape}"
            )


def build_model(config: TransformerConfig, parts: Iterable[dict[tuple, np.ndarray]]) -> Transformer:
    """A `Transformer` built abstractly, then filled from `parts`.

    Each part maps parameter paths (as in `nnx.to_flat_state`) to host arrays; it is
    cast to the parameter dtype as it arrives, so only one host tensor lives at a time
    when `parts` is a generator. Every parameter must be covered exactly once.
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
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


def load_tokenizer(path: Path_):
    """The `tokenizers.Tokenizer` stored as `tokenizer.json` in a model directory, or the
    one described by a `.gguf` file's metadata (see `jax_specdec.gguf_tokenizer`)."""
    from tokenizers import Tokenizer

    if is_gguf(path):
        from jax_specdec.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    directory = _directory(path)
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(file))


def eos_token_id(path: Path_) -> int | None:
    """The end-of-sequence id the model states (GGUF metadata, or config.json's
    `eos_token_id`, the first one if a list), or None when it states none."""
    if is_gguf(path):
        from jax_specdec.gguf import open_gguf
        from jax_specdec.gguf_tokenizer import special_token_ids

        return special_token_ids(open_gguf(path)).get("eos")
    value = _read_json(_directory(path) / "config.json").get("eos_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def is_gguf(path: Path_) -> bool:
    """Whether `path` names a GGUF file: a `.gguf` suffix, or a file starting with b"GGUF"."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _canonical(name: str, arch: str) -> str:
    # GPT-2 checkpoints appear with and without the "transformer." prefix.
    if arch == "GPT2LMHeadModel" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def _stored_name(handle, name: str) -> str:
    if name in handle.keys():
        return name
    return name.removeprefix("transformer.")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"weight shard {file} named in {index} does not exist")
        return files
    if single.is_file():
        return [single]
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return others
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(
            f"{directory} has only pickled weights ({', '.join(pickled)}); they are never "
            "unpickled here. Convert them to safetensors first, e.g. "
            "AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, safe_serialization=True)"
        )
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")


def _directory(path: Path_) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    return directory


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


def _preview(names: list[str], limit: int = 8) -> str:
    more = f" ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ------------------------------------------------------------------------- saving


def save_model(model: Transformer, path: Path_, tokenizer=None) -> None:
    """Write `model` as a Hugging Face directory that `transformers` can load.

    Writes config.json, model.safetensors and, when given, tokenizer.json.

    Args:
        model: a Llama-style or GPT-2-style `Transformer`.
        path: the directory (created if needed).
        tokenizer: optional `tokenizers.Tokenizer` (or an object with a
            `backend_tokenizer`, like a fast transformers tokenizer).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a Transformer, got {type(model).__name__}")
    config = model.config
    hf = config_to_hf(config)
    arch = hf["architectures"][0]
    params = {
        path: np.asarray(leaf.get_value()) for path, leaf in nnx.to_flat_state(nnx.state(model))
    }
    tensors: dict[str, np.ndarray] = {}
    for name, shape, convert in _hf_entries(config, arch):
        # Invert each entry: apply its conversion to a probe of matching layout.
        tensors[name] = _export_tensor(name, shape, convert, params)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "save"):
            raise TypeError("tokenizer must be a tokenizers.Tokenizer")
        backend.save(str(directory / "tokenizer.json"))


def _export_tensor(name, shape, convert, params) -> np.ndarray:
    # Every entry either copies one parameter (maybe transposed) or splits one tensor
    # into q, k, v along its last axis; probing with an index array recovers which.
    probe = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    out = np.empty(shape, dtype=next(iter(params.values())).dtype)
    flat = out.reshape(-1)
    for param_path, index in convert(probe).items():
        flat[np.asarray(index).reshape(-1)] = np.asarray(params[param_path]).reshape(-1)
    return np.ascontiguousarray(out)
