"""Gemma 2 and Gemma 3 (text): parity with transformers' Gemma2ForCausalLM,
Gemma3ForCausalLM and Gemma3ForConditionalGeneration on random tiny models saved with
`save_pretrained` (prefill and cached decoding past the sliding window), the export
read back by transformers, each switch shown to matter, the config's refusals, greedy
speculative decoding on a Gemma target whose window is shorter than its sequences, and
the enumerated exactness test on such a target (which fails with the window left out
of the loop's masks)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    PROMPTS,
    VOCAB,
    assert_follows_target,
    chi_square_pvalue,
    exact_sequence_probs,
    ragged_prompts,
    sample_sequences,
)
from safetensors.numpy import load_file, save_file

from jax_specdec import Generator, NGram
from jax_specdec.io.hf import load_model, save_model
from jax_specdec.io.hf_config import config_from_hf
from jax_specdec.nn import Transformer, TransformerConfig, init_cache
from jax_specdec.sampling import SamplingConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = 1e-5  # max |ours - transformers| / max |transformers|, float32
HF_VOCAB = 61
SHAPE = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=48)
CONFIGS = {
    # Gemma 2: soft caps on (small enough to bite), GQA 4/2, head_dim 16 != 32 / 4,
    # query_pre_attn_scalar not head_dim, layers 0 and 2 local (window 8), untied.
    "gemma2_softcaps": (
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            sliding_window=8, tie_word_embeddings=False,
        ),
    ),
    # Gemma 3: q/k norms, local/global layers (window 6), the local layers' own rope
    # base, linear rope scaling on the global ones, MQA 4/1, head_dim 12, tied, a final
    # soft cap (Gemma3ForCausalLM applies it).
    "gemma3_local_global": (
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
            query_pre_attn_scalar=12, sliding_window=6, final_logit_softcapping=8.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
            tie_word_embeddings=True, attention_bias=True,
        ),
    ),
    # The text model of a Gemma3ForConditionalGeneration checkpoint: GQA 6/2 (d 48),
    # head_dim 8, layers local but for every third (sliding_window_pattern 3), window 7.
    "gemma3_conditional": (
        "Gemma3ForConditionalGeneration",
        dict(
            hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            head_dim=8, query_pre_attn_scalar=8, sliding_window=7, sliding_window_pattern=3,
        ),
    ),
}  # fmt: skip


def randomize(model, seed):
    """Every parameter random; the (1 + w) norms' w around 0 but far from it."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model.eval()


def hf_model(arch, seed=0, **fields):
    """A random tiny `arch` (Gemma2/Gemma3ForCausalLM, Gemma3ForConditionalGeneration
    with a one-layer vision tower) with O(1) logits."""
    fields = {**SHAPE, "max_position_embeddings": 128, **fields}
    if arch == "Gemma2ForCausalLM":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**fields))
    elif arch == "Gemma3ForCausalLM":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    else:
        vision = transformers.SiglipVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        )  # fmt: skip
        text = transformers.Gemma3TextConfig(**fields).to_dict()
        config = transformers.Gemma3Config(
            text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
            image_token_index=1000,  # outside the vocabulary: never in our token ids
        )  # fmt: skip
        model = transformers.Gemma3ForConditionalGeneration(config)
    return randomize(model, seed)


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
    """transformers' own cached decoding: `prefill` tokens at once, then one a call."""
    tokens = torch.tensor(np.asarray(tokens))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = [model(tokens[:, :prefill], cache=cache, use_cache=True).logits]
        for t in range(prefill, tokens.shape[1]):
            out.append(model(tokens[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1).float().numpy()


def our_cached_logits(model, tokens, prefill: int) -> np.ndarray:
    cache = init_cache(model.config, batch=tokens.shape[0], max_len=tokens.shape[1])
    logits, cache = model.decode(jnp.asarray(tokens[:, :prefill]), cache)
    out = [logits]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = model.decode(jnp.asarray(tokens[:, t : t + 1]), cache)
        out.append(logits)
    return np.concatenate([np.asarray(x) for x in out], axis=1)


def twin(model, **changes):
    """`model`'s weights under a config with `changes` (one switch turned off)."""
    config = model.config.replace(**changes)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


TOKENS = np.random.default_rng(1).integers(0, HF_VOCAB, (2, 48))  # 6-8 windows long
PREFILL = 8  # then 40 tokens one at a time, all past the window


# ----------------------------------------------------------------------- parity


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(name, transformers' model, ours loaded from its save_pretrained directory)."""
    arch, fields = CONFIGS[request.param]
    reference = hf_model(arch, **fields)
    directory = saved(reference, tmp_path_factory.mktemp(request.param))
    return request.param, reference, load_model(directory)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_prefill_cached_decoding_and_export_match_transformers(pair, tmp_path):
    name, reference, ours = pair
    c = ours.config
    assert c.sliding_window < TOKENS.shape[1] - PREFILL and c.local_layers
    expected = hf_logits(reference, TOKENS)
    assert np.abs(expected).max() > 0.5  # not a comparison of near-zero logits
    got = np.asarray(ours(jnp.asarray(TOKENS)))
    prefill = relative(got, expected)
    decoded = our_cached_logits(ours, TOKENS, PREFILL)
    theirs = hf_cached_logits(reference, TOKENS, PREFILL)
    print(f"\nGEMMA {name}: prefill {prefill:.2e}, cached {relative(decoded, theirs):.2e}")
    assert prefill <= RTOL
    assert relative(decoded, theirs) <= RTOL and relative(decoded, expected) <= RTOL

    save_model(ours, tmp_path / "export")
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    arch = "Gemma3ForCausalLM" if c.qk_norm else "Gemma2ForCausalLM"
    assert hf["architectures"] == [arch]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back).__name__ == arch
    exported = relative(hf_logits(back, TOKENS), got)
    print(f"GEMMA {name}: export read by transformers {exported:.2e}")
    assert exported <= RTOL
    again = load_model(tmp_path / "export")
    assert again.config == c
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(TOKENS))), got)


SWITCHES = {
    # switch: (the config, the change that turns it off)
    "norm_plus_one": ("gemma3_local_global", dict(norm_plus_one=False)),
    "window": ("gemma3_local_global", dict(sliding_window=10**6)),
    "attn_softcap": ("gemma2_softcaps", dict(attn_softcap=None)),
    "final_softcap": ("gemma2_softcaps", dict(final_softcap=None)),
    "embed_scale": ("gemma3_conditional", dict(embed_scale=False)),
    "query_pre_attn_scalar": ("gemma2_softcaps", dict(query_pre_attn_scalar=None)),
    "rope_local_theta": ("gemma3_local_global", dict(rope_local_theta=None)),
    "rope_scaling": ("gemma3_local_global", dict(rope_scaling=None)),
    "geglu": ("gemma2_softcaps", dict(mlp="swiglu")),
}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_each_switch_changes_the_logits(switch, tmp_path):
    """The parity test's models exercise every switch: with one turned off (the same
    weights) ours is far from transformers, so that test fails when a switch is ignored
    (the window: in prefill and in cached decoding past it)."""
    name, off = SWITCHES[switch]
    arch, fields = CONFIGS[name]
    reference = hf_model(arch, **fields)
    ours = load_model(saved(reference, tmp_path))
    assert relative(ours(jnp.asarray(TOKENS)), hf_logits(reference, TOKENS)) <= RTOL
    broken = twin(ours, **off)
    moved = relative(broken(jnp.asarray(TOKENS)), hf_logits(reference, TOKENS))
    print(f"\nGEMMA without {switch}: {moved:.2g}")
    assert moved > 0.05
    if switch == "window":
        decoded = our_cached_logits(broken, TOKENS, PREFILL)
        assert relative(decoded, hf_logits(reference, TOKENS)) > 0.05


def test_our_own_gemma_models_export(tmp_path):
    """Randomly initialised models of ours (norm scales made not 0) are written as
    Gemma2ForCausalLM / Gemma3ForCausalLM and read back by transformers alike."""
    for qk_norm, extra in ((False, dict(attn_softcap=4.0)), (True, dict(rope_local_theta=99.0))):
        config = gemma_tiny(vocab_size=HF_VOCAB, qk_norm=qk_norm, **extra)
        ours = Transformer(config, rngs=nnx.Rngs(3), init_scale=0.3)
        shake_norms(ours)
        save_model(ours, tmp_path / str(qk_norm))
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(qk_norm)).eval()
        tokens = np.random.default_rng(2).integers(0, HF_VOCAB, (2, 20))
        assert relative(hf_logits(back, tokens), ours(jnp.asarray(tokens))) <= RTOL


# ----------------------------------------------------------------------- config


def hf_config(name, tmp_path) -> dict:
    arch, fields = CONFIGS[name]
    directory = saved(hf_model(arch, **fields), tmp_path / name)
    return json.loads((directory / "config.json").read_text())


def test_config_maps_and_round_trips(tmp_path):
    c = config_from_hf(hf_config("gemma3_local_global", tmp_path))
    assert c.qk_norm and c.embed_scale and c.norm_plus_one and c.post_norms and c.mlp == "geglu"
    assert (c.sliding_window, c.local_layers, c.rope_local_theta) == (6, (0, 2, 3), 50.0)
    assert c.rope_theta == 1e4 and c.rope_scaling.kind == "linear" and c.rope_scaling.factor == 4
    assert c.query_pre_attn_scalar == 12 and c.attn_softcap is None and c.final_softcap == 8
    assert c.qkv_bias and c.out_bias and c.tie_embeddings
    assert TransformerConfig.from_dict(json.loads(c.to_json())) == c
    g2 = config_from_hf(hf_config("gemma2_softcaps", tmp_path))
    assert (g2.attn_softcap, g2.final_softcap, g2.local_layers) == (2.0, 3.0, (0, 2))
    assert not g2.qk_norm and g2.rope_local_theta is None and not g2.tie_embeddings
    cond = hf_config("gemma3_conditional", tmp_path)
    assert config_from_hf(cond).local_layers == (0, 1)  # layer 2 is global
    assert config_from_hf({**cond, "architectures": None}) == config_from_hf(cond)


def test_layer_patterns_and_legacy_rope_fields(tmp_path):
    """Without layer_types: Gemma 2 alternates (0, 2, …), Gemma 3 follows
    sliding_window_pattern (default 6). Gemma 3's older rope fields (rope_theta,
    rope_local_base_freq, rope_scaling) read as transformers >= 5's rope_parameters."""
    g2 = {k: v for k, v in hf_config("gemma2_softcaps", tmp_path).items() if k != "layer_types"}
    assert config_from_hf({**g2, "num_hidden_layers": 5}).local_layers == (0, 2, 4)
    g3 = hf_config("gemma3_local_global", tmp_path)
    plain = {k: v for k, v in g3.items() if k not in ("layer_types", "sliding_window_pattern")}
    plain.pop("_sliding_window_pattern", None)
    assert config_from_hf({**plain, "num_hidden_layers": 7}).local_layers == (0, 1, 2, 3, 4, 6)
    legacy = {k: v for k, v in g3.items() if k != "rope_parameters"}
    legacy |= dict(rope_theta=1e4, rope_local_base_freq=50.0,
                   rope_scaling={"rope_type": "linear", "factor": 4.0})  # fmt: skip
    assert config_from_hf(legacy) == config_from_hf(g3)


def refusal(directory, hf, match):
    (directory / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=match) as info:
        load_model(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory / "config.json") in message
    return message


def test_refusals_name_config_json_and_the_field(tmp_path):
    g3 = hf_config("gemma3_local_global", tmp_path)
    d = tmp_path / "gemma3_local_global"
    types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    refusal(d, {**g3, "layer_types": types}, r"layer_types\[1\] 'chunked_attention'")
    yarn = {**g3["rope_parameters"], "full_attention": {"rope_type": "yarn", "factor": 2.0}}
    refusal(d, {**g3, "rope_parameters": yarn}, r"rope_parameters.full_attention.rope_type 'yarn'")
    local = {**g3["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2}}
    refusal(d, {**g3, "rope_parameters": local}, "rope_parameters.sliding_attention")
    refusal(d, {**g3, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping is set")
    refusal(d, {**g3, "hidden_activation": "gelu"}, "hidden_activation 'gelu'")
    refusal(d, {**g3, "use_bidirectional_attention": True}, "use_bidirectional_attention")
    refusal(d, {**g3, "sliding_window": None}, "sliding_window must be an integer")
    g2 = hf_config("gemma2_softcaps", tmp_path)
    d2 = tmp_path / "gemma2_softcaps"
    refusal(d2, {**g2, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'")
    cond = hf_config("gemma3_conditional", tmp_path)
    d3 = tmp_path / "gemma3_conditional"
    text = {**cond["text_config"], "final_logit_softcapping": 30.0}
    refusal(d3, {**cond, "text_config": text}, "text_config.final_logit_softcapping is set")
    types = ["full_attention", "global"]
    refusal(d3, {**cond, "text_config": {**cond["text_config"], "layer_types": types}},
            r"text_config.layer_types must be a list of num_hidden_layers \(3\)")  # fmt: skip


@pytest.mark.parametrize("name", ["gemma2_softcaps", "gemma3_conditional"])
def test_a_checkpoint_without_a_post_norm_is_refused(name, tmp_path):
    arch, fields = CONFIGS[name]
    directory = saved(hf_model(arch, **fields), tmp_path / name)
    tensors = load_file(directory / "model.safetensors")
    gone = next(n for n in tensors if n.endswith("layers.1.post_feedforward_layernorm.weight"))
    del tensors[gone]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors: model.layers.1.post_feedforward") as e:
        load_model(directory)
    assert "\n" not in str(e.value)


def test_the_conditional_checkpoints_other_tensor_names(tmp_path):
    """transformers 4.5x wrote the text model as model.language_model.*: read alike."""
    arch, fields = CONFIGS["gemma3_conditional"]
    reference = hf_model(arch, **fields)
    directory = saved(reference, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    renamed = {
        n.replace("language_model.model.", "model.language_model.").replace(
            "vision_tower.", "model.vision_tower."
        ): a
        for n, a in tensors.items()
    }
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(directory)
    assert relative(ours(jnp.asarray(TOKENS)), hf_logits(reference, TOKENS)) <= RTOL


def test_export_refusals():
    def refused(config, match):
        with pytest.raises(ValueError, match=match):
            save_model(Transformer(config, rngs=nnx.Rngs(0)), "/nonexistent")

    windowed_llama = TransformerConfig.tiny(sliding_window=4, local_layers=(0,))
    refused(windowed_llama, "Gemma export needs .* wrong here: mlp, embed_scale")
    refused(gemma_tiny(qk_norm=True, attn_softcap=5.0), "Gemma 3 export .* attn_softcap")
    refused(gemma_tiny(rope_local_theta=10.0), "Gemma 2 export .* rope_local_theta")
    with pytest.raises(ValueError, match="sliding_window and local_layers go together"):
        TransformerConfig.tiny(sliding_window=4)
    with pytest.raises(ValueError, match="local_layers must be distinct sorted ids"):
        TransformerConfig.tiny(sliding_window=4, local_layers=(2,))


# ------------------------------------------------------------ speculative decoding


def gemma_tiny(**overrides) -> TransformerConfig:
    """A tiny Gemma-style config of ours: every switch on, layer 0 local (window 3)."""
    gemma = dict(
        mlp="geglu", embed_scale=True, norm_plus_one=True, post_norms=True,
        query_pre_attn_scalar=6.0, final_softcap=6.0, sliding_window=3, local_layers=(0,),
    )  # fmt: skip
    return TransformerConfig.tiny(**{**gemma, **overrides})


def shake_norms(model, seed=0):
    """Norm scales w (used as 1 + w) away from 0, so the norms are not the identity."""
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    for i, (path, leaf) in enumerate(flat):
        if "scale" in path:
            key = jax.random.key(seed * 1000 + i)
            leaf.set_value(0.3 * jax.random.normal(key, leaf.get_value().shape))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


GEN_VOCAB = 32
PROMPTS_GEN = ragged_prompts(4, GEN_VOCAB, seed=3)
CALL = dict(key=jax.random.key(0), max_new_tokens=[14, 6, 16, 10])


@pytest.fixture(scope="module")
def target_pair(tmp_path_factory):
    """A tiny Gemma 3 target, transformers' and ours from its HF directory: window 4
    (shorter than every sequence here), layers 0 and 2 local, q/k norms, GQA 4/2,
    head_dim 16."""
    reference = hf_model(
        "Gemma3ForCausalLM", seed=7, vocab_size=GEN_VOCAB, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, sliding_window_pattern=2, final_logit_softcapping=10.0,
    )  # fmt: skip
    return reference, load_model(saved(reference, tmp_path_factory.mktemp("gemma3_target")))


@pytest.fixture(scope="module")
def target(target_pair):
    return target_pair[1]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A one-layer Gemma 2 draft (local, window 3; soft caps) on the same vocabulary."""
    reference = hf_model(
        "Gemma2ForCausalLM", seed=8, vocab_size=GEN_VOCAB, hidden_size=16,
        intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=3, attn_logit_softcapping=5.0,
    )  # fmt: skip
    return load_model(saved(reference, tmp_path_factory.mktemp("gemma2_draft")))


def same_tokens(a, b):
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))


def hf_greedy(model, prompt, budget, eos=2):
    """transformers' greedy tokens after `prompt`, one full forward per token."""
    seq = list(prompt)
    for _ in range(budget):
        seq.append(int(hf_logits(model, [seq])[0, -1].argmax()))
        if seq[-1] == eos:
            break
    return seq[len(prompt) :]


@pytest.mark.slow
def test_greedy_speculative_equals_autoregressive(target_pair, draft):
    reference, target = target_pair
    assert target.config.sliding_window == 4 and draft.config.local_layers == (0,)
    ar = Generator(target, eos_token_id=2)(PROMPTS_GEN, **CALL)
    tokens, lengths = np.asarray(ar.tokens), np.asarray(ar.lengths)
    for b, (prompt, budget) in enumerate(zip(PROMPTS_GEN, CALL["max_new_tokens"], strict=True)):
        assert tokens[b, : lengths[b]].tolist() == hf_greedy(reference, prompt, budget)
    accepted = {}
    for name, proposer, tree in (
        ("ngram chain", NGram(), None),
        ("ngram tree", NGram(), 6),
        ("draft model chain", draft, None),
    ):
        spec = Generator(target, proposer, schedule=3, tree=tree, eos_token_id=2)(
            PROMPTS_GEN, **CALL
        )
        same_tokens(spec, ar)
        accepted[name] = int(np.asarray(spec.stats.accepted).sum())
    assert min(accepted.values()) > 0, accepted


@pytest.mark.slow
def test_slots_greedy_speculative_equals_autoregressive(target, draft):
    call = {**CALL, "num_slots": 2}
    ar = Generator(target, eos_token_id=2)(PROMPTS_GEN, **CALL)
    same_tokens(Generator(target, eos_token_id=2)(PROMPTS_GEN, **call), ar)
    for proposer in (draft, NGram()):
        same_tokens(
            Generator(target, proposer, schedule=3, eos_token_id=2)(PROMPTS_GEN, **call), ar
        )


def test_recent_entries_and_trees_see_the_window():
    """A draft model's entries kept aside (`recent`) and a tree's nodes are masked by
    the window as the cache is: decode_entries gives the full forward's logits."""
    model = shake_norms(Transformer(gemma_tiny(vocab_size=GEN_VOCAB, sliding_window=2,
                                               local_layers=(0, 1)),
                                    rngs=nnx.Rngs(4), init_scale=0.5))  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, GEN_VOCAB, (2, 10)))
    full = np.asarray(model(tokens))
    _, cache = model.decode(tokens[:, :4], init_cache(model.config, batch=2, max_len=16))
    _, keys, values = model.decode_entries(tokens[:, 4:7], cache)
    recent = (keys, values, jnp.full((2,), 3, jnp.int32))
    logits = model.decode_entries(tokens[:, 7:], cache, recent)[0]
    assert relative(logits, full[:, 7:]) <= RTOL
    # A tree of two paths under node 0: 0 -> 1 -> 2 (tokens 4, 5, 6) and 0 -> 3 (a
    # sibling of node 1 holding token 5 again): node 3 sees what node 1 sees.
    depth = jnp.asarray([[0, 1, 2, 1]] * 2, jnp.int32)
    mask = np.eye(4, dtype=bool)
    mask[1, 0] = mask[2, :2] = mask[3, 0] = True
    nodes = jnp.concatenate([tokens[:, 4:7], tokens[:, 5:6]], axis=1)
    logits = model.decode_entries(nodes, cache, tree=(depth, jnp.asarray(mask)[None]))[0]
    assert relative(logits[:, :3], full[:, 4:7]) <= RTOL
    assert relative(logits[:, 3], full[:, 5]) <= RTOL
    assert relative(twin(model, sliding_window=10**6)(tokens)[:, 4:], full[:, 4:]) > 0.05


# ---------------------------------------------------------------- exactness

T1 = SamplingConfig(1.0)


@pytest.fixture(scope="module")
def enumerated():
    """The enumerated target (vocabulary 6): Gemma-style, window 2 on layer 0 (the
    sequences run to 7 tokens), and its twin that ignores the window; a Gemma draft."""
    target = shake_norms(Transformer(gemma_tiny(vocab_size=VOCAB, sliding_window=2),
                                     rngs=nnx.Rngs(0), init_scale=0.5))  # fmt: skip
    draft_config = gemma_tiny(vocab_size=VOCAB, num_layers=1, d_model=16, num_heads=2,
                              num_kv_heads=1, mlp_dim=32, sliding_window=2)  # fmt: skip
    draft = shake_norms(Transformer(draft_config, rngs=nnx.Rngs(1), init_scale=0.3), seed=1)
    return target, twin(target, sliding_window=10**6), draft


def test_the_window_moves_the_enumerated_distribution(enumerated):
    """Without the window the target's sequence probabilities differ (total variation
    > 0.05 on the long prompt), so the sampling test below can see a lost window."""
    target, unwindowed, _ = enumerated
    exact = exact_sequence_probs(target, np.array(PROMPTS[1]), T1, None)
    other = exact_sequence_probs(unwindowed, np.array(PROMPTS[1]), T1, None)
    tv = 0.5 * sum(abs(exact.get(s, 0) - other.get(s, 0)) for s in set(exact) | set(other))
    print(f"\nGEMMA window total variation: {tv:.3f}")
    assert tv > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft", "ngram_tree"])
def test_samples_follow_the_windowed_target(enumerated, drafter):
    target, _, draft = enumerated
    kwargs = dict(tree=4) if drafter == "ngram_tree" else {}
    proposer = draft if drafter == "draft" else NGram()
    seqs, stats = sample_sequences(target, proposer, T1, 3, None, seed=3, **kwargs)
    assert 0.0 < stats.acceptance_rate < 0.95
    assert_follows_target(target, seqs, T1, None, label=f"gemma window {drafter}")


@pytest.mark.slow
def test_the_same_test_fails_with_the_window_left_out(enumerated):
    """The loop run on the twin that ignores the window (its verify attends to every
    earlier position): the chi-square test against the windowed target's enumerated
    probabilities fails (p < 1e-6 on the long prompt)."""
    target, unwindowed, draft = enumerated
    seqs, _ = sample_sequences(unwindowed, draft, T1, 3, None, seed=3)
    exact = exact_sequence_probs(target, np.array(PROMPTS[1]), T1, None)
    pvalue = chi_square_pvalue(seqs[1::2], exact)
    print(f"\nGEMMA window left out: chi2_pvalue={pvalue:.3g}")
    assert pvalue < 1e-6


@pytest.mark.slow
def test_heads_for_a_gemma_target_are_llama_style_and_draft_exactly(target, tmp_path):
    """`train-drafter --kind eagle3` on a Gemma target: the head's layer is Llama-style with
    global attention (the speculators format has no Gemma layer), it saves and reloads, and
    an EAGLE-3 head and a feature head draft for the Gemma target (greedy = autoregressive)."""
    from helpers import make_head

    from jax_specdec.io.heads import load_head
    from jax_specdec.io.speculators import save_speculators
    from jax_specdec.nn.eagle3 import Eagle3Head
    from jax_specdec.training.head_recipe import _eagle3_config

    config = _eagle3_config(target, GEN_VOCAB, 1, (0, 1, 2), "tiny")
    layer = config.layer
    assert layer.mlp == "swiglu" and layer.sliding_window is None and not layer.post_norms
    head = Eagle3Head(config, rngs=nnx.Rngs(0), init_scale=0.1)
    save_speculators(head, tmp_path / "head")
    ar = Generator(target)(PROMPTS_GEN, **CALL)
    for draft in (load_head(tmp_path / "head"), make_head(target)):
        same_tokens(Generator(target, draft, schedule=3)(PROMPTS_GEN, **CALL), ar)


@pytest.mark.slow
def test_drafters_on_a_mesh_give_the_one_device_tokens():
    """A Gemma-style target (every switch, q/k norms, window 3 shorter than the rows) and
    its drafters split over a (2, 2) mesh of CPU devices: a draft model's chain, a
    feature head's tree and n-gram slots give the one-device tokens, drafts accepted."""
    script = str(pathlib.Path(__file__).parent / "family_mesh_run.py")
    proc = subprocess.run(
        [sys.executable, script, "gemma"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("devices") == 4 and len(out) == 3
    for name, run in out.items():
        assert run["mesh"] == run["one"], name
        assert run["accepted"] > 0, f"{name}: nothing accepted, a vacuous test"
