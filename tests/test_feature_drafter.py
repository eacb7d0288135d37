"""The feature drafter (a head reading the target's hidden states, truncated vocabulary)
inside the compiled loop: greedy equality, drafts equal to the head's own predictions,
enumerated exactness, keys and batches, no cache copies, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    PROMPTS,
    VOCAB,
    chi_square_pvalue,
    copies_outside_entry,
    count_compiles,
    exact_sequence_probs,
    make_head,
    make_model,
    ragged_prompts,
    sample_sequences,
    wrong_rule_pvalue,
)

from jax_specdec import Generator, SamplingConfig, autoregressive_generate, speculative_generate
from jax_specdec.acceptance import AcceptResult
from jax_specdec.decode.drafters.feature_head import HeadDrafter, attach_head
from jax_specdec.io.heads import tokenizer_sha256
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.sampling import sample_with_uniforms
from jax_specdec.schedules import Confidence, Custom
from jax_specdec.training.corpus import train_tokenizer

GREEDY = SamplingConfig(0.0)


@pytest.fixture(scope="module")
def head(target):
    """Kept vocabulary without token 3, which the target can emit. Small weights: q near
    uniform over the kept tokens, so drafts are often accepted even under top-k/top-p."""
    return make_head(target, kept_ids=[0, 1, 2, 4, 5], scale=0.05)


# ---------------------------------------------------------------- greedy equality


def skip_then_draft(stats):
    """γ = 0 for six rounds (more than the chunk of γ_max + 1 = 4 waiting features), then
    3 for two rounds, then 0 again."""
    return jnp.where((stats.round % 8 < 6) & (stats.round < 12), 0, 3)


@pytest.mark.parametrize("gamma,eos", [(1, None), (2, 3), (4, None), (4, 3), ("skip", 3)])
def test_greedy_equals_autoregressive_on_ragged_prompts(gamma, eos):
    target = make_model(10, vocab=32, scale=0.3)
    head = make_head(target, kept_ids=np.arange(0, 32, 2))
    prompts = ragged_prompts(12, 32, seed=5 if gamma == "skip" else gamma)
    schedule = Custom(skip_then_draft, max_gamma=3) if gamma == "skip" else gamma
    kwargs = dict(max_new_tokens=14, sampling=GREEDY, eos_token_id=eos)
    ar = autoregressive_generate(target, prompts, key=jax.random.key(0), **kwargs)
    spec = speculative_generate(
        target, head, prompts, key=jax.random.key(1), schedule=schedule, **kwargs
    )
    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(ar.lengths))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))


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

SETTINGS = {
    "t1_g1": (SamplingConfig(1.0), 1, None),
    "t0.6_topk4_g2": (SamplingConfig(0.6, top_k=4), 2, None),
    "t1_topp0.8_g4": (SamplingConfig(1.0, top_p=0.8), 4, None),
    "t1_g2_eos": (SamplingConfig(1.0), 2, 2),
    # Round 1 is a plain step (round 0 always goes through the verify call): a row that
    # got one token in round 0 gets its third from a plain step (feature absorbed).
    "t1_skip_once_g2": (
        SamplingConfig(1.0),
        Custom(lambda s: jnp.where(s.round == 1, 0, 2), 2),
        None,
    ),
}


def _check_exact(target, seqs, sampling, eos, name, alpha):
    for which, prompt in enumerate(PROMPTS):
        exact = exact_sequence_probs(target, np.array(prompt), sampling, eos)
        pvalue = chi_square_pvalue(seqs[which::2], exact)
        print(f"\nFEATURE-EXACTNESS {name} prompt{which}: alpha={alpha:.3f} pvalue={pvalue:.3g}")
        assert pvalue > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_samples_follow_the_target(target, head, name):
    sampling, gamma, eos = SETTINGS[name]
    seqs, stats = sample_sequences(target, head, sampling, None, eos, len(name), schedule=gamma)
    assert 0.05 < stats.acceptance_rate < 0.95
    # Token 3 is never drafted, yet the target emits it (through the residual).
    assert any(3 in seq for seq in seqs[:2000])
    _check_exact(target, seqs, sampling, eos, name, stats.acceptance_rate)


@pytest.mark.slow
def test_full_kept_vocabulary_t1_g4_follows_the_target(target):
    sampling = SamplingConfig(1.0)
    full = make_head(target, seed=7)
    seqs, stats = sample_sequences(target, full, sampling, 4, None, seed=3)
    _check_exact(target, seqs, sampling, None, "full_vocab_t1_g4", stats.acceptance_rate)


def wrong_residual(uniforms, draws, draft_tokens, draft_probs, target_probs, num_drafted):
    """Subtracts q only at the drafted token on rejection (not the whole q): not exact."""
    vocab = target_probs.shape[-1]
    at = jnp.arange(draft_tokens.shape[1])
    p_x = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]
    q_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    passed = (uniforms * q_x < p_x) & (at[None] < num_drafted[:, None])
    n = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(n.shape[0])
    p_next = target_probs[rows, n]
    last = jnp.minimum(n, draft_tokens.shape[1] - 1)
    spike = jax.nn.one_hot(draft_tokens[rows, last], vocab) * q_x[rows, last][:, None]
    bonus = (n >= num_drafted)[:, None]
    residual = jnp.maximum(p_next - jnp.where(bonus, 0.0, spike), 0.0)
    return AcceptResult(n, sample_with_uniforms(draws, residual))


@pytest.mark.slow
def test_wrong_residual_fails_the_same_test(target, head):
    sampling, gamma, eos = SETTINGS["t1_g1"]
    seqs, _ = sample_sequences(
        target, head, sampling, gamma, eos, seed=0, _rule=wrong_residual
    )
    assert wrong_rule_pvalue(target, seqs, sampling, eos) < 1e-6


# ---------------------------------------------------------------- keys and batches


def test_same_key_same_output_and_rows_independent_of_batch(target, head):
    prompts = ragged_prompts(6, VOCAB, seed=5)
    keys = jax.random.split(jax.random.key(7), 6)
    kwargs = dict(max_new_tokens=10, num_draft_tokens=3, sampling=SamplingConfig(0.9))
    a = speculative_generate(target, head, prompts, key=keys, **kwargs)
    b = speculative_generate(target, head, prompts, key=keys, **kwargs)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    for row in [0, 4]:
        alone = speculative_generate(
            target, head, [prompts[row]], key=keys[row : row + 1], **kwargs
        )
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(a.tokens)[row])


@pytest.mark.parametrize("schedule", [3, Custom(skip_then_draft, max_gamma=3)])
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


# ---------------------------------------------------------------- slots


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, pytest.param(SamplingConfig(1.0), marks=pytest.mark.slow)],
    ids=["greedy", "t1"],
)
def test_slots_give_the_tokens_a_prompt_gets_alone(target, head, sampling):
    generator = Generator(target, head, schedule=3, sampling=sampling, eos_token_id=5)
    prompts = ragged_prompts(5, VOCAB, seed=3)
    call = dict(key=jax.random.key(4), max_new_tokens=[7, 3, 12, 1, 9])
    alone = generator(prompts, **call)
    for slots in (1, 2):
        got = generator(prompts, num_slots=slots, **call)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(alone.tokens))
        np.testing.assert_array_equal(
            np.asarray(got.stats.accepted_at), np.asarray(alone.stats.accepted_at)
        )
