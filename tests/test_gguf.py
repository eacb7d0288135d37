"""GGUF import: parity with transformers' own GGUF loading on small random files of each
architecture and several tensor types, the tokenizer, conversion, bad input."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf_files import llama_cpp_permute, write_gguf

from jax_specdec.io.gguf import GGUFError, convert_gguf, unpermute_rotary
from jax_specdec.io.hf import load_model, load_tokenizer

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

RTOL = 1e-4  # max |ours - transformers| / max |transformers|
TEXT = "def the in a <|im_start|>hello 123 über<|endoftext|>\n  den on"
CASES = [
    *(("llama", q) for q in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")),
    *(("llama", q) for q in ("Q4_K", "Q5_K", "Q6_K")),
    *(("qwen2", q) for q in ("F32", "Q8_0", "Q4_K", "Q6_K")),
    # head_dim 32 != 256 / 4 and one KV head: its rows are too short for k-quants.
    *(("mistral", q) for q in ("F16", "Q8_0", "Q5_1")),
]


def reference(path):
    """transformers' model and tokenizer for a GGUF file, float32."""
    kw = dict(gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kw
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent, **kw)


def relative_error(ours, ref_model, ids) -> float:
    a = np.asarray(ours(jnp.asarray([ids])))
    with torch.no_grad():
        b = ref_model(torch.tensor([ids])).logits.numpy()
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_logits_match_transformers(tmp_path, arch, qtype):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, qtype, seed=len(qtype))
    ref_model, _ = reference(path)
    expected = "qwen2" if arch == "qwen2" else "llama"  # Mistral files hold a llama
    assert type(ref_model).__name__.lower().startswith(expected)
    ours = load_model(path)
    ids = list(range(0, 260, 7)) + [257, 258, 259]  # bytes, merges, a special token
    assert relative_error(ours, ref_model, ids) < RTOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tokenizer_matches_transformers(tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, "Q8_0")
    _, ref_tok = reference(path)
    ours = load_tokenizer(path)
    ids = ours.encode(TEXT).ids
    assert ids == ref_tok(TEXT).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == TEXT
    assert ours.token_to_id("<|im_start|>") in ids  # a control token stays whole


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, rows in ((4, 64), (2, 32), (1, 8)):
        w = rng.standard_normal((rows, 5))
        np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(w, heads), heads), w)
        bias = rng.standard_normal(rows)
        np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(bias, heads), heads), bias)
    assert not np.array_equal(llama_cpp_permute(w, 1), w)


def test_bfloat16_load(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    f32, bf16 = load_model(path), load_model(path, dtype="bfloat16")
    assert bf16.config.param_dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(bf16)))
    shapes = jax.tree.leaves(nnx.state(load_model(path, dtype="bfloat16", weights=False)))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in shapes)
    assert [(x.shape, x.dtype) for x in shapes] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(bf16))
    ]
    ids = jnp.asarray([[5, 6, 7, 258]])
    a, b = np.asarray(f32(ids)), np.asarray(bf16(ids))
    assert np.abs(a - b).max() / np.abs(a).max() < 0.05


def test_convert_loads_in_transformers(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen2", "Q4_1")
    out = convert_gguf(path, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = load_model(path)
    ids = [3, 100, 258, 267, 40]
    assert relative_error(ours, converted.eval(), ids) < RTOL
    assert relative_error(load_model(out), converted.eval(), ids) < RTOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXT).input_ids == load_tokenizer(path).encode(TEXT).ids
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256 + 11


# ------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", "llama", "Q8_0")


@pytest.mark.parametrize("keep", [0.5, 0.999, 3000, 10])
def test_truncated_file(tmp_path, good, keep):
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(keep * len(data)) if keep < 1 else keep])
    for load in (load_model, load_tokenizer, functools.partial(load_model, weights=False)):
        with pytest.raises(GGUFError, match=r"cut\.gguf: not a readable GGUF file, truncated"):
            load(bad)


def test_bad_magic(tmp_path, good):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"XXXX" + good.read_bytes()[4:])
    with pytest.raises(GGUFError, match=r"magic\.gguf: .*magic"):
        load_model(bad)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "phi.gguf", "llama", "Q8_0", gguf_arch="phi3")
    with pytest.raises(GGUFError, match=r"phi\.gguf: architecture 'phi3' is not supported"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path):
    import gguf

    path = tmp_path / "f64.gguf"
    write_gguf(path, "llama", "F32")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "f64b.gguf"), "llama")
    for key, f in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            _copy_field(writer, key, f)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.ffn_up.weight":
            data = data.astype(np.float64)
        writer.add_tensor(t.name, data)
    for step in ("write_header_to_file", "write_kv_data_to_file", "write_tensors_to_file"):
        getattr(writer, step)()
    writer.close()
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight has unsupported type F64"):
        load_model(tmp_path / "f64b.gguf")


def _copy_field(writer, key, f):
    import gguf

    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_array(key, f.contents())
    else:
        writer.add_key_value(key, f.contents(), kind)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(tokenizer_model="llama"), r"tokenizer kind 'llama' is not supported"),
        (dict(pre="weird"), r"pre-tokenizer 'weird' is not supported"),
    ],
)
def test_unsupported_tokenizer(tmp_path, kw, message):
    path = write_gguf(tmp_path / "tok.gguf", "llama", "Q8_0", **kw)
    with pytest.raises(GGUFError, match=r"tok\.gguf: " + message):
        load_tokenizer(path)
    load_model(path)  # the weights are fine


def test_missing_file(tmp_path):
    for load in (load_model, load_tokenizer):
        with pytest.raises(FileNotFoundError, match=r"nothere\.gguf does not exist"):
            load(tmp_path / "nothere.gguf")


def test_convert_bad_input_writes_nothing(tmp_path, good):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(GGUFError):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_convert(tmp_path, good, capsys, monkeypatch):
    from jax_specdec.cli import main

    monkeypatch.setenv("JAX_SPECDEC_COMPILE_CACHE", "0")  # leave the user's cache alone

    assert main(["convert", str(good), str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "model.safetensors").is_file()
    capsys.readouterr()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:5000])
    for source in (bad, tmp_path / "absent.gguf"):
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", str(source), str(tmp_path / "out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and source.name in err and "Traceback" not in err
        assert not (tmp_path / "out").exists()
