"""EAGLE-3 heads against the reference: random-weight heads built with `speculators`' own
classes (Llama- and Qwen3-style layers, a draft vocabulary smaller than the target's and
the whole one), saved with its `save_pretrained`, read here; our draft logits over
several draft steps (each fed the previous step's hidden state, as EAGLE-3 drafts) equal
its PyTorch forward's, and our export loads back in `speculators` with the same logits.
Also the release layout, the refusals of bad heads and `jax-specdec convert-head`."""

import functools
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import hub_cache
from safetensors.numpy import load_file, save_file

from jax_specdec.cli import main
from jax_specdec.io.heads import load_head
from jax_specdec.io.hf import save_model
from jax_specdec.io.speculators import check_target, save_speculators
from jax_specdec.nn import KVCache, Transformer, TransformerConfig, init_cache
from jax_specdec.nn.eagle3 import Eagle3Head

# Skipped only where speculators is not installed: installed but broken, the tests fail.
if importlib.util.find_spec("speculators") is None:
    pytest.skip(
        "speculators is not installed (.ci/run: pip install --no-deps speculators==0.9.0)",
        allow_module_level=True,
    )


class _OnFirstUse:
    """A module imported when first used: every xdist worker collects this file, and
    importing speculators (with torch and transformers' models) takes about 10 s."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("_"):  # what collecting asks of every module-level object
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


speculators, torch = _OnFirstUse("speculators"), _OnFirstUse("torch")

V, H, T, STEPS = 200, 64, 10, 3
AUX = [1, 3, 5]
# Llama 3.1's rotary scaling: of head_dim 16's eight wavelengths (6.3 … 19,000 positions)
# two are kept, one smoothed and five divided by the factor.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# (style, draft vocabulary, variant flags): every norm variant appears once; "rope" in
# the flags is the layer's rope_parameters.
CASES = {
    "llama-64": ("llama", 64, {"norm_before_residual": True, "fc_norm": True}),
    "llama-64-llama3rope": ("llama", 64, {"norm_before_residual": True, "rope": LLAMA3_ROPE}),
    "llama-200": ("llama", V, {"norm_before_fc": True}),
    "qwen3-64": ("qwen3", 64, {"norm_output": True}),
    "qwen3-200": ("qwen3", V, {"norm_before_residual": True}),
}


def reference_model(style: str, draft_vocab: int, flags: dict, seed: int = 0):
    """A speculators Eagle3DraftModel with random weights (norm scales around 1, so a
    dropped norm shows) and, below the target's vocabulary, a random d2t/t2d."""
    from transformers import LlamaConfig, Qwen3Config

    layer_class = LlamaConfig if style == "llama" else Qwen3Config
    flags = dict(flags)
    rope = {"rope_parameters": flags.pop("rope")} if "rope" in flags else {}
    layer = layer_class(
        **rope,
        vocab_size=V,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    layer._attn_implementation = "eager"
    proposal = speculators.proposals.greedy.GreedyTokenProposalConfig(speculative_tokens=STEPS)
    config = speculators.Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=speculators.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[proposal],
            default_proposal_method="greedy",
            verifier=speculators.VerifierConfig(name_or_path=None, architectures=[]),
        ),
        **flags,
    )
    torch.manual_seed(seed)
    model = speculators.Eagle3DraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
        if draft_vocab < V:
            ids = torch.sort(torch.randperm(V, generator=g)[:draft_vocab]).values
            model.d2t.copy_(ids - torch.arange(draft_vocab))
            model.t2d.zero_()
            model.t2d[ids] = True
    return model.eval()


def inputs(seed: int = 1):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((1, T, len(AUX) * H)).astype(np.float32)
    tokens = rng.integers(0, V, (1, T))
    return features, tokens


def reference_logits(model, features, tokens, steps=STEPS) -> list[np.ndarray]:
    """Its forward's draft logits [T, K] per step (teacher-forced tokens, its own hidden
    states fed back), caught at the LM head; positions 0 … T - 1 at the first step."""
    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o[0].numpy()))
    with torch.no_grad():
        model(
            torch.from_numpy(features),
            torch.from_numpy(tokens),
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=steps,
        )
    hook.remove()
    return caught


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, hidden, tokens, cache, embed):
    return nnx.merge(graphdef, state).decode(hidden, tokens, cache, embed=embed)


def our_logits(head: Eagle3Head, features, tokens, steps=STEPS, embed=None) -> list[np.ndarray]:
    """The same steps as the loop drafts them: the first over the T entries into the
    cache; then row b is a round whose pending position is b (cache valid below b + 1),
    each step one entry fed the previous step's hidden state and token b + s."""
    graphdef, state = nnx.split(head)
    decode = functools.partial(_decode, graphdef, state, embed=embed)
    cache = init_cache(head.config.layer, batch=1, max_len=T + steps)
    logits, hidden, cache = decode(features, jnp.asarray(tokens), cache)
    out = [np.asarray(logits[0])]
    rows = KVCache(
        keys=tuple(jnp.repeat(k, T, axis=0) for k in cache.keys),
        values=tuple(jnp.repeat(v, T, axis=0) for v in cache.values),
        lengths=jnp.arange(1, T + 1, dtype=jnp.int32),
    )
    hidden = hidden[0][:, None]  # [T, 1, H]
    padded = np.concatenate([tokens[0], np.zeros(steps, tokens.dtype)])  # as it pads
    for s in range(1, steps):
        step_tokens = jnp.asarray(padded[s : s + T])[:, None]
        logits, hidden, rows = decode(hidden, step_tokens, rows)
        out.append(np.asarray(logits[:, 0]))
    return out


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (name, reference model, its directory, our head loaded from it)."""
    cases = {}

    def get(name):
        if name not in cases:
            style, draft_vocab, flags = CASES[name]
            model = reference_model(style, draft_vocab, flags)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(str(directory))
            cases[name] = name, model, directory, load_head(directory)
        return cases[name]

    return get


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, saved):
    return saved(request.param)


def test_draft_logits_match_speculators(case):
    name, model, _, head = case
    features, tokens = inputs()
    reference, ours = reference_logits(model, features, tokens), our_logits(head, features, tokens)
    assert len(reference) == len(ours) == STEPS
    for step, (r, o) in enumerate(zip(reference, ours, strict=True)):
        error = relative_error(o, r)
        assert error < 1e-5, f"{name} step {step}: max relative error {error:.2e}"
    # Drafted tokens in the target's vocabulary: d + d2t[d].
    drafted = np.argmax(ours[0], axis=-1)
    expected = drafted + (model.d2t.numpy()[drafted] if model.d2t is not None else 0)
    np.testing.assert_array_equal(np.asarray(head.target_ids(jnp.asarray(drafted))), expected)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A target for the heads, saved as a Hugging Face directory: `speculators` reads the
    verifier a head names when it loads one."""
    config = TransformerConfig.tiny(
        vocab_size=V, d_model=H, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16
    )
    directory = tmp_path_factory.mktemp("verifier")
    save_model(Transformer(config, rngs=nnx.Rngs(0)), directory)
    return config, directory


def test_export_loads_in_speculators_with_the_same_logits(case, verifier, tmp_path):
    name, model, _, head = case
    save_speculators(head, tmp_path, verifier=str(verifier[1]))
    config = speculators.Eagle3SpeculatorConfig.from_pretrained(str(tmp_path))
    config.transformer_layer_config._attn_implementation = "eager"  # not flex attention
    back = speculators.Eagle3DraftModel.from_pretrained(str(tmp_path), config=config)
    features, tokens = inputs(2)
    expected = reference_logits(model, features, tokens, steps=2)
    loaded = reference_logits(back.eval(), features, tokens, steps=2)
    for r, o in zip(expected, loaded, strict=True):
        assert relative_error(o, r) < 1e-6, name
    if model.d2t is not None:
        np.testing.assert_array_equal(back.d2t.numpy(), model.d2t.numpy())
        np.testing.assert_array_equal(back.t2d.numpy(), model.t2d.numpy())


def write_release(model, directory, draft_vocab: int) -> None:
    """The model in the original EAGLE-3 release layout: a Llama config with
    draft_vocab_size, the layer under midlayer., no token embedding."""
    directory.mkdir()
    tensors = {
        name.replace("layers.0.", "midlayer."): p.detach().numpy()
        for name, p in model.state_dict().items()
        if not name.startswith(("embed_tokens", "verifier_"))
    }
    save_file(tensors, str(directory / "model.safetensors"))
    layer = model.config.transformer_layer_config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": layer.rms_norm_eps,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))


def test_release_layout_reads_as_the_speculators_converter_converts_it(
    verifier, tmp_path, monkeypatch
):
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    model = reference_model("llama", 64, {"norm_before_residual": True}, seed=3)
    write_release(model, tmp_path / "release", 64)
    embed = model.embed_tokens.weight.detach().numpy()
    features, tokens = inputs(3)
    expected = reference_logits(model, features, tokens)
    # The release records neither norm_before_residual nor the target layers.
    head = load_head(tmp_path / "release")
    assert head.embed is None and not head.config.norm_before_residual
    out = tmp_path / "converted"
    argv = ["convert-head", str(tmp_path / "release"), str(out), "--norm-before-residual"]
    argv += ["--verifier", str(verifier[1]), "--aux-layer-ids", "1,3,5"]
    assert main(argv) == 0
    # The same release named by a Hub id (from a cache, offline) converts the same.
    hub_cache(tmp_path / "hub", monkeypatch, {"org/release": tmp_path / "release"})
    assert main(["convert-head", "org/release", str(tmp_path / "from_hub"), *argv[3:]]) == 0
    for file in out.iterdir():
        assert (tmp_path / "from_hub" / file.name).read_bytes() == file.read_bytes(), file.name
    Eagle3Converter().convert(
        tmp_path / "release",
        tmp_path / "theirs",
        base_model=str(verifier[1]),
        validate=False,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=AUX,
    )
    for directory in (out, tmp_path / "theirs"):
        head = load_head(directory)
        assert head.config.aux_layer_ids == tuple(AUX) and head.config.norm_before_residual
        for r, o in zip(expected, our_logits(head, features, tokens, embed=embed), strict=True):
            assert relative_error(o, r) < 1e-5, directory.name


def _broken(directory, tmp_path, tensors=None, config=None):
    """A copy of a head's directory with its tensors or config changed."""
    out = tmp_path / "broken"
    out.mkdir()
    weights = load_file(str(directory / "model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(out / "model.safetensors"))
    data = json.loads((directory / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config(data) if config else data))
    return out


def _shifted_d2t(weights):
    weights["d2t"][-1] += V
    return weights


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(tensors=lambda w: {k: v for k, v in w.items() if k != "norm.weight"}), "norm.weight"),
        (dict(tensors=lambda w: {**w, "fc.weight": w["fc.weight"][:, :-1]}), "fc.weight"),
        (dict(tensors=_shifted_d2t), "d2t points outside the target's vocabulary"),
        (dict(tensors=lambda w: {k: v for k, v in w.items() if k != "d2t"}), "d2t is missing"),
        (dict(config=lambda c: {**c, "speculators_model_type": "mtp"}), "speculators_model_type"),
        (dict(config=lambda c: {**c, "fc_norm": "yes"}), "fc_norm"),
    ],
)
def test_bad_heads_are_refused_naming_the_field(saved, tmp_path, change, message):
    _, _, directory, _ = saved("llama-64")
    with pytest.raises(ValueError, match=message):
        load_head(_broken(directory, tmp_path, **change))


def test_heads_for_another_target_are_refused(saved, verifier, tmp_path, capsys):
    _, _, directory, head = saved("llama-64")
    target = verifier[0]
    check_target(head.config, target)  # the target it was made for
    with pytest.raises(ValueError, match="hidden size 64.*hidden size is 32"):
        check_target(head.config, target.replace(d_model=32))
    with pytest.raises(ValueError, match="vocabulary is 200.*300"):
        check_target(head.config, target.replace(vocab_size=300))
    with pytest.raises(ValueError, match="layers \\[1, 3, 5\\].*has 4"):
        check_target(head.config, target.replace(num_layers=4))
    other = tmp_path / "other"
    save_model(Transformer(target.replace(d_model=32, head_dim=8), rngs=nnx.Rngs(0)), other)
    with pytest.raises(SystemExit) as exit_info:
        main(["convert-head", str(directory), str(tmp_path / "out"), "--target", str(other)])
    assert exit_info.value.code == 2
    assert "hidden size is 32" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_stored_types_are_kept_through_conversion(saved, tmp_path):
    _, _, directory, _ = saved("qwen3-64")
    half = _broken(
        directory,
        tmp_path,
        tensors=lambda w: {
            k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in w.items()
        },
    )
    head = load_head(half)
    assert head.config.layer.param_dtype == "float16" and head.config.layer.dtype == "float32"
    assert head.fc.kernel[...].dtype == jnp.float16
    save_speculators(head, tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {v.dtype.name for k, v in written.items() if k not in ("d2t", "t2d")} == {"float16"}
    assert written["d2t"].dtype == np.int64 and written["t2d"].dtype == bool
