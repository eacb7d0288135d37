"""The feature drafter (a head reading the target's hidden states, truncated vocabulary)
inside the compiled loop: drafts equal to the head's own predictions, the training
passes, a head keeping the whole vocabulary sampling exactly, no recompilation or cache
copies, bad input. Its exactness in every round shape (greedy equality, enumerated
sampling, a wrong rule caught, rows independent of the batch) is
tests/test_drafter_contract.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    VOCAB,
    assert_follows_target,
    copies_outside_entry,
    count_compiles,
    make_head,
    make_model,
    ragged_prompts,
    sample_sequences,
)

from jax_specdec import Generator, SamplingConfig, speculative_generate
from jax_specdec.decode.drafters.feature_head import HeadDrafter, attach_head
from jax_specdec.io.heads import tokenizer_sha256
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.schedules import Confidence, Custom
from jax_specdec.training.corpus import train_tokenizer


@pytest.fixture(scope="module")
def head(target):
    """Kept vocabulary without token 3, which the target can emit. Small weights: q near
    uniform over the kept tokens, so drafts are often accepted even under top-k/top-p."""
    return make_head(target, kept_ids=[0, 1, 2, 4, 5], scale=0.05)


# ---------------------------------------------------------------- drafts


def skip_then_draft(stats):
    """γ = 0 for six rounds (more than the chunk of γ_max + 1 = 4 waiting features), then
    3 for two rounds, then 0 again."""
    return jnp.where((stats.round % 8 < 6) & (stats.round < 12), 0, 3)


WIDTH = 40  # the reference pads every sequence to one shape: one compilation


@nnx.jit
def _head_pass(head, prev, tokens, embed):
    return head(prev, tokens, embed)


def _reference_rounds(target, head, prompt, new_tokens, gamma, schedule=None):
    """Greedy rounds simulated with full forward passes: each round's drafts come from
    the head on the target's true features up to the pending token, then on its own
    predictions; round r drafts `schedule(r)` tokens (default γ). Returns (rounds,
    accepted per draft position)."""
    embed, ids = target.embed[...], np.asarray(head.vocab_map[...])
    seq = list(prompt) + list(new_tokens)
    length, end = len(prompt) + 1, len(prompt) + len(new_tokens)
    rounds, accepted_at = 0, np.zeros(gamma, int)
    pad = lambda tokens: jnp.asarray([tokens + [0] * (WIDTH - len(tokens))])  # noqa: E731
    while length < end:
        width = gamma if schedule is None else schedule(rounds)
        _, true = target(pad(seq[: length - 1]), features=True)  # causal: padding is after
        prev = np.zeros((1, WIDTH, true.shape[-1]), np.float32)
        prev[0, 1:length] = np.asarray(true)[0, : length - 1]
        drafts = seq[:length]
        for _ in range(width):
            logits, predicted = _head_pass(head, jnp.asarray(prev), pad(drafts), embed)
            drafts = drafts + [int(ids[int(np.argmax(np.asarray(logits)[0, len(drafts) - 1]))])]
            prev[0, len(drafts) - 1] = np.asarray(predicted)[0, len(drafts) - 2]
        n = 0
        while n < width and length + n < end and drafts[length + n] == seq[length + n]:
            accepted_at[n] += 1
            n += 1
        rounds, length = rounds + 1, length + n + 1
    return rounds, accepted_at


def _skip_rounds(r):
    """`skip_then_draft` for the reference: γ of round r."""
    return 0 if (r % 8 < 6 and r < 12) else 3


@pytest.mark.parametrize("skips", [False, True])
@pytest.mark.slow
def test_drafts_are_the_heads_predictions_from_true_features(skips, monkeypatch):
    """Every draft is the head's prediction from the target's true features up to the
    pending token. With `skips`, batch-wide γ = 0 rounds run as plain target steps whose
    features the head absorbs (`HeadDrafter.absorb`), more of them than its chunk
    holds, and the drafts after them must still come from the true features."""
    # A target that repeats itself and a head that often agrees with it.
    target = make_model(3, vocab=8, scale=0.6)
    head = make_head(target, seed=2, scale=0.6)
    prompts, gamma = ragged_prompts(6, 8, seed=4), 3
    schedule = Custom(skip_then_draft, max_gamma=gamma) if skips else gamma
    absorbed, absorb = [], HeadDrafter.absorb
    monkeypatch.setattr(
        HeadDrafter, "absorb", lambda *a: absorbed.append(1) or absorb(*a)
    )  # counts traces of the plain steps' absorb (a round at width 0 would not call it)
    jax.clear_caches()
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
    assert total_at[1] > 0, "the test needs second drafts accepted (predicted features)"
    assert int(out.stats.gamma_rounds[0]) >= (10 if skips else 0)
    assert bool(absorbed) == skips


def test_training_passes_see_what_the_loop_sees(target):
    """`FeatureHead.unrolled` step s + 1 at entry p + s equals the reference of a round
    with pending position p: true features up to p, the head's own predictions after."""
    head = make_head(target, seed=3, scale=0.5, layers=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 14)))
    _, true = target(tokens, features=True)
    steps, embed = 3, target.embed[...]
    first = jnp.pad(true[:, :-1], ((0, 0), (1, 0), (0, 0)))
    passes = head.unrolled(first, tokens, embed, steps)
    for pending in range(tokens.shape[1] - steps + 1):
        prev = np.zeros(first.shape, np.float32)
        prev[0, 1 : pending + 1] = np.asarray(true)[0, :pending]
        for s in range(steps):
            logits, predicted = _head_pass(head, jnp.asarray(prev), tokens, embed)
            np.testing.assert_allclose(
                np.asarray(passes[s][0])[0, pending + s],
                np.asarray(logits)[0, pending + s],
                rtol=1e-4,
                atol=1e-4,
                err_msg=f"draft step {s + 1}, pending position {pending}",
            )
            if s + 1 < steps:
                prev[0, pending + s + 1] = np.asarray(predicted)[0, pending + s]


# ---------------------------------------------------------------- exactness


@pytest.mark.slow
def test_full_kept_vocabulary_t1_g4_follows_the_target(target):
    sampling = SamplingConfig(1.0)
    full = make_head(target, seed=7)
    seqs, _ = sample_sequences(target, full, sampling, 4, None, seed=3)
    assert_follows_target(target, seqs, sampling, None, "full_vocab_t1_g4")


@pytest.mark.parametrize("schedule", [3, Custom(skip_then_draft, max_gamma=3)])
@pytest.mark.slow
def test_no_recompilation_and_no_cache_copies(target, head, schedule):
    generator = Generator(target, head, schedule=schedule)
    run = generator.bind([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=8)
    hlo = run.lower().compile().as_text()
    assert "while" in hlo
    c = head.config.layer
    shape = f"f32[2,{c.num_kv_heads},{run.cache_len},{c.head_dim}]"
    assert shape in hlo
    assert copies_outside_entry(hlo, shape) == 0, f"cache of shape {shape} copied in a loop"
    generator([[1, 2, 3], [4]], key=jax.random.key(0), max_new_tokens=8)
    with count_compiles() as compiles:
        generator([[2, 2, 3], [5]], key=jax.random.key(1), max_new_tokens=8)
    assert compiles[0] == 0


# ---------------------------------------------------------------- bad input


def test_head_for_another_target_is_refused_before_compiling(target):
    wider = make_model(0, d_model=48, num_heads=4, num_kv_heads=2, head_dim=12)
    with pytest.raises(ValueError, match=r"features of size 48; the target's is 32"):
        speculative_generate(
            target, make_head(wider), [[1]], key=jax.random.key(0), max_new_tokens=3
        )
    bigger = make_model(0, vocab=VOCAB + 2)
    with pytest.raises(ValueError, match=r"vocabulary 8; the target's is 6"):
        speculative_generate(
            target, make_head(bigger), [[1]], key=jax.random.key(0), max_new_tokens=3
        )
    outside = make_head(target, kept_ids=[0, 1, 6])
    with pytest.raises(ValueError, match=r"vocab_map ids in \[0, 6\], outside"):
        speculative_generate(target, outside, [[1]], key=jax.random.key(0), max_new_tokens=3)
    with pytest.raises(ValueError, match="Confidence"):
        Generator(target, make_head(target), schedule=Confidence(0.5, 2))


def test_tokenizer_mismatch_is_refused(target):
    mine = train_tokenizer(["def f(x): return x + 1\n"] * 3, 280)
    other = train_tokenizer(["class A: pass\n"] * 3, 270)
    layer = target.config.replace(num_layers=1)
    config = FeatureHeadConfig(layer, VOCAB, "tiny", tokenizer_sha256(mine))
    head = FeatureHead(config, rngs=nnx.Rngs(0))
    attach_head(head, target, mine)
    with pytest.raises(ValueError, match="another tokenizer"):
        attach_head(head, target, other)
