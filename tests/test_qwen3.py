"""Qwen3 (dense): parity with transformers' Qwen3ForCausalLM on random tiny models saved
with `save_pretrained` (prefill and cached decoding), the export read back by
transformers, GGUF import against transformers' GGUF loading, sliding-window configs,
and greedy speculative decoding on a Qwen3 target (n-gram, a Qwen3 draft model, slots,
trees, an EAGLE-3 head with Qwen3 layers, a mesh)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf_files import MERGES, encode, vocabulary
from helpers import make_head, ragged_prompts
from jax.sharding import PartitionSpec as P

from jax_specdec import Generator, NGram
from jax_specdec.io.gguf import convert_gguf
from jax_specdec.io.hf import load_model, save_model
from jax_specdec.io.hf_config import config_from_hf
from jax_specdec.io.speculators import save_speculators
from jax_specdec.nn import Transformer, TransformerConfig, init_cache
from jax_specdec.nn.eagle3 import Eagle3Config, Eagle3Head
from jax_specdec.sharding import param_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = 1e-5  # max |ours - transformers| / max |transformers|, float32
VOCAB = 61
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
CONFIGS = {
    # GQA 4/2, head_dim 16 != 32 / 4, untied, Qwen3's rope base.
    "gqa_wide_heads_untied": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    ),
    # MQA 4/1, head_dim 8 == 32 / 4, tied.
    "mqa_tied": dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True
    ),
    # MHA, head_dim 12, attention_bias (q/k/v and o), Llama 3.1's rope scaling, untied.
    "mha_bias_llama3_rope": dict(
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=12,
        attention_bias=True,
        rope_parameters=dict(LLAMA3_ROPE),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def hf_model(seed=0, **config):
    """A random tiny Qwen3ForCausalLM with O(1) logits: every parameter random, the norms
    (q/k norms included) around 1."""
    torch.manual_seed(seed)
    fields = {**SHAPE, "max_position_embeddings": 128, **config}
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model


def saved(model, directory):
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def relative(ours, theirs) -> float:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def hf_cached_logits(model, tokens, prefill: int) -> np.ndarray:
    """transformers' own cached decoding: the first `prefill` tokens at once, then one
    token per call."""
    tokens = torch.tensor(np.asarray(tokens))
    with torch.no_grad():
        out = model(tokens[:, :prefill], use_cache=True)
        logits, past = [out.logits], out.past_key_values
        for t in range(prefill, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], past_key_values=past, use_cache=True)
            logits.append(out.logits)
            past = out.past_key_values
    return torch.cat(logits, dim=1).float().numpy()


def our_cached_logits(model, tokens, prefill: int) -> np.ndarray:
    cache = init_cache(model.config, batch=tokens.shape[0], max_len=tokens.shape[1])
    logits, cache = model.decode(jnp.asarray(tokens[:, :prefill]), cache)
    out = [logits]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = model.decode(jnp.asarray(tokens[:, t : t + 1]), cache)
        out.append(logits)
    return np.concatenate([np.asarray(x) for x in out], axis=1)


# ----------------------------------------------------------------------- parity


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_prefill_cached_decoding_and_export_match_transformers(name, tmp_path):
    reference = hf_model(**CONFIGS[name])
    ours = load_model(saved(reference, tmp_path / "hf"))
    c = ours.config
    assert c.qk_norm and not c.mlp_bias and c.head_dim == CONFIGS[name]["head_dim"]
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 48))
    expected = hf_logits(reference, tokens)
    assert np.abs(expected).max() > 0.5  # not a comparison of near-zero logits
    got = np.asarray(ours(jnp.asarray(tokens)))
    assert relative(got, expected) <= RTOL  # prefill
    # Cached decoding: 8 tokens, then 40 one at a time, against transformers' own.
    decoded = our_cached_logits(ours, tokens, prefill=8)
    assert relative(decoded, hf_cached_logits(reference, tokens, prefill=8)) <= RTOL
    assert relative(decoded, expected) <= RTOL

    save_model(ours, tmp_path / "export")
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3ForCausalLM"] and hf["model_type"] == "qwen3"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    assert relative(hf_logits(back, tokens), got) <= RTOL
    again = load_model(tmp_path / "export")
    assert again.config == c
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens))), got)


def test_the_norms_change_the_logits(tmp_path):
    """The parity test's weights exercise the q/k norms: the same model without them is
    far off transformers (so the parity test fails when the norms are skipped)."""
    reference = hf_model(**CONFIGS["gqa_wide_heads_untied"])
    ours = load_model(saved(reference, tmp_path))
    for block in ours.blocks:
        block.attn.q_norm = block.attn.k_norm = None
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 16))
    assert relative(ours(jnp.asarray(tokens)), hf_logits(reference, tokens)) > 0.05


def test_our_own_qwen3_exports(tmp_path):
    """A randomly initialised model of ours with q/k norms (and norm scales not 1) is
    written as Qwen3ForCausalLM and read back by transformers with the same logits."""
    config = TransformerConfig.tiny(vocab_size=VOCAB, qk_norm=True, tie_embeddings=True)
    ours = Transformer(config, rngs=nnx.Rngs(3), init_scale=0.3)
    for i, block in enumerate(ours.blocks):
        for norm in (block.attn.q_norm, block.attn.k_norm):
            key = jax.random.key(i + 10 * (norm is block.attn.k_norm))
            norm.scale.set_value(1.0 + 0.3 * jax.random.normal(key, (config.head_dim,)))
    save_model(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 12))
    assert relative(hf_logits(back, tokens), ours(jnp.asarray(tokens))) <= RTOL


# ----------------------------------------------------------------------- config


def test_config_maps_and_round_trips(tmp_path):
    hf = json.loads(
        (saved(hf_model(**CONFIGS["mha_bias_llama3_rope"]), tmp_path) / "config.json").read_text()
    )
    c = config_from_hf(hf)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.d_model) == (2, 2, 12, 32)
    assert c.qk_norm and c.qkv_bias and c.out_bias and not c.mlp_bias
    assert c.rope_theta == 500.0 and c.rope_scaling.factor == 8.0 and c.norm_eps == 1e-5
    assert TransformerConfig.from_dict(json.loads(c.to_json())) == c
    assert json.loads(c.to_json())["qk_norm"] is True
    assert "qk_norm" not in {k for k, v in TransformerConfig.tiny().to_dict().items() if v}
    # transformers' Qwen3Config gives head_dim 128 when config.json names none.
    assert config_from_hf({k: v for k, v in hf.items() if k != "head_dim"}).head_dim == 128
    # model_type alone (architectures null, as transformers writes for GGUF loads).
    assert config_from_hf({**hf, "architectures": None}) == c
    with pytest.raises(ValueError, match=r"TransformerConfig\.qk_norm must be a bool"):
        TransformerConfig.tiny(qk_norm=1)


def test_export_refusals():
    with pytest.raises(ValueError, match="Qwen3 export .* mlp_bias false"):
        save_model(
            Transformer(TransformerConfig.tiny(qk_norm=True, mlp_bias=True), rngs=nnx.Rngs(0)),
            "/nonexistent",
        )
    gpt2 = TransformerConfig.gpt2(vocab_size=8, d_model=16, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="GPT-2 export has no q/k norms"):
        save_model(Transformer(gpt2.replace(qk_norm=True), rngs=nnx.Rngs(0)), "/nonexistent")


def test_sliding_window(tmp_path):
    """A window in use caps the context at the window (attention is exact up to it, as
    for Qwen2 and Mistral); a window no layer uses does not."""
    base = {"architectures": ["Qwen3ForCausalLM"], **SHAPE, "num_attention_heads": 4}
    base |= {"max_position_embeddings": 128, "sliding_window": 16}
    on = dict(use_sliding_window=True, max_window_layers=1)
    assert config_from_hf({**base, **on}).max_len == 16
    types = ["full_attention", "sliding_attention"]
    assert config_from_hf({**base, "use_sliding_window": True, "layer_types": types}).max_len == 16
    for off in (
        dict(use_sliding_window=False, max_window_layers=0),
        dict(use_sliding_window=True, max_window_layers=2),  # from layer 2 of 2: none
        dict(use_sliding_window=True, layer_types=["full_attention"] * 2),
    ):
        assert config_from_hf({**base, **off}).max_len == 128, off
    # transformers' windowed layer 1 and ours agree over the whole 16-token window.
    reference = hf_model(num_attention_heads=4, num_key_value_heads=2, head_dim=8, **on,
                         sliding_window=16)  # fmt: skip
    ours = load_model(saved(reference, tmp_path))
    assert ours.config.max_len == 16
    tokens = np.random.default_rng(4).integers(0, VOCAB, (1, 16))
    assert relative(ours(jnp.asarray(tokens)), hf_logits(reference, tokens)) <= RTOL


def test_norm_weights_are_replicated_on_a_mesh():
    for name in ("q_norm", "k_norm"):
        assert param_spec(("blocks", 0, "attn", name, "scale", "value")) == P()
    assert param_spec(("blocks", 0, "attn", "q", "kernel")) == P(None, "model")


# ------------------------------------------------------------------------- GGUF

# d 128, 4 heads of 128 (transformers' GGUF loader reads no head width for qwen3 and
# takes Qwen3Config's 128; ours reads attention.key_length), GQA 4/2, untied.
GGUF_D, GGUF_HEADS, GGUF_KV, GGUF_HD, GGUF_MLP, GGUF_LAYERS = 128, 4, 2, 128, 256, 2


def write_qwen3_gguf(path, qtype: str, seed: int = 0):
    """A random 2-layer qwen3 file as llama.cpp writes one (no q/k permutation; per-head
    q/k norms `attn_q_norm`/`attn_k_norm`), 2-D weights stored as `qtype`."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name("tiny-qwen3")
    writer.add_context_length(64)
    writer.add_embedding_length(GGUF_D)
    writer.add_block_count(GGUF_LAYERS)
    writer.add_feed_forward_length(GGUF_MLP)
    writer.add_head_count(GGUF_HEADS)
    writer.add_head_count_kv(GGUF_KV)
    writer.add_key_length(GGUF_HD)
    writer.add_value_length(GGUF_HD)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))

    def w(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    d, q, kv = GGUF_D, GGUF_HEADS * GGUF_HD, GGUF_KV * GGUF_HD
    weights = {"token_embd.weight": w(len(tokens), d, scale=1.0), "output_norm.weight": 1 + w(d)}
    weights["output.weight"] = w(len(tokens), d)
    for i in range(GGUF_LAYERS):
        b = f"blk.{i}."
        weights |= {
            b + "attn_norm.weight": 1 + w(d),
            b + "attn_q.weight": w(q, d),
            b + "attn_k.weight": w(kv, d),
            b + "attn_v.weight": w(kv, d),
            b + "attn_q_norm.weight": 1 + w(GGUF_HD),
            b + "attn_k_norm.weight": 1 + w(GGUF_HD),
            b + "attn_output.weight": w(d, q),
            b + "ffn_norm.weight": 1 + w(d),
            b + "ffn_gate.weight": w(GGUF_MLP, d),
            b + "ffn_up.weight": w(GGUF_MLP, d),
            b + "ffn_down.weight": w(d, GGUF_MLP),
        }
    for name, array in weights.items():
        data, raw = encode(name, array, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_transformers_gguf_loading(tmp_path, qtype):
    pytest.importorskip("gguf")
    path = write_qwen3_gguf(tmp_path / "qwen3.gguf", qtype)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert type(reference).__name__ == "Qwen3ForCausalLM"
    ours = load_model(path)
    c = ours.config
    assert c.qk_norm and (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 128)
    ids = np.asarray([[*range(0, 260, 7), 257, 258, 259]])  # bytes, merges, a special
    expected = hf_logits(reference, ids)
    assert relative(ours(jnp.asarray(ids)), expected) <= RTOL
    if qtype == "Q8_0":  # converted to a Hugging Face directory, read by both
        out = convert_gguf(path, tmp_path / "hf")
        converted = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(converted).__name__ == "Qwen3ForCausalLM"
        assert relative(hf_logits(converted, ids), expected) <= RTOL
        assert relative(load_model(out)(jnp.asarray(ids)), expected) <= RTOL


# ------------------------------------------------------------ speculative decoding

GEN_VOCAB = 32


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Qwen3 target (GQA 4/2, head_dim 16, untied) loaded from its HF directory."""
    reference = hf_model(
        seed=7,
        vocab_size=GEN_VOCAB,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return load_model(saved(reference, tmp_path_factory.mktemp("qwen3_target")))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A smaller Qwen3 draft (one layer, d 16, MQA, tied) on the same vocabulary."""
    reference = hf_model(
        seed=8,
        vocab_size=GEN_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return load_model(saved(reference, tmp_path_factory.mktemp("qwen3_draft")))


def eagle3_head(target, seed=5):
    """A random EAGLE-3 head with a Qwen3 layer (q/k norms, scales not 1) reading the
    target's layers 0, 1 and 2, as `speculators` writes one for a Qwen3 verifier."""
    config = Eagle3Config(
        layer=target.config.replace(num_layers=1, qk_norm=False),  # the style adds them
        draft_vocab_size=GEN_VOCAB,
        style="qwen3",
        aux_layer_ids=(0, 1, 2),
        has_embed=False,
        verifier="tiny qwen3 target",
        verifier_architectures=("Qwen3ForCausalLM",),
    )
    head = Eagle3Head(config, rngs=nnx.Rngs(seed), init_scale=0.1)
    for i, norm in enumerate((head.layers[0].attn.q_norm, head.layers[0].attn.k_norm)):
        norm.scale.set_value(1.0 + 0.3 * jax.random.normal(jax.random.key(i), norm.scale.shape))
    return head


PROMPTS = ragged_prompts(4, GEN_VOCAB, seed=3)
CALL = dict(key=jax.random.key(0), max_new_tokens=[12, 5, 16, 9])


def same_tokens(a, b):
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))


@pytest.mark.slow
def test_greedy_speculative_equals_autoregressive(target, draft, tmp_path):
    assert target.config.qk_norm and draft.config.qk_norm
    ar = Generator(target, eos_token_id=2)(PROMPTS, **CALL)
    save_speculators(eagle3_head(target), tmp_path / "eagle3")
    accepted = {}
    for name, proposer, tree in (
        ("ngram chain", NGram(), None),
        ("ngram tree", NGram(), 6),
        ("draft model chain", draft, None),
        ("EAGLE-3 chain", str(tmp_path / "eagle3"), None),  # read back from its files
        ("EAGLE-3 tree", eagle3_head(target), 6),
        ("feature head tree", make_head(target), 6),  # its layer has q/k norms too
    ):
        spec = Generator(target, proposer, schedule=3, tree=tree, eos_token_id=2)(PROMPTS, **CALL)
        same_tokens(spec, ar)
        accepted[name] = int(np.asarray(spec.stats.accepted).sum())
    # Drafts were taken as well as refused (the random EAGLE-3 head's rarely are).
    assert min(accepted["ngram chain"], accepted["draft model chain"]) > 0, accepted


@pytest.mark.slow
def test_slots_greedy_speculative_equals_autoregressive(target, draft):
    call = {**CALL, "num_slots": 2}
    ar = Generator(target, eos_token_id=2)(PROMPTS, **call)
    same_tokens(ar, Generator(target, eos_token_id=2)(PROMPTS, **CALL))
    for proposer in (draft, NGram()):
        same_tokens(Generator(target, proposer, schedule=3, eos_token_id=2)(PROMPTS, **call), ar)


@pytest.mark.slow
def test_greedy_on_a_mesh_gives_the_one_device_tokens():
    """A target with q/k norms (scales not 1) and its drafters split over a (2, 2) mesh of
    CPU devices, the norm weights replicated: a draft model's chain, a feature head's tree
    and n-gram slots give the one-device tokens, drafts accepted."""
    script = str(pathlib.Path(__file__).parent / "family_mesh_run.py")
    proc = subprocess.run(
        [sys.executable, script, "qwen3"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        out["devices"] == 4 and out["draft model chain"]["mesh"] == out["draft model chain"]["one"]
    )


def test_a_head_built_for_a_qwen3_target_is_qwen3_style_and_saves(target, tmp_path):
    """`train-drafter --kind eagle3` on a Qwen3 target: its head's layer has the q/k
    norms as the `speculators` style says (not twice, not missing), saves and reloads."""
    from jax_specdec.io.heads import load_head
    from jax_specdec.training.head_recipe import _eagle3_config

    config = _eagle3_config(target, GEN_VOCAB, 1, (0, 1, 2), "tiny")
    assert config.style == "qwen3" and not config.layer.qk_norm
    head = Eagle3Head(config, rngs=nnx.Rngs(0), init_scale=0.1)
    save_speculators(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head")
    assert loaded.config.style == "qwen3" and loaded.layers[0].attn.q_norm is not None
    out = Generator(target, loaded, schedule=3)(PROMPTS, **CALL)
    same_tokens(out, Generator(target)(PROMPTS, **CALL))


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_mixtures_of_experts_are_refused_by_name(arch):
    with pytest.raises(ValueError, match=f"{arch} is a mixture-of-experts model, not supported"):
        config_from_hf({"architectures": [arch], "hidden_size": 8})
