"""Building a feature head: the target's features on disk (resumable), the kept
vocabulary, training (agreement rises; a killed run resumes to the same weights), the
head directory, and `jax-specdec train-drafter` / `generate --draft <head>`."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import make_model, small_corpus

from jax_specdec import SamplingConfig, autoregressive_generate, speculative_generate
from jax_specdec.io.heads import load_head, save_head
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.training.head_data import (
    FeatureSet,
    extract_features,
    kept_vocabulary,
    spread_windows,
)
from jax_specdec.training.head_recipe import DataConfig, _record_start
from jax_specdec.training.head_train import HeadTrainConfig, agreement, init_from_target, train_head

VOCAB = 24


def tiny_target():
    return make_model(4, vocab=VOCAB, scale=0.5)


def tiny_data(target, directory, count=32, seed=0):
    """Windows of the target's own greedy text (learnable), with its features."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=3).tolist() for _ in range(count)]
    out = autoregressive_generate(target, prompts, key=jax.random.key(0), max_new_tokens=13)
    windows = np.concatenate([np.array(prompts), np.asarray(out.tokens)], axis=1)
    return extract_features(target, windows.astype(np.int32), directory, batch=8, progress=False)


def new_head(target, data, kept=16, seed=0):
    head = FeatureHead(FeatureHeadConfig.for_target(target.config, kept), rngs=nnx.Rngs(seed))
    init_from_target(head, target, kept_vocabulary(data, kept, VOCAB))
    return head


def test_extraction_resumes_from_its_parts(tmp_path):
    target = tiny_target()
    first = tiny_data(target, tmp_path)
    assert first.features.shape == (32, 16, target.config.d_model)
    parts = sorted((tmp_path / "parts").glob("*.npz"))
    assert len(parts) == 4
    parts[2].unlink()
    stamp = parts[0].stat().st_mtime_ns
    again = tiny_data(target, tmp_path)
    assert parts[0].stat().st_mtime_ns == stamp  # not computed again
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    logits, features = target(jnp.asarray(first.tokens[:2]), features=True)
    np.testing.assert_allclose(first.features[:2], np.asarray(features), atol=2e-3)
    np.testing.assert_array_equal(first.greedy[:2], np.argmax(np.asarray(logits), -1))


def test_parts_of_other_windows_are_refused(tmp_path):
    target = tiny_target()
    tiny_data(target, tmp_path)
    with pytest.raises(ValueError, match="holds other windows"):
        tiny_data(target, tmp_path, seed=1)


def test_extra_parts_and_bad_settings_are_refused(tmp_path):
    target = tiny_target()
    data = tiny_data(target, tmp_path)
    with pytest.raises(ValueError, match="parts beyond"):
        extract_features(target, data.tokens[:8], tmp_path, batch=8, progress=False)
    with pytest.raises(ValueError, match="spread applies"):
        DataConfig(kind="greedy", spread=True)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="unroll"):
            HeadTrainConfig(unroll=bad)
    head = new_head(target, data)
    with pytest.raises(ValueError, match="steps must lie"):
        agreement(head, data, target.embed[...], steps=16)
    short = FeatureSet(*(a[:, :4] for a in data[:3]))
    with pytest.raises(ValueError, match="unroll 4 needs windows longer"):
        train_head(
            head, target, short, short, HeadTrainConfig(unroll=4), checkpoint_dir=tmp_path / "r"
        )
    assert DataConfig(corpus="/some/dir").name != DataConfig().name


def test_spread_windows_cover_the_stream():
    stream = np.arange(1000)
    windows = spread_windows(stream, 10, 50)
    np.testing.assert_array_equal(windows[:, 0], [0, 250, 500, 740, 990])
    np.testing.assert_array_equal(windows[1], np.arange(250, 260))
    assert spread_windows(stream, 10, 5000).shape == (100, 10)


def test_kept_vocabulary_is_the_most_frequent():
    tokens = np.array([[5, 5, 5, 2, 2, 9]])
    data = FeatureSet(tokens, np.zeros((1, 6, 1)), np.array([[5, 7, 7, 7, 7, 1]]))
    np.testing.assert_array_equal(kept_vocabulary(data, 2, 10), [5, 7])
    with pytest.raises(ValueError, match="kept vocabulary size"):
        kept_vocabulary(data, 11, 10)


@pytest.mark.slow
def test_training_raises_agreement_and_the_head_drafts_better(tmp_path):
    target = tiny_target()
    data = tiny_data(target, tmp_path / "data")
    head = new_head(target, data)
    before = agreement(head, data, target.embed[...])
    config = HeadTrainConfig(steps=150, learning_rate=3e-3, checkpoint_every=150, eval_every=150)
    log = train_head(
        head, target, data, data, config, checkpoint_dir=tmp_path / "run", progress=False
    )
    after = agreement(head, data, target.embed[...])
    assert after[0] > before[0] + 0.2 and after[0] > 0.6, (before, after)
    assert log["agreement"][-1][1] == after
    prompts = [data.tokens[b, :4].tolist() for b in range(8)]
    kwargs = dict(key=jax.random.key(0), max_new_tokens=12, num_draft_tokens=3)
    stats = speculative_generate(target, head, prompts, **kwargs).stats
    first = np.asarray(stats.accepted_at)[:, 0].sum() / np.asarray(stats.drafted_at)[:, 0].sum()
    assert first > 0.5  # the first draft, as the teacher-forced agreement measures it


@pytest.mark.slow
def test_unrolled_training_raises_later_draft_steps(tmp_path):
    target = tiny_target()
    data = tiny_data(target, tmp_path / "data")
    steps = {}
    for unroll in (1, 3):
        head = new_head(target, data)
        config = HeadTrainConfig(
            steps=150, learning_rate=3e-3, checkpoint_every=150, eval_every=150, unroll=unroll
        )
        train_head(
            head, target, data, data, config, checkpoint_dir=tmp_path / f"{unroll}", progress=False
        )
        steps[unroll] = agreement(head, data, target.embed[...], steps=3)
    # Measured: [0.74, 0.24, 0.23] with one pass, [0.61, 0.64, 0.64] with three.
    assert steps[3][1] > steps[1][1] + 0.2 and steps[3][2] > steps[1][2] + 0.2, steps


TRAIN_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_feature_train import tiny_target, tiny_data, new_head
from jax_specdec.training.head_train import HeadTrainConfig, train_head
from jax_specdec.io.heads import save_head
target = tiny_target()
data = tiny_data(target, {data!r})
head = new_head(target, data)
config = HeadTrainConfig(steps=60, checkpoint_every=5, eval_every=1000)
train_head(head, target, data, data, config, checkpoint_dir={run!r}, progress=False)
save_head(head, {out!r})
"""


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))

    def script(name):
        run, out = tmp_path / f"run-{name}", tmp_path / f"out-{name}"
        code = TRAIN_SCRIPT.format(
            tests=tests, data=str(tmp_path / "data"), run=str(run), out=str(out)
        )
        return [sys.executable, "-c", code], run, out

    command, run, out = script("killed")
    process = subprocess.Popen(command)
    while not (run / "log.json").exists() and process.poll() is None:  # a finished save
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "model.safetensors").exists(), "killed before the end"
    subprocess.run(command, check=True)
    log = json.loads((run / "log.json").read_text())
    assert log["resumed_from"] is not None and log["resumed_from"] < 60
    command, _, whole = script("whole")
    subprocess.run(command, check=True)
    a, b = nnx.state(load_head(out)), nnx.state(load_head(whole))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_head_directory_round_trip_and_bad_files(tmp_path):
    target = tiny_target()
    head = FeatureHead(FeatureHeadConfig.for_target(target.config, 10), rngs=nnx.Rngs(1))
    head.vocab_map.set_value(jnp.arange(0, 20, 2, dtype=jnp.int32))
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head")
    for x, y in zip(
        jax.tree.leaves(nnx.state(head)), jax.tree.leaves(nnx.state(loaded)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    kwargs = dict(key=jax.random.key(0), max_new_tokens=6, sampling=SamplingConfig(1.0))
    a = speculative_generate(target, head, [[1, 2]], **kwargs)
    b = speculative_generate(target, loaded, [[1, 2]], **kwargs)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    config = json.loads((tmp_path / "head" / "head_config.json").read_text())
    config["kept"] = 12
    (tmp_path / "head" / "head_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has shape"):
        load_head(tmp_path / "head")
    with pytest.raises(FileNotFoundError, match="not a feature head"):
        load_head(tmp_path)


@pytest.mark.slow
def test_head_saved_in_float16_stays_float16_and_drafts_the_same(tmp_path):
    """A head saved in float16 loads in float16 (its config says so) and drafts exactly
    as the same weights widened to float32: the products widen them as they read."""
    target = tiny_target()
    head = FeatureHead(FeatureHeadConfig.for_target(target.config, 10), rngs=nnx.Rngs(1))
    head.vocab_map.set_value(jnp.arange(0, 20, 2, dtype=jnp.int32))
    save_head(head, tmp_path / "half", dtype="float16")
    save_head(head, tmp_path / "full")
    half, full = (tmp_path / d / "model.safetensors" for d in ("half", "full"))
    assert 0.45 < half.stat().st_size / full.stat().st_size < 0.55
    loaded = load_head(tmp_path / "half")
    widened = load_head(tmp_path / "half", param_dtype="float32")
    assert loaded.config.layer.param_dtype == "float16"
    for x, y, z in zip(
        *(jax.tree.leaves(nnx.state(h)) for h in (head, loaded, widened)), strict=True
    ):
        floating = x.dtype == jnp.float32
        assert y.dtype == (jnp.float16 if floating else x.dtype) and z.dtype == x.dtype
        expected = np.asarray(x).astype(np.float16) if floating else np.asarray(x)
        np.testing.assert_array_equal(np.asarray(y), expected)
        np.testing.assert_array_equal(np.asarray(z), expected.astype(z.dtype))
    for temperature in (0.0, 1.0):
        kwargs = dict(key=jax.random.key(3), max_new_tokens=8, sampling=SamplingConfig(temperature))
        a, b = (
            speculative_generate(target, h, [[1, 2], [3]], num_draft_tokens=3, **kwargs)
            for h in (loaded, widened)
        )
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_array_equal(
            np.asarray(a.stats.accepted_at), np.asarray(b.stats.accepted_at)
        )
    with pytest.raises(ValueError, match="dtype"):
        save_head(head, tmp_path / "bad", dtype="int8")
    with pytest.raises(ValueError, match="param_dtype"):
        load_head(tmp_path / "half", param_dtype="int8")
    data = tiny_data(target, tmp_path / "data")
    with pytest.raises(ValueError, match="float32 weights"):
        train_head(loaded, target, data, data, HeadTrainConfig(steps=1), checkpoint_dir=tmp_path)


@pytest.mark.slow
def test_cli_train_drafter_then_generate_with_it(pair, tmp_path, capsys):
    from jax_specdec.cli import main

    corpus = small_corpus(tmp_path / "corpus")
    out = tmp_path / "head"
    argv = ["train-drafter", "--target", str(pair / "target"), "--corpus", str(corpus)]
    argv += ["--out", str(out), "--tokens", "2048", "--seq-len", "64", "--kept", "64"]
    argv += ["--steps", "3", "--checkpoint-every", "2", "--eval-every", "3"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and len(summary["agreement"]) == 3
    assert (out / "model.safetensors").is_file() and (out / "training.json").is_file()
    argv = ["generate", "--target", str(pair / "target"), "--draft", str(out), "--json"]
    argv += ["-k", "4"]  # a fixed width: auto's compile and measurement are not checked here
    assert main([*argv, "def f(x):", "--max-new-tokens", "8", "--eos", "none"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["generated_tokens"] == 8
    with pytest.raises(SystemExit):  # a head for another tokenizer
        main(["generate", "--target", str(pair / "other"), "--draft", str(out), "x"])
    assert "another tokenizer" in capsys.readouterr().err
    # --init: a second run starts from that head (at learning rate 0 it stays that head)
    argv = ["train-drafter", "--target", str(pair / "target"), "--corpus", str(corpus)]
    argv += ["--tokens", "2048", "--seq-len", "64", "--steps", "2", "--eval-every", "2"]
    argv += ["--work-dir", str(tmp_path / "work2"), "--init", str(out)]
    assert main([*argv, "--out", str(tmp_path / "again"), "--learning-rate", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["init"] == str(out)
    assert summary["init_training"] == json.loads((out / "training.json").read_text())
    again, first = load_head(tmp_path / "again"), load_head(out)
    for x, y in zip(*(jax.tree.leaves(nnx.state(h)) for h in (again, first)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(out)])
    assert "would overwrite its start" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path / "bad"), "--kept", "32"])
    err = capsys.readouterr().err
    assert "does not fit" in err and "kept 64 vs 32" in err
    with pytest.raises(SystemExit):  # the first run's checkpoints did not start from a head
        main([*argv[:-4], "--work-dir", f"{out}.work", "--init", str(out), "--out", f"{out}.b"])
    assert "another --run-name" in capsys.readouterr().err


def test_a_run_resumes_from_the_same_head_weights_wherever_they_lie(tmp_path):
    run = tmp_path / "runs" / "r1"
    head, copy, other = (tmp_path / name for name in ("head", "copy", "other"))
    for path, data in ((head, b"weights"), (copy, b"weights"), (other, b"trained more")):
        path.mkdir()
        (path / "model.safetensors").write_bytes(data)
    _record_start(run, head)
    run.mkdir()
    (run / "100").mkdir()  # a checkpoint
    _record_start(run, copy)  # the same weights at another path (a fresh checkout)
    with pytest.raises(ValueError, match="other weights"):
        _record_start(run, other)  # e.g. the head shipped after this run at the same path
    with pytest.raises(ValueError, match="this command starts from the target"):
        _record_start(run, None)
    legacy = tmp_path / "runs" / "r1.start.json"  # recorded by path before the digest
    legacy.write_text(json.dumps({"init": str(head.resolve())}) + "\n")
    _record_start(run, head)  # by path only, and the record is left as it was
    assert json.loads(legacy.read_text()) == {"init": str(head.resolve())}
    with pytest.raises(ValueError, match="copy \\(its record names the head by path\\)"):
        _record_start(run, copy)  # the weights were never recorded: not compared
    legacy.unlink()  # checkpoints and no record: a run from before the records
    with pytest.raises(ValueError, match="started from the target"):
        _record_start(run, head)
    _record_start(run, None)
