"""Hugging Face import/export: parity with transformers on random tiny models, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_specdec.io.hf import load_model, load_tokenizer, save_model
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.nn.config import RopeScaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 61

# The shape the Llama-style configs share: GQA (2 kv heads for 4 query heads).
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

HF_CONFIGS = {
    # Untied head, non-default rope_theta.
    "llama": lambda: transformers.LlamaConfig(
        **SHAPE,
        max_position_embeddings=64,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Llama 3.1's rotary scaling: of head_dim 8's four wavelengths (6.3, 30, 140, 665
    # positions at theta 500) one is kept, one smoothed and two divided by the factor.
    "llama3": lambda: transformers.LlamaConfig(
        **SHAPE,
        max_position_embeddings=256,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=False,
    ),
    # q/k/v biases, tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE,
        max_position_embeddings=64,
        rope_theta=20000.0,
        tie_word_embeddings=True,
    ),
    # Multi-query attention and a head_dim that is not hidden_size / heads.
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64
    ),
}


def hf_model(name, seed=0):
    """A random tiny HF model with O(1) logits (all parameters, biases included, random)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name]()).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or "ln_" in pname:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model


def ragged_batch(seed=1):
    """Right-padded prompts of lengths 7, 3 and 5, with their attention mask."""
    rng = np.random.default_rng(seed)
    lengths = [7, 3, 5]
    tokens = np.zeros((3, 7), np.int64)
    mask = np.zeros((3, 7), np.int64)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(0, VOCAB, n)
        mask[b, :n] = 1
    return tokens, mask, lengths


def hf_logits(model, tokens, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def max_valid_diff(a, b, lengths):
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(lengths))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_parity_import_and_export(name, tmp_path):
    model = hf_model(name)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_model(tmp_path / "hf")
    tokens, mask, lengths = ragged_batch()
    expected = hf_logits(model, tokens, mask)
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
    assert max_valid_diff(got, expected, lengths) < ATOL
    assert np.abs(expected).max() > 0.5  # the comparison is not between near-zero logits

    save_model(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    exported_as = {"mistral": "LlamaForCausalLM"}.get(name, type(model).__name__)
    assert type(back).__name__ == exported_as
    assert max_valid_diff(hf_logits(back, tokens, mask), got, lengths) < ATOL


def test_import_maps_config(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path, safe_serialization=True)
    config = load_model(tmp_path).config
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.qkv_bias and not config.out_bias and config.tie_embeddings
    assert config.rope_theta == 20000.0 and config.dtype == "float32"


@pytest.mark.slow
def test_export_of_our_own_models(tmp_path):
    # Our models (random init) exported and read back by transformers, GQA + untied.
    tokens, mask, lengths = ragged_batch()
    for i, config in enumerate(
        [
            TransformerConfig.tiny(vocab_size=VOCAB, rope_theta=1234.0),
            TransformerConfig.gpt2(
                vocab_size=VOCAB,
                d_model=32,
                num_layers=2,
                num_heads=4,
                max_len=32,
                tie_embeddings=False,
            ),
        ]
    ):
        from flax import nnx

        ours = Transformer(config, rngs=nnx.Rngs(i), init_scale=0.3)
        save_model(ours, tmp_path / str(i))
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(i)).eval()
        got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
        assert max_valid_diff(hf_logits(back, tokens, mask), got, lengths) < ATOL
        again = load_model(tmp_path / str(i))
        np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens, jnp.int32))), got)


@pytest.mark.slow
def test_sharded_checkpoint_and_bfloat16(tmp_path):
    model = hf_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    tokens, mask, lengths = ragged_batch()
    expected = hf_logits(model, tokens, mask)
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
    assert max_valid_diff(got, expected, lengths) < ATOL
    half = load_model(tmp_path, dtype="bfloat16")
    assert half.embed[...].dtype == jnp.bfloat16
    got = np.asarray(half(jnp.asarray(tokens, jnp.int32)))
    assert got.dtype == np.float32 and max_valid_diff(got, expected, lengths) < 0.5


def test_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    config = TransformerConfig.tiny(vocab_size=3)
    from flax import nnx

    save_model(Transformer(config, rngs=nnx.Rngs(0)), tmp_path, tokenizer=tokenizer)
    assert load_tokenizer(tmp_path).encode("hello world foo").ids == [1, 2, 0]


# ------------------------------------------------------------------- bad input


@pytest.fixture
def llama_dir(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "m", safe_serialization=True)
    return tmp_path / "m"


def test_missing_paths(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    (llama_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(llama_dir)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(llama_dir)


def test_no_weights(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(llama_dir)


def test_pickle_weights_are_refused(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    (llama_dir / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(llama_dir)


def test_unsupported_architecture(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*GPT2LMHeadModel"):
        load_model(llama_dir)


@pytest.mark.parametrize("architectures", ["null", "missing", "empty"])
def test_no_architectures_falls_back_on_model_type(llama_dir, architectures):
    # transformers writes "architectures": null for GGUF-loaded models.
    file = llama_dir / "config.json"
    config = json.loads(file.read_text())
    reference = load_model(llama_dir)
    if architectures == "missing":
        del config["architectures"]
    else:
        config["architectures"] = None if architectures == "null" else []
    file.write_text(json.dumps(config))
    model = load_model(llama_dir)
    ids = jnp.asarray([[1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(reference(ids)))
    config["model_type"] = "bert"
    file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no architectures and an unsupported model_type 'bert'"):
        load_model(llama_dir)


def test_shape_mismatch_names_the_tensor(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["intermediate_size"] = 40
    (llama_dir / "config.json").write_text(json.dumps(config))
    for weights in (True, False):
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight"):
            load_model(llama_dir, weights=weights)


def test_shapes_only_load_reads_no_tensor(llama_dir):
    full, shapes = load_model(llama_dir), load_model(llama_dir, weights=False)
    assert shapes.config == full.config
    abstract, real = jax.tree.leaves(nnx.state(shapes)), jax.tree.leaves(nnx.state(full))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in abstract)
    assert [(x.shape, x.dtype) for x in abstract] == [(x.shape, x.dtype) for x in real]


def test_missing_and_unexpected_tensors(llama_dir):
    file = llama_dir / "model.safetensors"
    tensors = load_file(file)
    removed = dict(tensors)
    del removed["model.layers.1.self_attn.k_proj.weight"]
    save_file(removed, file)
    with pytest.raises(ValueError, match="k_proj"):
        load_model(llama_dir)
    save_file({**tensors, "model.layers.0.extra.weight": np.zeros(3, np.float32)}, file)
    with pytest.raises(ValueError, match="unexpected.*extra"):
        load_model(llama_dir)


def test_unsupported_rope_scaling(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="yarn"):
        load_model(llama_dir)


def test_llama3_rope_scaling_round_trips_and_bad_ones_are_refused(tmp_path):
    hf_model("llama3").save_pretrained(tmp_path, safe_serialization=True)
    config = load_model(tmp_path).config
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert TransformerConfig.from_dict(json.loads(config.to_json())) == config
    hf = json.loads((tmp_path / "config.json").read_text())
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    legacy["rope_scaling"] = {k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"}
    legacy["rope_theta"] = hf["rope_parameters"]["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(legacy))  # transformers 4's keys
    assert load_model(tmp_path).config == config
    for key, value, message in [
        ("factor", None, "lacks factor"),
        ("high_freq_factor", 0.5, "must exceed low_freq_factor"),
        ("original_max_position_embeddings", 0, "original_max_position must be"),
    ]:
        spec = {**hf["rope_parameters"], key: value}
        if value is None:
            del spec[key]
        (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_parameters": spec}))
        with pytest.raises(ValueError, match=message):
            load_model(tmp_path)


def test_export_refuses_hybrid_configs(tmp_path):
    from flax import nnx

    config = TransformerConfig.tiny(norm="layer")
    with pytest.raises(ValueError, match="norm"):
        save_model(Transformer(config, rngs=nnx.Rngs(0)), tmp_path)


def test_stop_token_ids_are_every_end_id_the_model_states(tmp_path):
    """config.json's eos_token_id (an id or a list, as Llama 3 Instruct's three) and
    generation_config.json's; --eos auto takes them all, --eos 3,5 the ids given."""
    import argparse
    import types

    from jax_specdec.io.hf import stop_token_ids
    from jax_specdec.settings import DecodeSettings

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [9, 3]}))
    assert stop_token_ids(tmp_path) == (3, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_token_ids(tmp_path) == (3, 7, 9)
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert stop_token_ids(tmp_path) == (7,)
    loaded = types.SimpleNamespace(target_dir=tmp_path, tokenizer=None)
    for eos, want in (("auto", 7), ("none", None), ("5,3", (3, 5)), ("4", 4)):
        args = argparse.Namespace(
            target="t", tree=None, branch=None, lookup=0, num_draft_tokens=4, acceptance="token",
            eos=eos, temperature=0.0, top_k=0, top_p=1.0, seed=0, mesh=None, dtype=None,
            schedule=None,
        )  # fmt: skip
        settings = DecodeSettings.from_args(args, draft="ngram")
        assert settings.eos_token_id(loaded) == want, eos
