"""Gemma 2 and Gemma 3 GGUF files against transformers' own GGUF loading: logits past the
window, the SentencePiece tokenizer rebuilt from the vocabulary, conversion, and the
switches read from the file."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf_files import encode

from jax_specdec.io.gguf import GGUFError, convert_gguf
from jax_specdec.io.hf import load_model, load_tokenizer

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

RTOL = 1e-5  # max |ours - transformers| / max |transformers|, float32
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
# Pieces in the order a Gemma file ranks them (merges follow this order, not the scores);
# "  " is stored with its spaces, as Gemma files store runs of blanks.
PIECES = [
    "▁", "t", "h", "e", "i", "n", "d", "f", "a", "o", "1", "2", "\n", "  ", "he", "▁t",
    "▁the", "in", "▁in", "▁d", "▁de", "de", "▁def", "▁a", "on", "▁on", "12", "▁▁▁", "ef",
]  # fmt: skip
TEXT = "def the in a <start_of_turn>hello 12 über<end_of_turn>\n  den on   xyz"
# (d, heads, kv heads, head_dim, mlp, layers, window): head_dim 256 is transformers'
# default query_pre_attn_scalar (its GGUF loader reads none) and llama.cpp's scale.
SHAPES = {"gemma2": (64, 2, 1, 256, 96, 2, 4), "gemma3": (64, 2, 1, 256, 96, 6, 4)}


def vocabulary():
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * len(PIECES)
    scores = np.random.default_rng(0).uniform(-10, 0, len(tokens)).round(3).tolist()
    return tokens, types, scores


def write_gemma_gguf(path, arch: str, qtype: str = "F32", *, seed=0, extra=None, skip=()):
    """A random `arch` file as llama.cpp writes one: norms stored as 1 + w, tied
    embeddings, the SentencePiece vocabulary with no merges."""
    rng = np.random.default_rng(seed)
    d, heads, kv, hd, mlp, layers, window = SHAPES[arch]
    tokens, types, scores = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(mlp)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    for key, value in (extra or {}).items():
        getattr(w, key)(value)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)

    def r(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    weights = {"token_embd.weight": r(len(tokens), d, scale=0.5), "output_norm.weight": 1 + r(d)}
    for i in range(layers):
        b = f"blk.{i}."
        weights |= {
            b + "attn_q.weight": r(heads * hd, d),
            b + "attn_k.weight": r(kv * hd, d),
            b + "attn_v.weight": r(kv * hd, d),
            b + "attn_output.weight": r(d, heads * hd),
            b + "ffn_gate.weight": r(mlp, d),
            b + "ffn_up.weight": r(mlp, d),
            b + "ffn_down.weight": r(d, mlp),
        }
        norms = ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]
        weights |= {b + f"{n}.weight": 1 + r(d) for n in norms}
        if arch == "gemma3":
            weights |= {b + f"attn_{x}_norm.weight": 1 + r(hd) for x in "qk"}
    for name, array in weights.items():
        if name not in skip:
            data, raw = encode(name, array, qtype, rng)
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return type(model).__name__, model(torch.tensor([ids])).logits.numpy()


def relative(ours, expected) -> float:
    return float(np.abs(np.asarray(ours) - expected).max() / np.abs(expected).max())


IDS = [2, 280, 17, 270, 5, 100, 281, 276, 279, 40, 268, 280, 271, 7, 275, 282, 6, 277, 290, 1]


@pytest.mark.parametrize(
    ("arch", "qtype"), [("gemma2", "F32"), ("gemma3", "F32"), ("gemma3", "Q8_0")]
)
def test_logits_past_the_window_match_transformers(tmp_path, arch, qtype):
    path = write_gemma_gguf(tmp_path / f"{arch}.gguf", arch, qtype)
    name, expected = reference_logits(path, IDS)  # 20 tokens, a window of 4
    assert name == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    ours = load_model(path)
    c = ours.config
    assert c.sliding_window == 4 and c.norm_plus_one and c.qk_norm == (arch == "gemma3")
    assert c.local_layers == ((0,) if arch == "gemma2" else (0, 1, 2, 3, 4))
    assert relative(ours(jnp.asarray([IDS])), expected) <= RTOL
    if qtype == "Q8_0":  # converted to a Hugging Face directory, read by both
        out = convert_gguf(path, tmp_path / "hf")
        converted = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            theirs = converted(torch.tensor([IDS])).logits.numpy()
        assert relative(theirs, expected) <= RTOL
        assert relative(load_model(out)(jnp.asarray([IDS])), expected) <= RTOL
        assert load_tokenizer(out).encode(TEXT).ids == load_tokenizer(path).encode(TEXT).ids


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tokenizer_matches_transformers(tmp_path, arch):
    path = write_gemma_gguf(tmp_path / f"{arch}.gguf", arch)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = load_tokenizer(path)
    for text in (TEXT, " the  in", "ü12\n\n", "<bos>def"):
        expected = theirs(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert ours.decode(expected, skip_special_tokens=True) == theirs.decode(
            expected, skip_special_tokens=True
        )
    ids = ours.encode("▁the def").ids
    assert ids[0] == 2 and len(ids) == 3  # <bos>, "▁the", "▁def": merged by position


def test_the_switches_read_from_the_file(tmp_path):
    extra = dict(add_attn_logit_softcapping=20.0, add_final_logit_softcapping=15.0)
    path = write_gemma_gguf(tmp_path / "g2.gguf", "gemma2", extra=extra)
    c = load_model(path, weights=False).config
    assert (c.attn_softcap, c.final_softcap, c.query_pre_attn_scalar) == (20.0, 15.0, 256.0)
    assert c.rope_local_theta is None and c.embed_scale and c.post_norms
    extra = dict(add_rope_scaling_type=gguf.RopeScalingType.LINEAR, add_rope_scaling_factor=8.0)
    extra["add_sliding_window_pattern"] = [True, False, True, True, False, False]
    path = write_gemma_gguf(tmp_path / "g3.gguf", "gemma3", extra=extra)
    c = load_model(path, weights=False).config
    assert c.rope_scaling.kind == "linear" and c.rope_scaling.factor == 8.0
    assert c.local_layers == (0, 2, 3) and (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)
    assert c.attn_softcap is None and c.final_softcap is None


@pytest.mark.parametrize(
    ("arch", "kw", "message"),
    [
        ("gemma3", dict(extra=dict(add_attn_logit_softcapping=50.0)), "Gemma 3 applies no soft"),
        ("gemma2", dict(skip=("blk.1.post_ffw_norm.weight",)), "missing tensors blk.1.post_ffw"),
        ("gemma3", dict(extra=dict(add_sliding_window_pattern=[True])), "one flag per layer"),
    ],
)
def test_bad_files_name_the_file_and_key(tmp_path, arch, kw, message):
    path = write_gemma_gguf(tmp_path / "bad.gguf", arch, **kw)
    with pytest.raises(GGUFError, match=message) as e:
        load_model(path)
    assert "bad.gguf" in str(e.value)
