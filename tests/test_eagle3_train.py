"""Training an EAGLE-3 head: its training passes against the loop's cached steps, the
prompts and the target's own continuations it learns from (resumable), training that
raises agreement on the generated positions only, and `train-drafter --kind eagle3`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import make_model, small_corpus

from jax_specdec import autoregressive_generate
from jax_specdec.io.heads import load_head
from jax_specdec.nn import init_cache
from jax_specdec.nn.eagle3 import Eagle3Config, Eagle3Head
from jax_specdec.training.head_data import extract_features, kept_vocabulary
from jax_specdec.training.head_train import HeadTrainConfig, agreement, init_from_target, train_head
from jax_specdec.training.prompts import chat, chat_requests, code_openings, prompts
from jax_specdec.training.self_data import generate_windows

VOCAB, LAYERS = 24, (0, 1, 2)


def tiny_target():
    return make_model(4, vocab=VOCAB, scale=0.5)


def new_head(target, kept=None, seed=0, scale=0.02, **flags):
    tc = target.config
    config = Eagle3Config(
        layer=tc.replace(num_layers=1),
        draft_vocab_size=kept or VOCAB,
        aux_layer_ids=LAYERS,
        has_embed=False,
        **flags,
    )
    return Eagle3Head(config, rngs=nnx.Rngs(seed), init_scale=scale)


# ---------------------------------------------------------------- training passes


@nnx.jit
def _cached_step(head, hidden, tokens, embed, cache):
    logits, out, cache = head.decode(hidden, tokens, cache, embed=embed)
    return logits, out, cache


@nnx.jit(static_argnames="steps")
def _unrolled(head, prev, tokens, embed, steps):
    return head.unrolled(prev, tokens, embed, steps)


@pytest.mark.parametrize(
    "flags",
    [dict(norm_before_residual=True), dict(style="qwen3", norm_output=True, fc_norm=True)],
    ids=["llama", "qwen3_norm_output"],
)
@pytest.mark.slow
def test_training_passes_see_what_the_loop_sees(flags):
    """`Eagle3Head.unrolled` step s + 1 at entry p + s equals the loop's round with
    pending position p: the entries up to p from the target's layers (one cached call),
    then one entry per draft step fed the head's own hidden state of the step before."""
    target = tiny_target()
    head = new_head(target, seed=3, scale=0.5, **flags)
    T, steps, embed = 12, 3, target.embed[...]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, T)))
    _, aux = target(tokens, features=LAYERS)
    prev = jnp.pad(aux[:, :-1], ((0, 0), (1, 0), (0, 0)))
    passes = _unrolled(head, prev, tokens, embed, steps)
    for pending in (0, 4, T - steps):
        cache = init_cache(head.config.layer, batch=1, max_len=T)
        first = (prev[:, : pending + 1], tokens[:, : pending + 1], embed, cache)
        logits, hidden, cache = _cached_step(head, *first)
        for s in range(steps):
            np.testing.assert_allclose(
                np.asarray(passes[s][0])[0, pending + s],
                np.asarray(logits)[0, -1],
                rtol=1e-4,
                atol=1e-4,
                err_msg=f"draft step {s + 1}, pending position {pending}",
            )
            if s + 1 < steps:
                at = pending + s + 1
                step = (hidden[:, -1:], tokens[:, at : at + 1], embed, cache)
                logits, hidden, cache = _cached_step(head, *step)


# ---------------------------------------------------------------- data


def test_prompts_split_the_requests_and_mix_code():
    train, held_out = chat_requests("train"), chat_requests("held_out")
    assert train and held_out and not set(train) & set(held_out)
    sources = ["def a(x):\n    '''doc'''\n    return x\n\n\nclass C:\n    async def b(self):\n"]
    openings = code_openings(sources, lines=2)
    assert openings == ["def a(x):\n    '''doc'''", "async def b(self):\n"]
    chosen = prompts("held_out", sources * 40, count=len(held_out) + 20, code_share=0.25)
    assert len(chosen) == len(held_out) + 20
    code = [p for p in chosen if p.text in code_openings(sources)]
    assert len(code) == round(0.25 * len(chosen))
    chats = [p for p in chosen if p not in code]
    assert {p.text for p in chats} <= {chat(t) for t in held_out}
    assert [p.greedy for p in chats] == [i < len(held_out) for i in range(len(chats))]
    assert [p.greedy for p in code] == [i % 2 == 0 for i in range(len(code))]
    with pytest.raises(ValueError, match="split must be one of"):
        prompts("validation", sources, count=3)


def _tiny_prompts(count=12, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, rng.integers(2, 6)).tolist(), i % 3 != 0) for i in range(count)]


@pytest.mark.slow
def test_continuations_are_the_targets_and_resume(tmp_path):
    """Greedy rows are the target's greedy continuations; sampled rows depend on the
    batch's key only, so a run that lost a part makes the same windows again."""
    target, rows = tiny_target(), _tiny_prompts()
    made = generate_windows(target, rows, 16, tmp_path, batch=5, progress=False)
    assert made.tokens.shape == (12, 16)
    np.testing.assert_array_equal(made.start, [len(ids) for ids, _ in rows])
    budgets = [16 - len(ids) for ids, _ in rows]
    ids_only = [ids for ids, _ in rows]
    alone = autoregressive_generate(
        target, ids_only, key=jax.random.key(1), max_new_tokens=budgets
    )  # greedy: each row's own greedy continuation
    sampled_differ = 0
    for (ids, greedy), window, own in zip(rows, made.tokens, alone.tokens, strict=True):
        np.testing.assert_array_equal(window[: len(ids)], ids)
        same = np.array_equal(window[len(ids) :], np.asarray(own)[: 16 - len(ids)])
        assert same or not greedy
        sampled_differ += not (same or greedy)
    assert sampled_differ >= 3  # of the 4 sampled rows
    parts = sorted((tmp_path / "parts").glob("*.npz"))
    assert len(parts) == 3
    parts[1].unlink()
    again = generate_windows(target, rows, 16, tmp_path, batch=5, progress=False)
    np.testing.assert_array_equal(again.tokens, made.tokens)
    with pytest.raises(ValueError, match="other prompts"):
        generate_windows(target, _tiny_prompts(seed=1), 16, tmp_path, batch=5, progress=False)
    with pytest.raises(ValueError, match="shorter than seq_len"):
        generate_windows(target, rows, 5, tmp_path / "x", progress=False)


def _self_data(target, directory, count=48):
    rows = [(ids, True) for ids, _ in _tiny_prompts(count)]
    made = generate_windows(target, rows, 20, directory / "w", batch=16, progress=False)
    return extract_features(
        target, made.tokens, directory / "f", aux_layers=LAYERS, start=made.start, progress=False
    )


@pytest.mark.slow
def test_agreement_counts_rounds_after_the_prompt_only(tmp_path):
    """Draft step s + 1 at entry i counts when its round's pending position i - s is the
    last prompt token or later (and at least 1)."""
    target = tiny_target()
    data = _self_data(target, tmp_path, count=16)
    assert data.aux.shape == (16, 20, 3 * target.config.d_model)
    head = new_head(target, scale=0.5)
    init_from_target(head, target, np.arange(VOCAB))
    measured = agreement(head, data, target.embed[...], steps=2)
    prev = jnp.pad(jnp.asarray(data.aux[:, :-1], jnp.float32), ((0, 0), (1, 0), (0, 0)))
    passes = _unrolled(head, prev, jnp.asarray(data.tokens), target.embed[...], 2)
    for s, (logits, _) in enumerate(passes):
        hits = np.asarray(jnp.argmax(logits, -1)) == data.greedy
        counted = np.arange(20)[None] >= np.maximum(data.start - 1 + s, s + 1)[:, None]
        assert measured[s] == round(float(hits[counted].mean()), 4)


@pytest.mark.slow
def test_training_raises_agreement(tmp_path):
    target = tiny_target()
    data = _self_data(target, tmp_path)
    head = new_head(target, kept=16)
    init_from_target(head, target, kept_vocabulary(data, 16, VOCAB))
    before = agreement(head, data, target.embed[...], steps=2)
    config = HeadTrainConfig(
        steps=150, learning_rate=3e-3, checkpoint_every=150, eval_every=150, unroll=2
    )
    train_head(head, target, data, data, config, checkpoint_dir=tmp_path / "run", progress=False)
    after = agreement(head, data, target.embed[...], steps=2)
    assert after[0] > before[0] + 0.2 and after[1] > before[1] + 0.2, (before, after)


# ---------------------------------------------------------------- the command


@pytest.mark.slow
def test_cli_trains_an_eagle3_head_on_the_targets_own_text(pair, tmp_path, capsys):
    from jax_specdec.cli import main

    corpus = small_corpus(tmp_path / "corpus", repeat=2)
    out = tmp_path / "head"
    argv = ["train-drafter", "--target", str(pair / "target"), "--kind", "eagle3"]
    argv += ["--aux-layers", "0,1,2", "--data", "self", "--code-share", "1"]
    argv += ["--corpus", str(corpus), "--tokens", "1024", "--validation-tokens", "256"]
    argv += ["--seq-len", "64", "--prompt-len", "48"]
    argv += ["--kept", "64", "--steps", "3", "--eval-every", "3", "--unroll", "2"]
    assert main([*argv, "--out", str(out), "--weights-dtype", "float16"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "eagle3" and summary["aux_layers"] == [0, 1, 2]
    assert summary["steps"] == 3 and summary["train_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["dtype"] == "float16"
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(pair / "target"), "architectures": ["LlamaForCausalLM"]}
    head = load_head(out)
    assert isinstance(head, Eagle3Head) and head.config.aux_layer_ids == LAYERS
    argv = ["generate", "--target", str(pair / "target"), "--draft", str(out), "--json"]
    argv += ["-k", "4"]  # a fixed width: auto's compile and measurement are not checked here
    assert main([*argv, "def f(x):", "--max-new-tokens", "8", "--eos", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generated_tokens"] == 8


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kind", "eagle3", "--feature-weight", "0.1"], "--feature-weight applies"),
        (["--kind", "eagle3", "--init", "x"], "--init applies"),
        (["--aux-layers", "1,2"], "--aux-layers applies"),
        (["--kind", "eagle3", "--aux-layers", "1,b"], "--aux-layers must be"),
        (["--kind", "eagle3", "--aux-layers", "0,9"], "aux layer 9"),
        (["--data", "self", "--temperature", "0"], "temperature must be > 0"),
        (["--data", "self", "--code-share", "1.5"], "code_share must lie"),
    ],
)
def test_bad_flags_are_refused(pair, tmp_path, capsys, flags, message):
    from jax_specdec.cli import main

    argv = ["train-drafter", "--target", str(pair / "target"), "--out", str(tmp_path / "h")]
    with pytest.raises(SystemExit):
        main([*argv, *flags])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "h.work").exists()


def test_the_verifier_is_named_as_vllm_loads_it(tmp_path, monkeypatch):
    from jax_specdec.nn import TransformerConfig
    from jax_specdec.training.head_recipe import verifier_of

    llama = TransformerConfig.tiny(vocab_size=64)
    odd = llama.replace(norm="layer")  # no transformers class: no architectures
    hub = ("HuggingFaceTB/SmolLM2-135M-Instruct", ("LlamaForCausalLM",))
    assert verifier_of("smollm2-135m", llama) == hub  # a zoo name: its Hub id, no download
    gguf = str(tmp_path / "model.gguf")
    assert verifier_of(gguf, llama) == (gguf, ("LlamaForCausalLM",))
    assert verifier_of(gguf, odd) == (gguf, ())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    monkeypatch.chdir(tmp_path)  # a relative path is written absolute
    assert verifier_of("hf", llama) == (str(tmp_path / "hf"), ("MistralForCausalLM",))
