"""An EAGLE-3 head drafting inside the compiled loop: the target layers' features it
reads, drafts equal to the head's own predictions, no recompilation or cache copies, the
CLI and bad heads. Its exactness in every round shape (greedy equality, enumerated
sampling, a wrong rule caught, rows independent of the batch) is
tests/test_drafter_contract.py's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    VOCAB,
    cli_refusal,
    copies_outside_entry,
    count_compiles,
    make_eagle3,
    make_model,
    ragged_prompts,
)

from jax_specdec import Generator, speculative_generate
from jax_specdec.decode.drafters.eagle3 import attach_eagle3
from jax_specdec.decode.drafters.feature_head import HeadDrafter
from jax_specdec.io.speculators import save_speculators
from jax_specdec.nn import init_cache
from jax_specdec.nn.eagle3 import Eagle3Head
from jax_specdec.schedules import Custom


@pytest.fixture(scope="module")
def head(target):
    """Reads the target's embedding output, its middle and its last layer's output;
    drafts without token 3, which the target can emit. Small weights: q near uniform
    over the kept tokens, so drafts are often accepted."""
    return make_eagle3(target, kept_ids=[0, 1, 2, 4, 5], scale=0.05, norm_before_residual=True)


# ---------------------------------------------------------------- the features


@pytest.mark.slow
def test_layer_features_are_hugging_faces_hidden_states(tmp_path):
    """Layer id l is Hugging Face's hidden_states[l], the residual stream entering decoder
    layer l (what vLLM and speculators hand an EAGLE-3 head); l = L is the last layer's
    output before the final norm (Hugging Face's hidden_states[L] is after it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jax_specdec.io.hf import save_model

    target = make_model(2, vocab=32, num_layers=3)
    save_model(target, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        hf = reference(torch.tensor(tokens), output_hidden_states=True).hidden_states
    ids = (0, 1, 2, 3)
    logits, ours = target(jnp.asarray(tokens), features=ids)
    _, normed = target(jnp.asarray(tokens), features=True)
    # The decode path (what the loop calls) returns the same.
    cache = init_cache(target.config, batch=1, max_len=16)
    _, _, decoded = target.decode(jnp.asarray(tokens), cache, features=ids)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(ours), rtol=1e-4, atol=1e-5)
    d = target.config.d_model
    assert ours.shape == (1, 8, 4 * d)
    for j, layer in enumerate(ids[:-1]):
        np.testing.assert_allclose(
            np.asarray(ours)[..., j * d : (j + 1) * d], hf[layer].numpy(), rtol=1e-4, atol=1e-5
        )
    last = ours[..., 3 * d :]
    np.testing.assert_allclose(
        np.asarray(target.final_norm(last)), hf[3].numpy(), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(target.final_norm(last)), np.asarray(normed), rtol=1e-5)
    with pytest.raises(ValueError, match=r"layer ids in \[0, 3\]"):
        target(jnp.asarray(tokens), features=(0, 4))


# ---------------------------------------------------------------- drafts


@nnx.jit
def _head_pass(head, hidden, tokens, embed):
    cache = init_cache(head.config.layer, batch=1, max_len=tokens.shape[1])
    logits, out, _ = head.decode(hidden, tokens, cache, embed=embed)
    return logits, out


WIDTH = 40  # the reference pads every sequence to one shape: one compilation


def _reference_rounds(target, head, prompt, new_tokens, gamma, schedule=None):
    """Greedy rounds simulated with full passes: each round's first draft comes from the
    head on the target's true layer features up to the pending token, later ones from
    its own hidden state fed back; round r drafts `schedule(r)` tokens (default γ).
    Returns (rounds, accepted per draft position)."""
    embed, ids = target.embed[...], np.asarray(head.vocab_map[...])
    layers = head.config.aux_layer_ids
    seq = list(prompt) + list(new_tokens)
    length, end = len(prompt) + 1, len(prompt) + len(new_tokens)
    rounds, accepted_at = 0, np.zeros(gamma, int)
    pad = lambda tokens: jnp.asarray([tokens + [0] * (WIDTH - len(tokens))])  # noqa: E731
    while length < end:
        width = gamma if schedule is None else schedule(rounds)
        _, true = target(pad(seq[: length - 1]), features=layers)  # causal: padding after
        # Every entry in the head's width: the fused true features, then its own states.
        prev = np.zeros((1, WIDTH, head.config.d_model), np.float32)
        prev[0, 1:length] = np.asarray(head.fuse(true))[0, : length - 1]
        drafts = seq[:length]
        for _ in range(width):
            logits, hidden = _head_pass(head, jnp.asarray(prev), pad(drafts), embed)
            drafts = drafts + [int(ids[int(np.argmax(np.asarray(logits)[0, len(drafts) - 1]))])]
            prev[0, len(drafts) - 1] = np.asarray(hidden)[0, len(drafts) - 2]
        n = 0
        while n < width and length + n < end and drafts[length + n] == seq[length + n]:
            accepted_at[n] += 1
            n += 1
        rounds, length = rounds + 1, length + n + 1
    return rounds, accepted_at


def skip_then_draft(stats):
    """γ = 0 for six rounds (more than the chunk of γ_max + 1 = 4 waiting features), then
    3 for two rounds, then 0 again."""
    return jnp.where((stats.round % 8 < 6) & (stats.round < 12), 0, 3)


def _skip_rounds(r):
    return 0 if (r % 8 < 6 and r < 12) else 3


@pytest.mark.parametrize("skips", [False, True], ids=["chain", "plain_steps"])
@pytest.mark.slow
def test_drafts_are_the_heads_predictions_from_true_features(skips, monkeypatch):
    """Every draft is the head's prediction from the target's true layer features up to
    the pending token (prefill, verify calls and, with `skips`, plain target steps whose
    features the head absorbs), then from its own hidden states."""
    target = make_model(3, vocab=8, scale=0.6, num_layers=3)
    head = make_eagle3(target, layers=(1, 2, 3), seed=1, scale=0.6, fc_norm=True)
    prompts, gamma = ragged_prompts(6, 8, seed=4), 3
    schedule = Custom(skip_then_draft, max_gamma=gamma) if skips else gamma
    absorbed, absorb = [], HeadDrafter.absorb
    monkeypatch.setattr(HeadDrafter, "absorb", lambda *a: absorbed.append(1) or absorb(*a))
    out = speculative_generate(
        target,
        head,
        prompts,
        key=jax.random.key(0),
        max_new_tokens=22 if skips else 16,
        schedule=schedule,
    )
    total_at = np.zeros(gamma, int)
    for b, prompt in enumerate(prompts):
        rounds, at = _reference_rounds(
            target, head, prompt, np.asarray(out.tokens)[b], gamma, _skip_rounds if skips else None
        )
        assert rounds == int(np.asarray(out.stats.rounds)[b])
        total_at += at
    np.testing.assert_array_equal(np.asarray(out.stats.accepted_at).sum(0), total_at)
    assert total_at[1] > 0, "the test needs second drafts accepted (the head's own states)"
    assert bool(absorbed) == skips


# ---------------------------------------------------------------- programs


@pytest.mark.slow
def test_no_recompilation_and_no_cache_copies(target, head):
    generator = Generator(target, head, schedule=Custom(skip_then_draft, max_gamma=3))
    run = generator.bind([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=8)
    hlo = run.lower().compile().as_text()
    assert "while" in hlo
    for c in (head.config.layer, target.config):
        shape = f"f32[2,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
        assert shape in hlo
        assert copies_outside_entry(hlo, shape) == 0, f"cache of shape {shape} copied in a loop"
    generator([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=8)
    with count_compiles() as compiles:
        generator([[2, 2, 3], [5]], key=jax.random.key(1), max_new_tokens=8)
    assert compiles[0] == 0


# ---------------------------------------------------------------- heads and files


def test_head_for_another_target_is_refused_before_compiling(target):
    with pytest.raises(ValueError, match=r"reads layers \[0, 1, 5\]; the target has 2"):
        Generator(target, make_eagle3(target, layers=(0, 1, 5)))
    wider = make_model(0, d_model=48)
    with pytest.raises(ValueError, match="hidden size 48"):
        Generator(target, make_eagle3(wider))
    bigger = make_model(0, vocab=VOCAB + 2)
    with pytest.raises(ValueError, match="vocabulary is 8"):
        Generator(target, make_eagle3(bigger))
    outside = make_eagle3(target, kept_ids=[0, 1, 2])
    outside.vocab_map.set_value(jnp.asarray([0, 1, 6], jnp.int32))
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        Generator(target, outside)


@pytest.mark.slow
def test_generate_drafts_with_a_speculators_directory(pair, tmp_path, capsys):
    """`generate --draft DIR` with a head in the speculators format: greedy text equals
    the autoregressive text; a head for other layers is refused naming them."""
    from jax_specdec.cli import main
    from jax_specdec.io.hf import load_model

    target = load_model(pair / "target")
    vocab = target.config.vocab_size
    head = make_eagle3(target, kept_ids=np.arange(0, vocab, 3))
    save_speculators(head, tmp_path / "eagle3")
    drafter, attached = attach_eagle3(tmp_path / "eagle3", target)
    assert drafter.feature_layers == (0, 1, 2) and isinstance(attached.head, Eagle3Head)
    argv = ["generate", "--target", str(pair / "target"), "--draft", str(tmp_path / "eagle3")]
    argv += ["def f(x):", "--max-new-tokens", "10", "--compare", "--eos", "none", "--json"]
    argv += ["-k", "4"]  # a fixed width: auto's compile and measurement are not checked here
    assert main(argv) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["same_text_as_autoregressive"] is True
    save_speculators(make_eagle3(target, layers=(0, 1, 3)), tmp_path / "deep")
    argv[4] = str(tmp_path / "deep")
    assert "reads layers [0, 1, 3]; the target has 2" in cli_refusal(argv, capsys)
