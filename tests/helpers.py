"""What the tests share: tiny models (and a tiny pair saved as model directories), ragged
prompts, exact enumeration of a target's sequence probabilities, the chi-square test,
HLO inspection and compile counting."""

import contextlib
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from jax_specdec import speculative_generate
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.nn.eagle3 import Eagle3Config, Eagle3Head
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.sampling import probs_from_logits

VOCAB = 6


def make_model(seed, vocab=VOCAB, scale=0.2, **overrides):
    return Transformer(
        TransformerConfig.tiny(vocab_size=vocab, **overrides), rngs=nnx.Rngs(seed), init_scale=scale
    )


def make_draft(seed=1, vocab=VOCAB):
    """The small draft of the exactness tests (one layer, d 16)."""
    return make_model(
        seed, vocab, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, mlp_dim=32
    )


def make_head(target, seed=5, kept_ids=None, scale=0.3, layers=1):
    """A random head for `target`; `kept_ids` (default all) becomes its vocab_map."""
    kept_ids = np.arange(target.config.vocab_size) if kept_ids is None else np.asarray(kept_ids)
    config = FeatureHeadConfig.for_target(
        target.config, len(kept_ids), target="tiny test target", num_layers=layers
    )
    head = FeatureHead(config, rngs=nnx.Rngs(seed), init_scale=scale)
    head.vocab_map.set_value(jnp.asarray(kept_ids, jnp.int32))
    return head


def make_eagle3(target, layers=(0, 1, 2), kept_ids=None, seed=5, scale=0.3, **flags):
    """A random EAGLE-3 head (one layer, the target's shape) reading `layers` of `target`;
    `kept_ids` (sorted, default all) is its draft vocabulary."""
    tc = target.config
    kept = np.arange(tc.vocab_size) if kept_ids is None else np.asarray(kept_ids)
    config = Eagle3Config(
        layer=tc.replace(num_layers=1),
        draft_vocab_size=len(kept),
        aux_layer_ids=tuple(layers),
        has_embed=False,
        verifier="tiny test target",
        **flags,
    )
    head = Eagle3Head(config, rngs=nnx.Rngs(seed), init_scale=scale)
    head.vocab_map.set_value(jnp.asarray(kept, jnp.int32))
    return head


def save_tiny_pair(root, *, num_kv_heads=None, other=False) -> int:
    """A tiny target (two layers) and draft (one) with a 300-token tokenizer trained on
    the stdlib corpus, saved as model directories root/target and root/draft (and, with
    `other`, the draft again as root/other with a different tokenizer); `num_kv_heads`
    overrides the tiny config's (4 lets the heads split over a mesh's model axis).
    Returns the vocabulary size."""
    from jax_specdec.io.hf import save_model
    from jax_specdec.training.corpus import stdlib_corpus, train_tokenizer

    corpus = stdlib_corpus()
    tokenizer = train_tokenizer(corpus.read(corpus.train[:10]), 300)
    vocab = tokenizer.get_vocab_size()
    extra = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
    for name, seed, layers in (("target", 0, None), ("draft", 1, 1)):
        shape = extra if layers is None else {**extra, "num_layers": layers}
        config = TransformerConfig.tiny(vocab_size=vocab, **shape)
        model = Transformer(config, rngs=nnx.Rngs(seed), init_scale=0.3)
        save_model(model, f"{root}/{name}", tokenizer=tokenizer)
    if other:
        another = train_tokenizer(corpus.read(corpus.train[10:20]), 300)
        save_model(model, f"{root}/other", tokenizer=another)
    return vocab


@pytest.fixture(scope="module")
def head(target):
    """Kept vocabulary without token 3, which the target can emit. Small weights: q near
    uniform over the kept tokens, so drafts are often accepted even under top-k/top-p."""
    return make_head(target, kept_ids=[0, 1, 2, 4, 5], scale=0.05)


def small_corpus(directory, repeat=8):
    """60 small .py files in `directory` (some held out by the corpus's hash split), each
    a one-line function `repeat` times."""
    directory.mkdir()
    for i in range(60):
        (directory / f"m{i}.py").write_text(
            f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * repeat
        )
    return directory


def ragged_prompts(num, vocab, seed=0, max_len=9):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, max_len)).tolist() for _ in range(num)]


def exact_sequence_probs(target, prompt, sampling, eos, depth=3):
    """{sequence: probability} of the first `depth` sampled tokens (shorter if EOS: an id
    or a tuple of ids). A setting's logit bias and penalties are applied here, in NumPy,
    from their definitions (`penalised_logits`), each continuation's own tokens counted."""
    stops = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    conts = np.array(list(itertools.product(range(VOCAB), repeat=depth)), np.int32)
    tokens = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
    start = len(prompt) - 1
    logits = np.asarray(target(jnp.asarray(tokens)), np.float32)[:, start : start + depth]
    if sampling.penalised or sampling.logit_bias:
        logits = penalised_logits(logits, prompt, conts, sampling)
        sampling = dataclasses.replace(
            sampling, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0
        )
        sampling = dataclasses.replace(sampling, logit_bias=())
    probs = np.asarray(probs_from_logits(jnp.asarray(logits), sampling), np.float64)
    result = {}
    for i, cont in enumerate(conts):
        prob, seq = 1.0, ()
        for j, tok in enumerate(cont):
            prob *= probs[i, j, tok]
            seq += (int(tok),)
            if tok in stops:
                break
        result[seq] = result.get(seq, 0.0) + prob if len(seq) < depth else prob
    # Sequences cut by EOS were added once per continuation after the EOS: divide out.
    for seq in list(result):
        if len(seq) < depth:
            result[seq] /= VOCAB ** (depth - len(seq))
    return {seq: prob for seq, prob in result.items() if prob > 0}


def penalised_logits(logits, prompt, conts, sampling):
    """logits [C, depth, V] after the logit bias, then the repetition penalty over the
    prompt and the tokens generated before each position (l / r if l > 0, else l * r),
    then the frequency and presence penalties over the generated ones."""
    out = logits.astype(np.float64).copy()
    for token, bias in sampling.logit_bias:
        out[..., token] += bias
    r, f, p = sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty
    for i, cont in enumerate(conts):
        for j in range(out.shape[1]):
            counts = np.bincount(cont[:j], minlength=out.shape[2])
            seen = (counts > 0) | np.isin(np.arange(out.shape[2]), prompt)
            row = out[i, j]
            row[seen] = np.where(row[seen] > 0, row[seen] / r, row[seen] * r)
            row -= f * counts + p * (counts > 0)
    return out.astype(np.float32)


def chi_square_pvalue(samples, exact):
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys))
    for seq in samples:
        assert seq in index, f"emitted an impossible sequence {seq}"
        counts[index[seq]] += 1
    expected = np.array([exact[k] for k in keys]) * len(samples)
    # Pool rare outcomes so every bin expects >= 5.
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue


NUM_SAMPLES = 100_000
PROMPTS = ([2, 5], [1, 0, 3, 4])  # ragged: rows alternate between the two


def sample_sequences(target, draft, sampling, gamma, eos, seed, **kwargs):
    """NUM_SAMPLES rows alternating between the two PROMPTS; kwargs go to the loop
    (gamma=None and schedule=... for a dynamic schedule)."""
    prompts = [PROMPTS[b % 2] for b in range(NUM_SAMPLES)]
    out = speculative_generate(
        target,
        draft,
        prompts,
        key=jax.random.key(seed),
        max_new_tokens=3,
        num_draft_tokens=gamma,
        sampling=sampling,
        eos_token_id=eos,
        **kwargs,
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    seqs = [tuple(tokens[b, : lengths[b]].tolist()) for b in range(NUM_SAMPLES)]
    return seqs, out.stats


def assert_follows_target(target, seqs, sampling, eos, label=""):
    """The exactness tests' check: the rows of each of PROMPTS (alternating in `seqs`)
    against the exactly enumerated sequence probabilities, chi-square p > 1e-3."""
    for which, prompt in enumerate(PROMPTS):
        exact = exact_sequence_probs(target, np.array(prompt), sampling, eos)
        pvalue = chi_square_pvalue(seqs[which::2], exact)
        print(f"\nEXACTNESS {label} prompt{which}: chi2_pvalue={pvalue:.3g}")
        assert pvalue > 1e-3, f"{label} prompt {which}: p = {pvalue:.3g}"


def copies_outside_entry(hlo: str, shape: str) -> int:
    """Copies of arrays of `shape` in any computation but the entry (loop bodies etc.)."""
    count, in_entry = 0, False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            in_entry = line.startswith("ENTRY")
        if (
            not in_entry
            and f"{shape}" in line
            and " copy(" in line
            and line.strip().startswith("%")
        ):
            count += 1
    return count


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations inside the block: `with count_compiles() as n:`,
    then `n[0]`."""
    count = [0]

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def cli_refusal(argv, capsys) -> str:
    """Runs the CLI in-process on bad input: it must exit with code 2 (no traceback, which
    in-process would be an exception); returns its stderr."""
    from jax_specdec.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def hub_cache(root, monkeypatch, repos: dict) -> dict:
    """A Hugging Face Hub cache under `root` holding each repo id's copy of its source
    folder (`models--org--name/refs/main`, `snapshots/<commit>/...`, the layout
    `huggingface_hub` reads), made the cache with the Hub offline; returns the commits."""
    import hashlib
    import shutil

    from huggingface_hub import constants

    commits = {}
    for repo, source in repos.items():
        commit = hashlib.sha1(repo.encode()).hexdigest()
        base = root / f"models--{repo.replace('/', '--')}"
        shutil.copytree(source, base / "snapshots" / commit)
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text(commit)
        commits[repo] = commit
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return commits
