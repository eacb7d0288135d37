"""Training: determinism, resumption after a real kill, distillation, the corpus and tokenizer."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from flax import nnx

from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.training.corpus import encode_files, sample_windows, stdlib_corpus, train_tokenizer
from jax_specdec.training.lm import TrainConfig, evaluate_loss, train

SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, jax
    from flax import nnx
    from jax_specdec.nn import Transformer, TransformerConfig
    from jax_specdec.training.lm import TrainConfig, train
    ckpt, out = sys.argv[1], sys.argv[2]
    stream = np.random.default_rng(0).integers(0, 64, size=20_000).astype(np.int32)
    # Some structure to learn: every other token repeats its predecessor.
    stream[1::2] = stream[::2]
    model = Transformer(TransformerConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    config = TrainConfig(steps=40, batch_size=4, seq_len=32, warmup_steps=5,
                         eval_every=20, eval_batches=2, checkpoint_every=5)
    log = train(model, stream, stream[:4000], config, checkpoint_dir=ckpt, progress=False)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    np.savez(out, *[np.asarray(x) for x in leaves])
    print("RESUMED_FROM", log["resumed_from"])
    """
)


def _run(script, ckpt, out, env=None):
    return subprocess.Popen(
        [sys.executable, "-c", script, str(ckpt), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_killed_run_resumes_to_identical_weights(tmp_path):
    # Uninterrupted reference.
    ref = _run(SCRIPT, tmp_path / "ref_ckpt", tmp_path / "ref.npz")
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    # Slowed down after step 10 so the kill lands mid-run, after a checkpoint.
    slow = SCRIPT.replace(
        "log = train(",
        "import jax_specdec.training.lm as T\n"
        "orig = T._train_step\n"
        "def slow_step(*a, **k):\n"
        "    import time; time.sleep(0.2); return orig(*a, **k)\n"
        "T._train_step = slow_step\n"
        "log = train(",
    )
    ckpt = tmp_path / "ckpt"
    proc = _run(slow, ckpt, tmp_path / "partial.npz")
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [int(p.name) for p in ckpt.glob("*") if p.name.isdigit()]
        if steps and max(steps) >= 10:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "partial.npz").exists()
    resumed = _run(SCRIPT, ckpt, tmp_path / "resumed.npz")
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    resumed_from = int(stdout.split("RESUMED_FROM")[1].split()[0])
    assert 10 <= resumed_from < 40
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
    assert a.files == b.files
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name])


def _stream(vocab=64, size=20_000, seed=0):
    stream = np.random.default_rng(seed).integers(0, vocab, size=size).astype(np.int32)
    stream[1::2] = stream[::2]
    return stream


@pytest.mark.slow
def test_training_lowers_loss_and_is_deterministic(tmp_path):
    stream = _stream()
    config = TrainConfig(
        steps=30,
        batch_size=8,
        seq_len=32,
        warmup_steps=3,
        eval_every=30,
        eval_batches=2,
        checkpoint_every=30,
        learning_rate=1e-2,
    )
    weights = []
    for run in range(2):
        model = Transformer(TransformerConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
        before = evaluate_loss(model, stream, config)
        log = train(
            model, stream, stream, config, checkpoint_dir=tmp_path / f"c{run}", progress=False
        )
        assert log["validation_loss"][-1][1] < before - 0.3
        weights.append(jax.tree.leaves(nnx.state(model, nnx.Param)))
    for x, y in zip(*weights, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("divergence", ["tvd", "kl"])
@pytest.mark.slow
def test_distillation_moves_draft_towards_teacher(tmp_path, divergence):
    stream = _stream()
    teacher = Transformer(TransformerConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0), init_scale=0.1)
    student = Transformer(TransformerConfig.tiny(vocab_size=64), rngs=nnx.Rngs(1), init_scale=0.3)
    windows = sample_windows(stream, batch=8, length=32, seed=99, step=0)[:, :-1]

    def tv():
        p = jax.nn.softmax(teacher(windows), -1)
        q = jax.nn.softmax(student(windows), -1)
        return float(0.5 * np.abs(np.asarray(p - q)).sum(-1).mean())

    before = tv()
    config = TrainConfig(
        steps=60,
        batch_size=8,
        seq_len=32,
        warmup_steps=3,
        eval_every=60,
        eval_batches=1,
        checkpoint_every=60,
        learning_rate=1e-2,
        divergence=divergence,
    )
    train(
        student,
        stream,
        stream,
        config,
        checkpoint_dir=tmp_path / "d",
        teacher=teacher,
        progress=False,
    )
    assert tv() < 0.5 * before


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"steps": 0}, "steps"),
        ({"warmup_steps": 50, "steps": 10}, "warmup_steps"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"divergence": "l2"}, "divergence"),
    ],
)
def test_train_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)


def test_distillation_needs_matching_teacher(tmp_path):
    student = Transformer(TransformerConfig.tiny(vocab_size=64), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="needs a teacher"):
        train(
            student,
            _stream(),
            _stream(),
            TrainConfig(steps=2, warmup_steps=0, divergence="kl"),
            checkpoint_dir=tmp_path / "x",
            progress=False,
        )
    teacher = Transformer(TransformerConfig.tiny(vocab_size=32), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="vocabulary"):
        train(
            student,
            _stream(),
            _stream(),
            TrainConfig(steps=2, warmup_steps=0, divergence="kl"),
            checkpoint_dir=tmp_path / "x",
            teacher=teacher,
            progress=False,
        )


def test_corpus_split_and_tokenizer_round_trip():
    corpus = stdlib_corpus()
    assert len(corpus.train) > 300 and len(corpus.validation) > 10
    assert not set(corpus.train) & set(corpus.validation)
    assert all("test" not in name.split(os.sep) for name in corpus.train)
    texts = corpus.read(corpus.train[:20])
    tokenizer = train_tokenizer(texts, 300)
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    sample = texts[0][:500]
    assert tokenizer.decode(tokenizer.encode(sample).ids) == sample
    stream = encode_files(tokenizer, texts[:3])
    assert stream.dtype == np.int32 and (stream == 0).sum() == 3
    a = sample_windows(stream, batch=2, length=16, seed=1, step=5)
    np.testing.assert_array_equal(a, sample_windows(stream, batch=2, length=16, seed=1, step=5))
    with pytest.raises(ValueError, match="too short"):
        sample_windows(stream[:10], batch=1, length=16, seed=0, step=0)


def test_shipped_models_load_here_and_in_transformers():
    """The shipped directories load, share a tokenizer and carry their training record."""
    from jax_specdec.io.hf import load_model

    root = os.path.join(os.path.dirname(__file__), "..", "models")
    for name in ("stdlib-target", "stdlib-draft"):
        path = os.path.join(root, name)
        model = load_model(path)
        info = json.load(open(os.path.join(path, "training.json")))
        assert info["config"]["vocab_size"] == model.config.vocab_size
        # Hugging Face loads the shipped directory and computes the same logits.
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ids = np.array([[5, 100, 2000, 7, 42, 9, 300]])
        with torch.no_grad():
            expected = hf(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=1e-4)
    with (
        open(os.path.join(root, "stdlib-target", "tokenizer.json")) as a,
        open(os.path.join(root, "stdlib-draft", "tokenizer.json")) as b,
    ):
        assert a.read() == b.read()
