"""The drafter contract: every drafter, in every round shape it takes, (1) decodes
greedily the autoregressive tokens, (2) samples the target's distribution (a chi-square
test of 10^5 sampled sequences against the exactly enumerated sequence probabilities,
fixed keys), (3) has a wrong acceptance rule caught by that test (p < 1e-6), and (4) gives
a row the tokens it gets alone, whatever its batch neighbours.

Drafters: the tiny draft model, its early exit (`Confidence`), the n-gram proposer, a
feature head, an EAGLE-3 head, and a user's own drafter (`RepeatLast`, written here
against the protocol alone). Round shapes: chains (token-by-token acceptance), block
verification, trees, slots (rows refilled inside the program), and γ = 0 steps (plain
target steps between rounds). Drafter-specific tests stay in the drafters' files.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    NUM_SAMPLES,
    PROMPTS,
    VOCAB,
    chi_square_pvalue,
    exact_sequence_probs,
    make_eagle3,
    make_head,
    ragged_prompts,
)

from jax_specdec import Generator, NGram, SamplingConfig
from jax_specdec.acceptance import AcceptResult, accept_with_noise
from jax_specdec.decode.drafters.base import Proposal
from jax_specdec.decode.tree import Tree, target_tokens, walk
from jax_specdec.decode.tree_accept import accept_rsd
from jax_specdec.sampling import RowSampling, SamplingPlan, sample_with_uniforms
from jax_specdec.schedules import Confidence, Custom

GREEDY, T1 = SamplingConfig(0.0), SamplingConfig(1.0)


@dataclasses.dataclass(frozen=True)
class RepeatLast:
    """A user's own drafter: proposes the row's last token w times. Deterministic (q is
    None: one-hot on the token), stateless (no cache), written against the drafter
    protocol alone and passed to `Generator` as it is."""

    def init(self, model, prompts, prompt_lengths, config):
        return None

    def prepare(self, model, cache, inputs, config):
        last = jnp.take_along_axis(inputs.tokens, inputs.lengths[:, None] - 1, axis=1)
        return None, last, None  # no cap: as many as the schedule asks

    def propose(self, model, cache, inputs, prepared, width, config):
        tokens = jnp.broadcast_to(prepared, (prepared.shape[0], width)).astype(jnp.int32)
        return Proposal(tokens, None, jnp.zeros(inputs.lengths.shape, bool))

    def commit(self, cache, prepared, entries, before, after, width, config):
        return None

    def load(self, model, cache, slot, prompt, prompt_length, config):
        return None


# ---------------------------------------------------------------- the matrix

SHAPES = {
    "draft": ("chain", "block", "slots", "skip"),
    "early_exit": ("chain", "block", "slots"),  # Confidence sets γ: no γ = 0 schedule
    "ngram": ("chain", "block", "tree", "slots", "skip"),
    "feature": ("chain", "block", "tree", "slots", "skip"),
    "eagle3": ("chain", "block", "tree", "slots", "skip"),
    "repeat": ("chain", "block", "slots", "skip"),
}
CASES = [(d, s) for d, shapes in SHAPES.items() for s in shapes]
TREES = {"ngram": Tree(6, 3), "feature": Tree(6, 3, 2), "eagle3": Tree(6, 3, 2)}
# Early exit: a row stops drafting once the draft's top q is below it (at T = 1 the small
# draft then drafts 1 to 4 tokens a round; at 0.5 it would draft only 1).
THRESHOLD = 0.3


def skip_then_draft(stats):
    """γ = 3 for two rounds, 0 for the next six (more than the chunk of γ_max + 1 = 4
    features a head keeps waiting; a draft model's cache lags by six and catches up), then
    3 again."""
    return jnp.where((stats.round >= 2) & (stats.round < 8), 0, 3)


def skip_second(stats):
    """Round 1 is a plain target step (round 0 always drafts): a row that got one token
    in round 0 gets its third from a plain step (a head absorbs its feature)."""
    return jnp.where(stats.round == 1, 0, 2)


def skip_first(stats):
    """γ = 0 in the first round, then 2: the first draft runs after a catch-up from an
    empty draft cache, within the exactness test's three tokens."""
    return jnp.where(stats.round == 0, 0, 2)


def generator(models, drafter, shape, *, gamma=3, skip=skip_then_draft, tree=None, **settings):
    """The Generator of `drafter` in round shape `shape` (slots are a call's `num_slots`);
    `settings` go to the Generator (sampling, eos_token_id, _rule)."""
    draft = {"ngram": NGram(), "repeat": RepeatLast()}.get(drafter) or models[drafter]
    if shape == "skip":
        schedule = Custom(skip, max_gamma=gamma if skip is skip_then_draft else 2)
    elif drafter == "early_exit":
        schedule = Confidence(THRESHOLD, max_gamma=gamma)
    else:
        schedule = gamma
    if shape == "block":
        settings["acceptance"] = "block"
    if shape == "tree":
        settings["tree"] = tree or TREES[drafter]
    return Generator(models["target"], draft, schedule=schedule, **settings)


@pytest.fixture(scope="module")
def small(target, draft):
    """The enumerated target (vocabulary 6), its draft model, and heads whose kept
    vocabulary leaves out token 3, which the target emits (the residual must supply it);
    small head weights: q near uniform over the kept tokens."""
    kept = [0, 1, 2, 4, 5]
    feature = make_head(target, kept_ids=kept, scale=0.05)
    eagle3 = make_eagle3(target, kept_ids=kept, scale=0.05, norm_before_residual=True)
    return dict(target=target, draft=draft, early_exit=draft, feature=feature, eagle3=eagle3)


def ids(case):
    return "-".join(str(part) for part in case if part is not None)


# ---------------------------------------------------------------- greedy equality


# Variants beyond one case (γ 3, EOS 3) per drafter and shape.
GREEDY_VARIANTS = {
    ("draft", "chain"): [
        *(dict(gamma=g, eos=e) for g in (1, 2, 3, 5) for e in (None, 3)),
        dict(gamma=3, eos=(3, 5)),  # two stop ids: the first emitted ends the row
    ],
    ("draft", "skip"): [dict(), dict(skip=skip_first)],
    ("feature", "chain"): [dict(gamma=g, eos=e) for g, e in ((1, None), (2, 3), (4, None), (4, 3))],
    ("feature", "tree"): [dict(tree=Tree(8, 3, 3), eos=2), dict(tree=Tree(9, 3, 2, lookup=5))],
    ("ngram", "tree"): [dict(gamma=4, tree=Tree(n, 4)) for n in (4, 9)],
}


def _variant_id(opts):
    parts = [f"g{opts['gamma']}" if "gamma" in opts else None]
    eos = opts.get("eos")
    parts.append(f"eos{'_'.join(map(str, np.atleast_1d(eos)))}" if eos else None)
    tree = opts.get("tree")
    parts.append(
        f"n{tree.nodes}" + (f"_lookup{tree.lookup}" if tree.lookup else "") if tree else None
    )
    parts.append(opts["skip"].__name__ if "skip" in opts else None)
    return "_".join(p for p in parts if p) or None


# The quick loop (`-m "not slow"`) runs a greedy case of each drafter and of each round
# shape, and one row case; the full suite runs every case.
QUICK_GREEDY = {
    ("draft", "chain", "g3_eos3"),
    ("early_exit", "chain", None),
    ("ngram", "chain", None),
    ("feature", "chain", "g2_eos3"),
    ("eagle3", "chain", None),
    ("repeat", "chain", None),
    ("ngram", "block", None),
    ("ngram", "tree", "g4_n4"),
    ("ngram", "slots", None),
    ("feature", "skip", None),
}
QUICK_ROWS = {("repeat", "chain")}


def _params(cases, quick):
    """pytest params of `cases`, marked slow unless their first three parts are `quick`."""
    return [
        pytest.param(*c, id=ids(c[:3]), marks=() if c[:3] in quick else pytest.mark.slow)
        for c in cases
    ]


GREEDY_CASES = [
    (d, s, _variant_id(v), v) for d, s in CASES for v in GREEDY_VARIANTS.get((d, s), [dict()])
]
assert QUICK_GREEDY <= {c[:3] for c in GREEDY_CASES}
# Repetitive prompts, so that n-gram lookup finds matches; ragged budgets, so that slots
# are refilled at different rounds.
GREEDY_PROMPTS = [(p * 3)[:12] for p in ragged_prompts(12, VOCAB, seed=4, max_len=6)]
BUDGETS = [16, 4, 12, 9, 16, 2, 14, 6, 11, 16, 7, 13]


def _check_stats(s):
    """A round's counts add up: one target call per round after the prefill."""
    assert int(np.sum(s.gamma_rounds)) == int(s.target_calls) - 1
    assert int(np.sum(s.drafted_at)) == int(np.sum(s.drafted))
    assert int(np.sum(s.accepted_at)) == int(np.sum(s.accepted))
    assert int(np.sum(s.rejected_at)) == int(np.sum(s.rejected))
    assert np.all(np.asarray(s.accepted_at + s.rejected_at) <= np.asarray(s.drafted_at))


class TestGreedy:
    """Greedy speculative decoding emits the autoregressive tokens."""

    @pytest.mark.parametrize("drafter,shape,variant,opts", _params(GREEDY_CASES, QUICK_GREEDY))
    def test_tokens_are_the_autoregressive_tokens(self, small, drafter, shape, variant, opts):
        """Token for token (and the same lengths) the autoregressive decoding of the target;
        through slots, also the acceptance counts of the rows decoded without slots."""
        opts = dict(opts)
        eos = opts.pop("eos", 3)
        call = dict(key=jax.random.key(0), max_new_tokens=BUDGETS)
        ar = Generator(small["target"], eos_token_id=eos)(GREEDY_PROMPTS, **call)
        ar_tokens, ar_lengths = np.asarray(ar.tokens), np.asarray(ar.lengths)
        if eos is not None:  # EOS stops some rows early; it is kept, padding follows
            stops = set(np.atleast_1d(eos).tolist())
            assert (ar_lengths < BUDGETS).any(), "the EOS case should stop some rows early"
            for row, n, budget in zip(ar_tokens, ar_lengths, BUDGETS, strict=True):
                assert n == budget or row[n - 1] in stops
                assert not stops & set(row[: n - 1].tolist())
                assert (row[n:] == 0).all()
        models = [small]
        if (drafter, shape) == ("draft", "chain"):  # the target as its own draft, too
            models.append(dict(small, draft=small["target"]))
        for m in models:
            gen = generator(m, drafter, shape, eos_token_id=eos, **opts)
            spec = gen(GREEDY_PROMPTS, key=jax.random.key(1), max_new_tokens=BUDGETS)
            np.testing.assert_array_equal(np.asarray(spec.lengths), ar_lengths)
            np.testing.assert_array_equal(np.asarray(spec.tokens), ar_tokens)
            assert int(spec.stats.accepted.sum()) > 0, "no draft was accepted: a vacuous test"
            if shape != "tree":
                _check_stats(spec.stats)
            if shape == "slots":
                for slots in (1, 2):
                    got = gen(
                        GREEDY_PROMPTS,
                        key=jax.random.key(1),
                        max_new_tokens=BUDGETS,
                        num_slots=slots,
                    )
                    np.testing.assert_array_equal(np.asarray(got.tokens), ar_tokens)
                    np.testing.assert_array_equal(np.asarray(got.lengths), ar_lengths)
                    np.testing.assert_array_equal(
                        np.asarray(got.stats.accepted_at), np.asarray(spec.stats.accepted_at)
                    )


# ---------------------------------------------------------------- exactness


T07_TOPP = SamplingConfig(0.7, top_p=0.9)
REP = SamplingConfig(1.0, repetition_penalty=1.5)
PRES_FREQ = SamplingConfig(0.7, presence_penalty=0.8, frequency_penalty=0.5, top_p=0.9)
BIAS = SamplingConfig(1.0, logit_bias={3: 1.5, 0: -2.0})
FREQ = SamplingConfig(1.0, frequency_penalty=1.0)
REP_PRES = SamplingConfig(1.0, repetition_penalty=1.5, presence_penalty=0.5)
FREQ_REP = SamplingConfig(0.7, frequency_penalty=1.0, repetition_penalty=1.3)
PRES_BIAS = SamplingConfig(1.0, presence_penalty=1.0, logit_bias={1: 2.0})
# Each case: (drafter, shape, name, options): the sampling (a tuple: settings mixed in one
# program, row pair k taking setting k mod n), γ, EOS, the seed of the key, a schedule's
# skip function or a tree. Every (drafter, shape) has a T = 1 case; the first is the one
# its wrong rule is run with.
CHI2 = [
    ("draft", "chain", "t1_g1", dict(gamma=1)),
    ("draft", "chain", "t0.6_g2", dict(sampling=SamplingConfig(0.6), gamma=2)),
    ("draft", "chain", "t1_topk3_g4", dict(sampling=SamplingConfig(1.0, top_k=3), gamma=4)),
    ("draft", "chain", "t1_topp0.8_g2", dict(sampling=SamplingConfig(1.0, top_p=0.8), gamma=2)),
    ("draft", "chain", "t0.8_minp0.2_g3", dict(sampling=SamplingConfig(0.8, min_p=0.2), gamma=3)),
    (
        "draft",
        "chain",
        "t0.6_topk4_topp0.9_g4_eos",
        dict(sampling=SamplingConfig(0.6, top_k=4, top_p=0.9), gamma=4, eos=2),
    ),
    ("draft", "chain", "t1_g2_eos", dict(gamma=2, eos=2)),
    ("draft", "chain", "t1_g2_two_eos", dict(gamma=2, eos=(2, 4), seed=21)),
    ("draft", "block", "t1_g3", dict(gamma=3)),
    ("draft", "block", "t0.7_topp0.9_g2_eos", dict(sampling=T07_TOPP, gamma=2, eos=2)),
    ("draft", "slots", "t1", dict(gamma=2, eos=2, seed=11)),
    (
        "draft",
        "slots",
        "topp",
        dict(sampling=SamplingConfig(1.0, top_p=0.8), gamma=2, eos=2, seed=11),
    ),
    ("draft", "skip", "t1_skip_second", dict(skip=skip_second)),
    ("draft", "skip", "t1_skip_first", dict(skip=skip_first, seed=16)),
    ("early_exit", "chain", "t1_g4", dict(gamma=4, seed=10)),
    ("early_exit", "block", "t1_g3", dict(gamma=3)),
    ("early_exit", "slots", "t1", dict(gamma=2, eos=2)),
    ("ngram", "chain", "t1_g3_eos", dict(gamma=3, eos=2, seed=14)),
    ("ngram", "block", "t1_g3", dict(gamma=3)),
    ("ngram", "tree", "t1", dict(gamma=3)),
    ("ngram", "tree", "t1_topk4", dict(sampling=SamplingConfig(1.0, top_k=4), gamma=3, seed=11)),
    ("ngram", "slots", "t1", dict(gamma=2, eos=2)),
    ("ngram", "skip", "t1_skip_second", dict(skip=skip_second)),
    ("feature", "chain", "t1_g1", dict(gamma=1)),
    ("feature", "chain", "t0.6_topk4_g2", dict(sampling=SamplingConfig(0.6, top_k=4), gamma=2)),
    ("feature", "chain", "t1_topp0.8_g4", dict(sampling=SamplingConfig(1.0, top_p=0.8), gamma=4)),
    ("feature", "chain", "t1_g2_eos", dict(gamma=2, eos=2)),
    ("feature", "block", "t1_g3", dict(gamma=3)),
    ("feature", "tree", "t1", dict(gamma=3, seed=5)),
    ("feature", "tree", "t1_minp0.15", dict(sampling=SamplingConfig(1.0, min_p=0.15), gamma=3)),
    ("feature", "tree", "t1_lookup", dict(gamma=3, tree=Tree(7, 3, 2, lookup=4), seed=7)),
    # top-k below the branch: the children past q's support are not drawable
    (
        "feature",
        "tree",
        "t1_topk2_branch3",
        dict(sampling=SamplingConfig(1.0, top_k=2), gamma=2, tree=Tree(6, 2, 3, sampled=True)),
    ),
    ("feature", "slots", "t1", dict(gamma=2, eos=2)),
    ("feature", "skip", "t1_skip_once_g2", dict(skip=skip_second)),
    ("eagle3", "chain", "t1_g2", dict(gamma=2)),
    ("eagle3", "block", "t1_g3", dict(gamma=3)),
    ("eagle3", "tree", "t1", dict(gamma=2, tree=Tree(4, 2, 2, sampled=True), seed=11)),
    ("eagle3", "slots", "t1", dict(gamma=2, eos=2)),
    (
        "eagle3",
        "skip",
        "t0.7_t1_topp0.8_mixed",
        dict(
            sampling=(SamplingConfig(0.7), T1, SamplingConfig(1.0, top_p=0.8)),
            skip=skip_second,
            seed=11,
        ),
    ),
    ("repeat", "chain", "t1_g2", dict(gamma=2)),
    ("repeat", "block", "t1_g3", dict(gamma=3)),
    ("repeat", "slots", "t1", dict(gamma=2, eos=2)),
    ("repeat", "skip", "t1_skip_second", dict(skip=skip_second)),
    # Logit bias and penalties: a drafted position counts the drafts before it.
    ("draft", "chain", "t1_rep1.5_g3", dict(sampling=REP, gamma=3)),
    ("draft", "chain", "t0.7_pres_freq_topp0.9_g3", dict(sampling=PRES_FREQ, gamma=3, seed=3)),
    ("draft", "chain", "t1_bias_g2", dict(sampling=BIAS, gamma=2)),
    ("draft", "block", "t1_freq1_g3", dict(sampling=FREQ, gamma=3)),
    ("draft", "slots", "t1_rep_pres", dict(sampling=REP_PRES, gamma=2, eos=2, seed=12)),
    (
        "early_exit",
        "chain",
        "t0.7_rep1.5",
        dict(sampling=SamplingConfig(0.7, repetition_penalty=1.5), gamma=3),
    ),
    (
        "ngram",
        "tree",
        "t1_freq2",
        dict(sampling=SamplingConfig(1.0, frequency_penalty=2.0), gamma=3),
    ),
    ("feature", "tree", "t0.7_freq_rep", dict(sampling=FREQ_REP, gamma=3, seed=4)),
    ("eagle3", "chain", "t1_pres1_bias", dict(sampling=PRES_BIAS, gamma=3)),
    (
        "repeat",
        "skip",
        "mixed_penalties",
        dict(
            sampling=(SamplingConfig(0.7, repetition_penalty=1.4), T1, PRES_BIAS), skip=skip_second
        ),
    ),
]
assert {(d, s) for d, s, *_ in CHI2} == set(CASES)
SLOT_SAMPLES = 20_000  # through SLOT_SAMPLES * 2 / 5 slots: each takes two or three prompts


def _settings(opts):
    sampling = opts.get("sampling", T1)
    return sampling if isinstance(sampling, tuple) else (sampling,)


def _program(drafter, shape, opts):
    """What a case's program depends on besides its rows' sampling settings (dynamic) and
    seed: drafter, round shape, γ, EOS, schedule, tree, and the number of settings (rows)."""
    rest = sorted((k, v) for k, v in opts.items() if k not in ("sampling", "seed"))
    return drafter, shape, tuple(rest), len(_settings(opts))


# One plan per program: the cases that differ only by their sampling settings (and seed)
# run their own call, each row sampled by its own setting, in ONE compiled program, under
# the plan that covers them all (11 programs fewer than a plan per case).
_GROUPS: dict = {}
for _d, _s, _name, _opts in CHI2:
    _GROUPS.setdefault(_program(_d, _s, _opts), []).extend(_settings(_opts))
PLANS = {key: SamplingPlan.of(settings) for key, settings in _GROUPS.items()}


def sample(models, drafter, shape, opts, seed=None, plan=None, **settings):
    """The sampled sequences of `opts`' setting(s) (a list per setting), and the stats.
    NUM_SAMPLES rows per setting (SLOT_SAMPLES through slots) alternating between the
    two PROMPTS, three tokens each; under `plan` (a `SamplingPlan`), or the settings' own."""
    opts = dict(opts)
    mixed = _settings(opts)
    opts.pop("sampling", None)
    eos, own_seed = opts.pop("eos", None), opts.pop("seed", None)
    seed = own_seed if seed is None else seed
    n = len(mixed)
    rows = (SLOT_SAMPLES if shape == "slots" else NUM_SAMPLES) * n
    gen = generator(models, drafter, shape, eos_token_id=eos, **opts, **settings)
    out = gen(
        [PROMPTS[b % 2] for b in range(rows)],
        key=jax.random.key(seed),
        max_new_tokens=3,
        sampling=RowSampling.of([mixed[(b // 2) % n] for b in range(rows)], plan),
        num_slots=rows * 2 // 5 if shape == "slots" else None,
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    seqs = [tuple(tokens[b, : lengths[b]].tolist()) for b in range(rows)]
    return [[s for b, s in enumerate(seqs) if (b // 2) % n == k] for k in range(n)], out.stats


def pvalues(target, seqs, sampling, eos):
    """The chi-square p-value of each of PROMPTS' rows (alternating in `seqs`)."""
    result = []
    for which, prompt in enumerate(PROMPTS):
        exact = exact_sequence_probs(target, np.array(prompt), sampling, eos)
        assert abs(sum(exact.values()) - 1) < 1e-5
        result.append(chi_square_pvalue(seqs[which::2], exact))
    return result


class TestSampling:
    """Sampled sequences follow the target's enumerated distribution."""

    @pytest.mark.slow
    @pytest.mark.parametrize("drafter,shape,name,opts", CHI2, ids=[ids(c[:3]) for c in CHI2])
    def test_samples_follow_the_target(self, small, drafter, shape, name, opts):
        seed = opts.get("seed", len(name))
        plan = PLANS[_program(drafter, shape, opts)]
        seqs, stats = sample(small, drafter, shape, opts, seed=seed, plan=plan)
        assert 0.05 < stats.acceptance_rate < 0.95, "drafts should be neither useless nor exact"
        if shape == "slots":
            assert stats.occupancy < 1.0 and int(stats.target_calls) > SLOT_SAMPLES  # refilled
        if shape == "skip":
            assert int(stats.gamma_rounds[0]) > 0  # plain target steps ran
        if drafter in ("feature", "eagle3"):  # never drafted, emitted through the residual
            assert any(3 in seq for seq in seqs[0][:2000])
            assert not np.asarray(stats.nonfinite).any()  # the kept vocabulary's -inf is no NaN
        sampling = opts.get("sampling", T1)
        for setting, mine in zip(
            sampling if isinstance(sampling, tuple) else (sampling,), seqs, strict=True
        ):
            p = pvalues(small["target"], mine, setting, opts.get("eos"))
            print(
                f"\nEXACTNESS {drafter} {shape} {name} {setting}: alpha="
                f"{stats.acceptance_rate:.3f} chi2_pvalues={p[0]:.3g} {p[1]:.3g}"
            )
            assert min(p) > 1e-3, f"{setting}: p = {p}"


# ---------------------------------------------------------------- wrong rules


def resample_from_p(uniforms, draws, draft_tokens, draft_probs, target_probs, num_drafted):
    """A wrong chain rule: a rejection resampled from plain p instead of the residual."""

    def row(u, x, q, p, k):
        at = jnp.arange(x.size)
        passed = (u * q < p[at, x]) & (at < k)
        return jnp.sum(jnp.cumprod(passed.astype(jnp.int32)))

    q_x = _q_at(draft_tokens, draft_probs)
    n = jax.vmap(row)(uniforms, draft_tokens, q_x, target_probs, num_drafted)
    p_next = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]
    return AcceptResult(n, sample_with_uniforms(draws, p_next))


def residual_at_x(uniforms, draws, draft_tokens, draft_probs, target_probs, num_drafted):
    """A wrong chain rule for a drafter with q: on rejection, q subtracted from p only at
    the rejected token (not the whole q). For a one-hot q that is the residual, so this
    rule is wrong only where q is not one-hot."""
    vocab = target_probs.shape[-1]
    at = jnp.arange(draft_tokens.shape[1])
    p_x = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]
    q_x = _q_at(draft_tokens, draft_probs)
    passed = (uniforms * q_x < p_x) & (at[None] < num_drafted[:, None])
    n = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(n.shape[0])
    p_next = target_probs[rows, n]
    last = jnp.minimum(n, draft_tokens.shape[1] - 1)
    spike = jax.nn.one_hot(draft_tokens[rows, last], vocab) * q_x[rows, last][:, None]
    bonus = (n >= num_drafted)[:, None]
    residual = jnp.maximum(p_next - jnp.where(bonus, 0.0, spike), 0.0)
    return AcceptResult(n, sample_with_uniforms(draws, residual))


def unnormalised_weights(uniforms, draws, draft_tokens, draft_probs, target_probs, num_drafted):
    """A wrong block rule: h_i = w_i for every i (the residual's mass ignored)."""
    p_x = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]
    q_x = _q_at(draft_tokens, draft_probs)
    w = jnp.minimum(jnp.cumprod(p_x / q_x, axis=1), 1.0)  # no running min: also wrong
    at = jnp.arange(1, draft_tokens.shape[1] + 1)[None]
    passed = (uniforms < w) & (at <= num_drafted[:, None])
    kept = jnp.max(jnp.where(passed, at, 0), axis=1).astype(jnp.int32)
    zero = jnp.zeros_like(draws)
    return accept_with_noise(
        zero[:, None] + 0 * uniforms, draws, draft_tokens, draft_probs, target_probs, kept
    )


def _q_at(draft_tokens, draft_probs):
    """q of each drafted token (1 for a deterministic drafter: q is None)."""
    if draft_probs is None:
        return jnp.ones(draft_tokens.shape, jnp.float32)
    return jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]


def _unnormalised(p, q, x, rows):
    """A wrong rejection in a sampled tree: the residual max(0, p - q) left unnormalised."""
    q = q.at[rows, x].set(0.0)
    return jnp.maximum(p - q, 0.0), q / q.sum(-1, keepdims=True)


def wrong_tree(logits, draws, proposal, sampling, depth):
    """A wrong tree rule: a sampled tree's rejections leave the residual unnormalised; a
    deterministic tree's walk draws every node's token with the root's noise."""
    if proposal.probs is not None and not sampling.greedy:
        return accept_rsd(logits, draws, proposal, sampling, depth, reject=_unnormalised)
    same = jnp.broadcast_to(draws[:, :1, 0], draws.shape[:2])
    return walk(proposal, target_tokens(logits, same, sampling), depth)


def wrong_rule(drafter, shape):
    if shape == "tree":
        return wrong_tree
    if shape == "block":
        return unnormalised_weights
    if (drafter, shape) == ("feature", "chain"):
        return residual_at_x
    return resample_from_p


# The first case of each (drafter, shape), at T = 1 (the mixed case's T = 1 alone).
FIRST = {}
for _d, _s, _name, _opts in CHI2:
    FIRST.setdefault((_d, _s), {k: v for k, v in _opts.items() if k != "sampling"})


class TestWrongRule:
    """A wrong acceptance rule fails the sampling test."""

    @pytest.mark.slow
    @pytest.mark.parametrize("drafter,shape", CASES, ids=[ids(c) for c in CASES])
    def test_fails_the_same_test(self, small, drafter, shape):
        """The T = 1 case's samples under a wrong acceptance rule for the round's shape (seed
        0): the chi-square test of each prompt gives p < 1e-6."""
        opts = FIRST[(drafter, shape)]
        rule = wrong_rule(drafter, shape)
        seqs, stats = sample(small, drafter, shape, opts, seed=0, _rule=rule)
        p = pvalues(small["target"], seqs[0], T1, opts.get("eos"))
        print(f"\nWRONG RULE {drafter} {shape} {rule.__name__}: chi2_pvalues={p[0]:.3g} {p[1]:.3g}")
        assert max(p) < 1e-6, f"{rule.__name__} passed: p = {p}"

    @pytest.mark.slow
    def test_a_wrong_walk_of_a_heads_tree_with_lookup_fails(self, small):
        """The head's tree with prompt lookup grafted on is walked at T = 1: a wrong walk
        (every node's token drawn with the root's noise) fails its sampling test."""
        opts = next(o for d, s, n, o in CHI2 if (d, s, n) == ("feature", "tree", "t1_lookup"))
        seqs, _ = sample(small, "feature", "tree", opts, seed=0, _rule=wrong_tree)
        p = pvalues(small["target"], seqs[0], T1, opts.get("eos"))
        assert max(p) < 1e-6, f"wrong_tree passed with lookup: p = {p}"


class TestWrongCount:
    """Penalties counting the wrong tokens fail the sampling test."""

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "where", ["verify", "tree_round"], ids=["chain-drafts-uncounted", "tree-paths-uncounted"]
    )
    def test_counting_only_the_tokens_before_the_round_fails(self, small, monkeypatch, where):
        """The verify's p at a drafted position without the drafts before it counted (as a
        loop that counts only accepted tokens would): p < 1e-6."""
        import importlib

        from jax_specdec import penalties

        module = importlib.import_module(f"jax_specdec.decode.{where}")
        uncounted = lambda logits, sampling, seen, *_: penalties.adjust(logits, sampling, seen)  # noqa: E731
        monkeypatch.setattr(module, "adjust", uncounted)
        jax.clear_caches()  # the program is traced again with the wrong count
        drafter, shape = ("draft", "chain") if where == "verify" else ("ngram", "tree")
        # Frequency: n-gram drafts come from the prompt, where a repetition penalty
        # already counts them.
        sampling = SamplingConfig(1.0, frequency_penalty=2.0)
        try:
            seqs, _ = sample(small, drafter, shape, dict(sampling=sampling, gamma=3), seed=0)
        finally:
            jax.clear_caches()
        p = pvalues(small["target"], seqs[0], sampling, None)
        print(f"\nWRONG COUNT {where}: chi2_pvalues={p[0]:.3g} {p[1]:.3g}")
        # The n-gram tree drafts for the second prompt's rows only (the first one's
        # continuations rarely repeat it).
        assert (max(p) if where == "verify" else p[1]) < 1e-6, f"uncounted drafts passed: {p}"


# ---------------------------------------------------------------- rows


class TestRows:
    """A row's tokens do not depend on its batch neighbours."""

    @pytest.mark.parametrize("drafter,shape", _params(CASES, QUICK_ROWS))
    def test_tokens_do_not_depend_on_the_neighbours(self, small, drafter, shape):
        """At T = 0.9 with one key per row: the same keys give the same tokens; two rows
        among other neighbours (at other positions, in the same program) get the tokens
        they get in the first batch of six; through slots (one and two; two for a tree)
        every row gets its tokens and acceptance counts of the batch without slots."""
        gen = generator(small, drafter, shape, sampling=SamplingConfig(0.9))
        prompts = [(p * 2)[:8] for p in ragged_prompts(6, VOCAB, seed=5)]
        budgets = [12, 5, 12, 9, 12, 3]
        keys = jax.random.split(jax.random.key(7), len(prompts))
        whole = gen(prompts, key=keys, max_new_tokens=budgets)
        again = gen(prompts, key=keys, max_new_tokens=budgets)
        np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(whole.tokens))
        assert int(whole.stats.drafted.sum()) > 0, "nothing was drafted: a vacuous test"
        slot_counts = {"slots": (1, 2), "tree": (2,)}.get(shape, ())
        for slots in slot_counts:
            got = gen(prompts, key=keys, max_new_tokens=budgets, num_slots=slots)
            np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(whole.tokens))
            np.testing.assert_array_equal(
                np.asarray(got.stats.accepted_at), np.asarray(whole.stats.accepted_at)
            )
        _check_other_neighbours(gen, prompts, keys, budgets, whole)


def _check_other_neighbours(gen, prompts, keys, budgets, whole):
    """Rows 4 and 1 as rows 0 and 3 of a batch of other prompts, keys and budgets (six
    rows, the same longest prompt and largest budget: the same program): the same tokens."""
    width = max(map(len, prompts))  # the same padded width
    others = [(p * 3)[:width] for p in ragged_prompts(4, VOCAB, seed=8)]
    others[0] = (others[0] * width)[:width]
    fresh = jax.random.split(jax.random.key(8), 4)
    batch = [prompts[4], others[0], others[1], prompts[1], others[2], others[3]]
    row_keys = jnp.stack([keys[4], fresh[0], fresh[1], keys[1], fresh[2], fresh[3]])
    apart = gen(
        batch, key=row_keys, max_new_tokens=[budgets[4], max(budgets), 7, budgets[1], 10, 2]
    )
    for row, i in ((4, 0), (1, 3)):
        n = int(whole.lengths[row])
        assert int(apart.lengths[i]) == n
        np.testing.assert_array_equal(
            np.asarray(apart.tokens)[i, :n], np.asarray(whole.tokens)[row, :n]
        )
