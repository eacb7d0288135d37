"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF, fetched by `jax_specdec.io.zoo` into the
user cache) against transformers' own GGUF loading: logits, tokenizer, greedy output of
autoregressive, n-gram and tree (the shipped head's) speculative decoding, conversion,
load memory."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_specdec.decode import Generator
from jax_specdec.decode.drafters.feature_head import attach_head
from jax_specdec.decode.tree import Tree
from jax_specdec.io import zoo
from jax_specdec.io.hf import eos_token_id, load_model, load_tokenizer
from jax_specdec.sampling import SamplingConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

RTOL = 1e-4
HEAD = pathlib.Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-eagle"
CODE = '''def read_config(path):
    """Read a configuration file and return a dict."""
    with open(path) as f:
        return {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in f)}

class Stack:
    def push(self, x):  # O(1), 2024-05-17
        self.items.append(x)
'''
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong's first words were broadcast to 600 million people. Café, naïve, "
    "日本語 — and emoji 🚀 too!\n\n  Indented\ttabs and   spaces."
)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    CHAT.format("What is the capital of France? Answer in one word."),
    'def read_config(path):\n    """Read a configuration file and return a dict."""\n',
    CHAT.format("Write a haiku about the sea."),
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return zoo.model_path("smollm2-135m", progress=False)
    except zoo.DownloadError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path), load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path):
    kw = dict(gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, **kw
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw)


def relative_error(model, ref_model, ids) -> float:
    a = np.asarray(model(jnp.asarray([ids])))
    with torch.no_grad():
        b = ref_model(torch.tensor([ids])).logits.numpy()
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_config(ours, gguf_path):
    c = ours[0].config
    assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        30,
        576,
        9,
        3,
        49152,
    )
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert eos_token_id(gguf_path) == 2  # <|im_end|>


def test_logits_match_transformers(ours, reference):
    model, tok = ours
    ids = tok.encode(PROMPTS[0] + CODE).ids
    assert relative_error(model, reference[0], ids) < RTOL


@pytest.mark.parametrize("text", [CODE, ENGLISH, PROMPTS[0]], ids=["code", "english", "chat"])
def test_tokenizer_matches_transformers(ours, reference, text):
    ids = ours[1].encode(text).ids
    assert ids == reference[1](text).input_ids
    assert ours[1].decode(ids, skip_special_tokens=False) == text


def reference_greedy(ref_model, prompts, budget, **kw) -> list[list[int]]:
    """transformers' greedy `generate` tokens after each prompt (EOS 2 stops a row)."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            ids_out = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=budget, do_sample=False, eos_token_id=2, **kw
            )
        out.append(ids_out[0, len(ids) :].tolist())
    return out


def greedy_tokens(gen, prompts, budget) -> list[list[int]]:
    out = gen(prompts, key=jax.random.key(0), max_new_tokens=budget)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokens[b, : lengths[b]].tolist() for b in range(len(prompts))]


def test_greedy_matches_transformers_generate(ours, reference):
    """Autoregressive and the shipped head's tree: transformers' greedy tokens; with a
    repetition penalty of 1.3 (prompt and output counted), autoregressive decoding gives
    its `generate(repetition_penalty=1.3)` tokens (speculative decoding with penalties
    equals autoregressive: tests/test_penalties.py)."""
    model, tok = ours
    ref_model = reference[0]
    prompts = [tok.encode(p).ids for p in PROMPTS]
    expected = reference_greedy(ref_model, prompts, 40)
    assert any(len(e) < 40 and e[-1] == 2 for e in expected)  # an EOS stop is covered
    head = attach_head(HEAD, model, tok)
    tree = dict(schedule=4, tree=Tree(8, 4, 2))
    for draft, rounds in ((None, {}), (head, tree)):
        gen = Generator(model, draft, eos_token_id=2, **rounds)
        assert greedy_tokens(gen, prompts, 40) == expected, f"draft={draft} {rounds}"
    penalised = reference_greedy(ref_model, prompts[1:3], 32, repetition_penalty=1.3)
    assert penalised != [e[:32] for e in expected[1:3]], "the penalty changed nothing"
    sampling = SamplingConfig(0.0, repetition_penalty=1.3)
    gen = Generator(model, eos_token_id=2, sampling=sampling)
    assert greedy_tokens(gen, prompts[1:3], 32) == penalised


def test_convert_loads_in_transformers(ours, gguf_path, tmp_path):
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "jax_specdec.cli", "convert", str(gguf_path), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = ours[1].encode(ENGLISH).ids
    assert relative_error(ours[0], converted.eval(), ids) < RTOL
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(CODE).input_ids == ours[1].encode(CODE).ids


PEAK = """
import resource, sys, jax
from flax import nnx
from jax_specdec.io.hf import load_model
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(sys.argv[1])
leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print(grown / sum(x.nbytes for x in leaves))
"""


def test_load_peak_memory(gguf_path):
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(gguf_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    ratio = float(done.stdout.split()[-1])
    assert ratio <= 2.0, f"peak RSS grew by {ratio:.2f}x the dequantized weights"
