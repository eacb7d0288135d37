"""Import and export of Hugging Face checkpoints (safetensors only, never pickle).

Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM, GPT2LMHeadModel, Gemma2ForCausalLM, Gemma3ForCausalLM and the text
model of Gemma3ForConditionalGeneration (its `language_model.` tensors; the vision
tower's are left unread). A model directory holds `config.json`,
`model.safetensors` (or a sharded `model.safetensors.index.json`) and optionally
`tokenizer.json`.

Loading reads tensor names and shapes from the safetensors headers first, checks
them against the config, and only then reads the data into a model that was built
abstractly (`nnx.eval_shape`): a failed load allocates no parameters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_specdec.io.hf_config import (
    SUPPORTED_ARCHITECTURES,
    architecture,
    config_from_hf,
    config_to_hf,
    dtype_name,
)
from jax_specdec.io.hub import hub_snapshot, is_hub_id
from jax_specdec.io.layout import Entry, build_model, hf_entries
from jax_specdec.io.weights import brief, open_safetensors
from jax_specdec.nn import Transformer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "eos_token_id",
    "load_model",
    "load_tokenizer",
    "save_model",
    "stop_token_ids",
    "tokenizer_from_file",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some checkpoints carry that are not parameters (recomputed by the model).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

Path_ = str | os.PathLike

# ------------------------------------------------------------------------- loading


def load_model(
    path: Path_, *, dtype: str | jnp.dtype | None = None, weights: bool = True, mesh=None
) -> Transformer:
    """Load a Hugging Face model directory (safetensors weights) as a `Transformer`.

    Args:
        path: directory with config.json and model.safetensors (or a sharded
            model.safetensors.index.json), a `.gguf` file (see `jax_specdec.io.gguf`), or
            a Hugging Face Hub id `org/name[@revision]` (`io.hub.hub_snapshot`).
        dtype: "float32" or "bfloat16" for parameters and activations; None keeps
            bfloat16 checkpoints in bfloat16 and loads everything else as float32.
        weights: False checks the files as for a load (config, tensor names and shapes)
            but reads no tensor: for a process that needs only the model's config and
            shapes, such as a Ray job's driver.
        mesh: a `jax.sharding.Mesh` (axes "data", "model") to load onto: every
            parameter created with its final sharding, each device's slice read from the
            file by slice (`io.onto_mesh`); KV heads repeated where the model axis is
            wider than them. None: the default device.

    Returns:
        The model, with every parameter read from the checkpoint (`weights=False`: every
        parameter a `jax.ShapeDtypeStruct`).

    Raises:
        FileNotFoundError: the directory, config.json or a weight file is missing.
        ValueError: unsupported architecture, pickle-only weights, or tensors that
            are missing, unexpected or of the wrong shape for the config.
    """
    if is_gguf(path):
        from jax_specdec.io.gguf import load_gguf_model

        return load_gguf_model(path, dtype=dtype, weights=weights, mesh=mesh)
    directory = _directory(path)
    if dtype is not None:
        dtype_name(dtype)  # refused before the config is read, in words of its own
    hf = _read_json(directory / "config.json")
    try:
        arch = architecture(hf)
        config = config_from_hf(hf, dtype=dtype)
    except (ValueError, TypeError) as e:  # one line naming the file
        raise ValueError(f"{directory / 'config.json'}: {e}") from None
    found = _tensor_headers(_weight_files(directory), arch)
    entries = hf_entries(config, arch)
    _check_tensors(directory, found, entries, config)

    if mesh is not None and weights:
        from jax_specdec.io.onto_mesh import load_onto_mesh

        return load_onto_mesh(config, entries, _slice_reader(found), mesh, str(directory))

    def read():
        for name, _, convert in entries:
            file, _, stored = found[name]
            # One short-lived handle per tensor: safe_open maps the file, and mapped pages
            # count as resident until unmapped; this keeps the peak near one model copy.
            with open_safetensors(file) as handle:
                raw = handle.get(stored)
            yield convert(raw)

    return build_model(config, read() if weights else None)


def _slice_reader(found):
    """read(name, index): a slice (None: all) of a canonical tensor, through a handle
    held for that read only (mapped pages count as resident until unmapped)."""

    def read(name, index):
        file, _, stored = found[name]
        with open_safetensors(file) as handle:
            return handle.get(stored) if index is None else handle.get_slice(stored, index)

    return read


def _tensor_headers(files: list[Path], arch: str) -> dict[str, tuple[Path, tuple, str]]:
    """Canonical tensor name -> (file, shape, stored name), from the safetensors headers
    only; tensors of no use here (a vision tower's) are left out."""
    found: dict[str, tuple[Path, tuple, str]] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (not a mapping)
                canonical = _canonical(name, arch)
                if canonical is not None:
                    found[canonical] = (file, f.shape(name), name)
    return found


def _check_tensors(directory: Path, found, entries: list[Entry], config) -> None:
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


def load_tokenizer(path: Path_):
    """The `tokenizers.Tokenizer` stored as `tokenizer.json` in a model directory, or the
    one described by a `.gguf` file's metadata (see `jax_specdec.io.gguf_tokenizer`)."""

    if is_gguf(path):
        from jax_specdec.io.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    directory = _directory(path)
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return tokenizer_from_file(file)


def tokenizer_from_file(file: Path_):
    """A `tokenizers.Tokenizer` read from a tokenizer.json, or one line naming the file."""
    from tokenizers import Tokenizer

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer file {file} does not exist")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{file} is not a readable tokenizer.json ({brief(e)})") from e


def stop_token_ids(path: Path_) -> tuple[int, ...]:
    """Every end-of-sequence or end-of-turn id the model states, sorted: config.json's and
    generation_config.json's `eos_token_id` (an id or a list: Llama 3 Instruct lists
    <|end_of_text|>, <|eom_id|> and <|eot_id|>), or a GGUF file's eos, eot and eom ids;
    empty when it states none."""
    if is_gguf(path):
        from jax_specdec.io.gguf_file import open_gguf
        from jax_specdec.io.gguf_tokenizer import special_token_ids

        special = special_token_ids(open_gguf(path))
        return tuple(sorted({special[k] for k in ("eos", "eot", "eom") if k in special}))
    directory = _directory(path)
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if name == "config.json" or (directory / name).is_file():
            value = _read_json(directory / name).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            ids |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return tuple(sorted(ids))


def eos_token_id(path: Path_) -> int | None:
    """The end-of-sequence id the model states (GGUF metadata, or config.json's
    `eos_token_id`, the first one if a list), or None when it states none."""
    if is_gguf(path):
        from jax_specdec.io.gguf_file import open_gguf
        from jax_specdec.io.gguf_tokenizer import special_token_ids

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


def _canonical(name: str, arch: str) -> str | None:
    """The name `hf_entries` knows a stored tensor by, or None for one left unread."""
    # GPT-2 checkpoints appear with and without the "transformer." prefix.
    if arch == "GPT2LMHeadModel" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    if arch == "Gemma3ForConditionalGeneration":
        # The text model's tensors: language_model.model.* as the original checkpoints
        # and transformers 5 write them, model.language_model.* as transformers 4.5x did.
        for prefix, to in _GEMMA3_TEXT_PREFIXES:
            if name.startswith(prefix):
                return to + name.removeprefix(prefix)
        return name if name == "lm_head.weight" else None  # the vision tower's
    return name


_GEMMA3_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


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
    if not directory.exists() and is_hub_id(str(path)):  # org/name[@revision]
        directory = hub_snapshot(str(path), "path")
    if directory.is_file():
        raise ValueError(f"{directory} is a file but not a .gguf: give a model directory")
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
        model: a Llama-style (Qwen2-, Qwen3- and Gemma 2/3-style included) or
            GPT-2-style `Transformer` (a Gemma 3 text model is written as
            Gemma3ForCausalLM, not Gemma3ForConditionalGeneration).
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
    for name, shape, convert in hf_entries(config, arch):
        # Invert each entry: apply its conversion to a probe of matching layout.
        tensors[name] = export_tensor(name, shape, convert, params)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "save"):
            raise TypeError("tokenizer must be a tokenizers.Tokenizer")
        backend.save(str(directory / "tokenizer.json"))


def export_tensor(name, shape, convert, params) -> np.ndarray:
    # Every entry either copies one parameter (maybe transposed) or splits one tensor
    # into q, k, v along its last axis; probing with an index array recovers which.
    probe = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    out = np.empty(shape, dtype=next(iter(params.values())).dtype)
    flat = out.reshape(-1)
    for param_path, index in convert(probe).items():
        flat[np.asarray(index).reshape(-1)] = np.asarray(params[param_path]).reshape(-1)
    return np.ascontiguousarray(out)
