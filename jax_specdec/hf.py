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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_specdec.nn import Transformer, TransformerConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "GPT2LMHeadModel",
)
_LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some checkpoints carry that are not parameters (recomputed by the model).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

Path_ = str | os.PathLike

# One HF tensor -> our parameters: (hf name, hf shape, convert(array) -> {our path: array}).
_Entry = tuple[str, tuple[int, ...], Callable[[np.ndarray], dict[tuple, np.ndarray]]]


# --------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any], *, dtype: str | None = None) -> TransformerConfig:
    """Our `TransformerConfig` for a Hugging Face `config.json` dictionary.

    Args:
        hf: the parsed config.json.
        dtype: "float32" or "bfloat16" for parameters and activations; None picks
            bfloat16 when the checkpoint says so, float32 otherwise.
    """
    arch = _architecture(hf)
    if dtype is None:
        stored = hf.get("dtype") or hf.get("torch_dtype")
        dtype = "bfloat16" if stored == "bfloat16" else "float32"
    dtype = _dtype_name(dtype)

    def need(key):
        if key not in hf:
            raise ValueError(f"config.json for {arch} lacks the field {key!r}")
        return hf[key]

    if arch == "GPT2LMHeadModel":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            raise ValueError(
                f"GPT-2 activation_function {act!r} is not supported (only the tanh GELU: "
                "gelu_new, gelu_pytorch_tanh)"
            )
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(flag):
                raise ValueError(f"GPT-2 option {flag}=true is not supported")
        if hf.get("scale_attn_weights", True) is False:
            raise ValueError("GPT-2 option scale_attn_weights=false is not supported")
        d = need("n_embd")
        heads = need("n_head")
        return TransformerConfig.gpt2(
            vocab_size=need("vocab_size"),
            d_model=d,
            num_layers=need("n_layer"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=d // heads,
            mlp_dim=hf.get("n_inner") or 4 * d,
            max_len=need("n_positions"),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            dtype=dtype,
            param_dtype=dtype,
        )

    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{arch} hidden_act {act!r} is not supported (only silu)")
    d = need("hidden_size")
    heads = need("num_attention_heads")
    max_len = need("max_position_embeddings")
    # Sliding-window attention equals full attention up to the window: cap the context.
    window = hf.get("sliding_window")
    uses_window = {
        "MistralForCausalLM": window is not None,
        "Qwen2ForCausalLM": bool(hf.get("use_sliding_window"))
        or "sliding_attention" in (hf.get("layer_types") or ()),
    }.get(arch, False)
    if uses_window and window:
        max_len = min(max_len, int(window))
    if arch == "Qwen2ForCausalLM":
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    return TransformerConfig.llama(
        vocab_size=need("vocab_size"),
        d_model=d,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or d // heads,
        mlp_dim=need("intermediate_size"),
        max_len=max_len,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf, arch),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=dtype,
    )


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` dictionary for one of our configs.

    Llama-style models export as LlamaForCausalLM (Qwen2ForCausalLM when only q/k/v
    have biases); GPT-2-style ones as GPT2LMHeadModel. Other combinations raise
    ValueError.
    """
    c = config
    if c.norm == "layer" and c.position == "learned" and c.mlp == "gelu":
        if not (c.qkv_bias and c.out_bias and c.mlp_bias):
            raise ValueError("GPT-2 export needs qkv_bias, out_bias and mlp_bias all true")
        if c.num_kv_heads != c.num_heads or c.head_dim * c.num_heads != c.d_model:
            raise ValueError(
                "GPT-2 export needs num_kv_heads == num_heads and head_dim * num_heads == d_model"
            )
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab_size,
            "n_embd": c.d_model,
            "n_layer": c.num_layers,
            "n_head": c.num_heads,
            "n_inner": c.mlp_dim,
            "n_positions": c.max_len,
            "n_ctx": c.max_len,
            "layer_norm_epsilon": c.norm_eps,
            "activation_function": "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "tie_word_embeddings": c.tie_embeddings,
            "dtype": c.param_dtype,
        }
    if not (c.norm == "rms" and c.position == "rope" and c.mlp == "swiglu"):
        raise ValueError(
            "only Llama-style (norm='rms', position='rope', mlp='swiglu') or GPT-2-style "
            "(norm='layer', position='learned', mlp='gelu') configs can be exported, got "
            f"norm={c.norm!r}, position={c.position!r}, mlp={c.mlp!r}"
        )
    common = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.mlp_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": c.param_dtype,
    }
    if c.qkv_bias and not c.out_bias and not c.mlp_bias:
        if c.head_dim * c.num_heads != c.d_model:
            raise ValueError("Qwen2 export needs head_dim * num_heads == d_model")
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": None,
            **common,
        }
    if c.qkv_bias != c.out_bias:
        raise ValueError(
            "Llama export needs qkv_bias == out_bias (HF attention_bias covers both); "
            "qkv_bias without out_bias exports as Qwen2 only without mlp_bias"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": c.qkv_bias,
        "mlp_bias": c.mlp_bias,
        **common,
    }


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported architectures {archs!r} in config.json; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_theta(hf: dict[str, Any], arch: str) -> float:
    # transformers >= 5 writes rope_parameters; older versions rope_theta + rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"{arch} rope type {kind!r} is not supported (only the default rotary embedding)"
            )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return name


# ------------------------------------------------------------------- weight layouts


def _hf_entries(config: TransformerConfig, arch: str) -> list[_Entry]:
    """Every HF tensor the config implies, with its shape and how it maps to our params."""
    c = config
    D, F, V = c.d_model, c.mlp_dim, c.vocab_size
    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    entries: list[_Entry] = []

    def add(name, shape, path, transpose=False):
        entries.append((name, shape, lambda a, p=path, t=transpose: {p: a.T if t else a}))

    if arch == "GPT2LMHeadModel":
        add("transformer.wte.weight", (V, D), ("embed",))
        add("transformer.wpe.weight", (c.max_len, D), ("pos_embed",))
        for i in range(c.num_layers):
            h, b = f"transformer.h.{i}.", ("blocks", i)

            def split(a, b=b):
                q, k, v = np.split(a, 3, axis=-1)
                kind = "kernel" if a.ndim == 2 else "bias"
                return {(*b, "attn", n, kind): x for n, x in zip("qkv", (q, k, v), strict=True)}

            add(h + "ln_1.weight", (D,), (*b, "attn_norm", "scale"))
            add(h + "ln_1.bias", (D,), (*b, "attn_norm", "bias"))
            entries.append((h + "attn.c_attn.weight", (D, 3 * D), split))
            entries.append((h + "attn.c_attn.bias", (3 * D,), split))
            add(h + "attn.c_proj.weight", (D, D), (*b, "attn", "o", "kernel"))
            add(h + "attn.c_proj.bias", (D,), (*b, "attn", "o", "bias"))
            add(h + "ln_2.weight", (D,), (*b, "mlp_norm", "scale"))
            add(h + "ln_2.bias", (D,), (*b, "mlp_norm", "bias"))
            add(h + "mlp.c_fc.weight", (D, F), (*b, "mlp", "up", "kernel"))
            add(h + "mlp.c_fc.bias", (F,), (*b, "mlp", "up", "bias"))
            add(h + "mlp.c_proj.weight", (F, D), (*b, "mlp", "down", "kernel"))
            add(h + "mlp.c_proj.bias", (D,), (*b, "mlp", "down", "bias"))
        add("transformer.ln_f.weight", (D,), ("final_norm", "scale"))
        add("transformer.ln_f.bias", (D,), ("final_norm", "bias"))
        if not c.tie_embeddings:
            add("lm_head.weight", (V, D), ("lm_head",), transpose=True)
        return entries

    add("model.embed_tokens.weight", (V, D), ("embed",))
    for i in range(c.num_layers):
        h, b = f"model.layers.{i}.", ("blocks", i)
        add(h + "input_layernorm.weight", (D,), (*b, "attn_norm", "scale"))
        add(h + "post_attention_layernorm.weight", (D,), (*b, "mlp_norm", "scale"))
        for name, dim_in, dim_out, bias in (
            ("q", D, qd, c.qkv_bias),
            ("k", D, kvd, c.qkv_bias),
            ("v", D, kvd, c.qkv_bias),
            ("o", qd, D, c.out_bias),
        ):
            add(
                f"{h}self_attn.{name}_proj.weight",
                (dim_out, dim_in),
                (*b, "attn", name, "kernel"),
                True,
            )
            if bias:
                add(f"{h}self_attn.{name}_proj.bias", (dim_out,), (*b, "attn", name, "bias"))
        for name, dim_in, dim_out in (("gate", D, F), ("up", D, F), ("down", F, D)):
            add(f"{h}mlp.{name}_proj.weight", (dim_out, dim_in), (*b, "mlp", name, "kernel"), True)
            if c.mlp_bias:
                add(f"{h}mlp.{name}_proj.bias", (dim_out,), (*b, "mlp", name, "bias"))
    add("model.norm.weight", (D,), ("final_norm", "scale"))
    if not c.tie_embeddings:
        add("lm_head.weight", (V, D), ("lm_head",), transpose=True)
    return entries


# ------------------------------------------------------------------------- loading


def load_model(path: Path_, *, dtype: str | jnp.dtype | None = None) -> Transformer:
    """Load a Hugging Face model directory (safetensors weights) as a `Transformer`.

    Args:
        path: directory with config.json and model.safetensors (or a sharded
            model.safetensors.index.json).
        dtype: "float32" or "bfloat16" for parameters and activations; None keeps
            bfloat16 checkpoints in bfloat16 and loads everything else as float32.

    Returns:
        The model, with every parameter read from the checkpoint.

    Raises:
        FileNotFoundError: the directory, config.json or a weight file is missing.
        ValueError: unsupported architecture, pickle-only weights, or tensors that
            are missing, unexpected or of the wrong shape for the config.
    """
    directory = _directory(path)
    hf = _read_json(directory / "config.json")
    arch = _architecture(hf)
    config = config_from_hf(hf, dtype=dtype)
    files = _weight_files(directory)

    # Headers only: names -> (file, shape). No tensor data is read yet.
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[_canonical(name, arch)] = (file, tuple(f.get_slice(name).get_shape()))
    entries = _hf_entries(config, arch)
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

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(abstract_state))
    values: dict[tuple, jax.Array] = {}
    for name, _, convert in entries:
        # One short-lived handle per tensor: safe_open maps the file, and mapped pages
        # count as resident until unmapped; this keeps the peak near one model copy.
        with safe_open(found[name][0], framework="np") as handle:
            raw = handle.get_tensor(_stored_name(handle, name))
        for param_path, array in convert(raw).items():
            dtype = targets[param_path].get_value().dtype
            values[param_path] = jnp.asarray(array, dtype=dtype)
        del raw
    if set(values) != set(targets):  # a mapping bug, not a user error
        raise AssertionError(f"unmapped parameters: {sorted(set(targets) - set(values))}")
    for param_path, leaf in targets.items():
        leaf.set_value(values[param_path])
    return nnx.merge(graphdef, abstract_state)


def load_tokenizer(path: Path_):
    """The `tokenizers.Tokenizer` stored as `tokenizer.json` in a model directory."""
    from tokenizers import Tokenizer

    directory = _directory(path)
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(file))


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
