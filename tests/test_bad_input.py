"""Bad input as a careless user gives it: every refusal is one line naming the argument,
file, line or id, before anything is compiled or written; nothing passes silently."""

import json
import shutil
import types

import jax
import numpy as np
import pytest
from gguf_files import write_gguf
from helpers import cli_refusal, make_model
from safetensors.numpy import load_file, save_file

from jax_specdec import Generator
from jax_specdec.batch import JobError, JobRow, plan_batches, run_job
from jax_specdec.io.gguf import convert_gguf
from jax_specdec.io.heads import load_head, save_head
from jax_specdec.io.hf import load_model
from jax_specdec.nn import TransformerConfig
from jax_specdec.sampling import SamplingConfig

pytest.importorskip("gguf")


def model_args(pair):
    return ["--target", str(pair / "target"), "--draft", str(pair / "draft")]


def batch_argv(pair, inp, out, *extra):
    argv = ["batch", *model_args(pair), "--input", str(inp), "--output", str(out)]
    return [*argv, "--max-new-tokens", "4", *extra]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ budgets past int32


@pytest.mark.parametrize("budgets", [[4, 2**32 + 3], [4, 2**31], 2**31, np.array([4, 2**40])])
def test_budgets_past_int32_are_refused_not_wrapped(budgets):
    gen = Generator(make_model(0))
    with pytest.raises(ValueError, match="max_new_tokens must be at most 2147483647"):
        gen.bind([[1, 2], [3]], key=jax.random.key(0), max_new_tokens=budgets)


def test_negative_prompt_lengths_are_refused():
    gen = Generator(make_model(0))
    with pytest.raises(ValueError, match=r"prompt_lengths\[1\] must be >= 1, got -1"):
        gen.bind(
            np.ones((2, 3), np.int32),
            key=jax.random.key(0),
            max_new_tokens=2,
            prompt_lengths=np.array([2, -1]),
        )


def test_batch_budgets_past_int32_are_refused(pair, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n')
    out = tmp_path / "out.jsonl"
    err = cli_refusal(batch_argv(pair, inp, out, "--max-new-tokens", "4294967299"), capsys)
    assert "--max-new-tokens must lie in [1, 2147483647], got 4294967299" in one_line(err)
    inp.write_text(
        '{"id": 1, "prompt": "a"}\n{"id": "x", "prompt": "b", "max_new_tokens": 2147483648}\n'
    )
    err = cli_refusal(batch_argv(pair, inp, out), capsys)
    assert "line 2: 'max_new_tokens' must be an integer in [1, 2147483647]" in one_line(err)
    assert not out.exists()


# ------------------------------------------------------------- NaN weights, exit 0


@pytest.fixture(scope="module")
def nan_target(pair, tmp_path_factory):
    """The pair's target with NaN in one tensor (as a corrupt download or bad quantization
    leaves it): a same-size file that loads cleanly."""
    path = tmp_path_factory.mktemp("nan") / "target"
    shutil.copytree(pair / "target", path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.slow
def test_generate_refuses_output_of_nan_weights(pair, nan_target, capsys):
    argv = ["generate", "def f", "--target", str(nan_target), "--draft", str(pair / "draft")]
    err = cli_refusal([*argv, "--max-new-tokens", "3"], capsys)
    assert "NaN/inf logits met for prompt(s) [1]" in one_line(err)
    assert capsys.readouterr().out == ""


def test_batch_refuses_rows_of_nan_weights(pair, nan_target, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "x = 1"}\n')
    out = tmp_path / "out.jsonl"
    argv = batch_argv(pair, inp, out)
    argv[argv.index("--target") + 1] = str(nan_target)
    err = cli_refusal(argv, capsys)  # after the progress bar: one line
    assert 'NaN/inf logits met for id(s) "a" (line 1)' in err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert not out.exists() or out.read_text() == ""
    assert not (tmp_path / "out.jsonl.job.json").exists()  # the path stays free


# ------------------------------------------------- damaged weights files are named


def damage(file, how):
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif how == "random":
        file.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif how == "lfs-pointer":
        file.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\n")
    else:
        file.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "random", "lfs-pointer", "empty"])
def test_damaged_safetensors_are_one_line_naming_the_file(pair, tmp_path, capsys, how):
    model = tmp_path / "target"
    shutil.copytree(pair / "target", model)
    damage(model / "model.safetensors", how)
    with pytest.raises(ValueError, match=str(model / "model.safetensors")):
        load_model(model)
    argv = ["generate", "x", "--target", str(model), "--draft", "ngram"]
    assert str(model / "model.safetensors") in one_line(cli_refusal(argv, capsys))


def test_damaged_head_weights_name_the_file(pair, tmp_path):
    head = tiny_head(pair, tmp_path / "head")
    damage(head / "model.safetensors", "truncated")
    with pytest.raises(ValueError, match=f"{head / 'model.safetensors'}: not a readable"):
        load_head(head)


def tiny_head(pair, path, vocab_map=None):
    from flax import nnx

    from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig

    config = FeatureHeadConfig.for_target(load_model(pair / "target").config, 8)
    head = FeatureHead(config, rngs=nnx.Rngs(2), init_scale=0.3)
    if vocab_map is not None:
        head.vocab_map.set_value(np.asarray(vocab_map, np.int32))
    save_head(head, path)
    return path


def test_vocab_map_duplicates_are_refused(pair, tmp_path):
    head = tiny_head(pair, tmp_path / "head", vocab_map=[0, 1, 2, 3, 4, 5, 5, 7])
    with pytest.raises(ValueError, match="vocab_map lists token 5 more than once"):
        load_head(head)


# ------------------------------------------------------------------- num_heads 0


def test_zero_heads_are_a_config_error_not_a_division(pair, tmp_path):
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1, got 0"):
        TransformerConfig.llama(num_heads=0)
    model = tmp_path / "target"
    shutil.copytree(pair / "target", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(ValueError, match=rf"{model / 'config.json'}: .*num_heads .* got 0"):
        load_model(model)
    gguf = write_gguf(tmp_path / "zero.gguf", "llama", "F32", head_count=0)
    with pytest.raises(ValueError, match=r"zero.gguf: metadata .*num_heads"):
        load_model(gguf)


def test_missing_gguf_tensor_is_named_as_in_the_file(tmp_path):
    gguf = write_gguf(tmp_path / "m.gguf", "llama", "F32", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"m.gguf: missing tensors blk\.1\.ffn_up\.weight$"):
        load_model(gguf)


# ------------------------------------------------------- convert over a model


def test_convert_refuses_a_directory_holding_a_model(tmp_path, capsys):
    from jax_specdec.cli import main

    gguf = write_gguf(tmp_path / "m.gguf", "llama", "F32")
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("another model")
    assert main(["convert", str(gguf), str(out)]) == 0  # a README alone is no model
    weights = (out / "model.safetensors").read_bytes()
    other = write_gguf(tmp_path / "other.gguf", "llama", "F32", seed=5)
    err = one_line(cli_refusal(["convert", str(other), str(out)], capsys))
    assert f"output {out} already holds a model (config.json, model.safetensors" in err
    assert "--force" in err and (out / "model.safetensors").read_bytes() == weights
    assert main(["convert", str(other), str(out), "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() != weights
    with pytest.raises(ValueError, match="already holds a model"):
        convert_gguf(other, out)


# ------------------------------------------------- batch rows checked up front


def test_batch_row_past_the_context_is_named_and_skippable(pair, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    rows = [{"id": 1, "prompt": "x = 1"}, {"id": "long", "tokens": [5] * 126}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    err = one_line(cli_refusal(batch_argv(pair, inp, out), capsys))
    assert 'line 2 (id "long"): its prompt of 126 tokens and max_new_tokens 4 exceed' in err
    assert "context of 128 tokens" in err and not out.exists()
    err = one_line(cli_refusal(batch_argv(pair, inp, out, "--max-new-tokens", "128"), capsys))
    assert "--max-new-tokens 128 leaves no room for a prompt" in err
    from jax_specdec.cli import main

    assert main(batch_argv(pair, inp, out, "--on-error", "skip")) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1]
    errors = (tmp_path / "out.jsonl.errors.jsonl").read_text()
    assert json.loads(errors)["line"] == 2


def job_row(i, prompt, budget):
    return JobRow(i, i + 1, (1,) * prompt, i, SamplingConfig(), budget)


def test_a_call_never_mixes_a_long_prompt_with_a_long_budget():
    rows = [job_row(0, 10, 100), job_row(1, 20, 5), job_row(2, 100, 20), job_row(3, 30, 90)]
    plan = plan_batches(rows, 16, by_budget=False, max_len=128)
    assert [[r.id for r in call] for call in plan] == [[0, 1], [3], [2]]
    for call in plan:
        assert max(len(r.tokens) for r in call) + max(r.max_new_tokens for r in call) <= 128
    # The rows after a cut are planned as before (a restart writes the same calls).
    assert plan_batches(rows[2:], 16, by_budget=False, max_len=128) == plan[1:]


# ------------------------------------------- the job file is written with the first row


def fake_output(batch: int):
    stats = types.SimpleNamespace(
        nonfinite=np.zeros(batch, bool),
        slot_rounds=batch,
        **{k: np.ones(batch, int) for k in ("rounds", "drafted", "accepted", "rejected")},
    )
    return types.SimpleNamespace(
        tokens=np.ones((batch, 2), int), lengths=np.full(batch, 2), stats=stats
    )


def test_a_job_that_failed_before_any_row_leaves_its_output_free(tmp_path):
    rows = [job_row(i, 3, 2) for i in range(3)]
    out = tmp_path / "out.jsonl"

    def failing(prompts, keys, sampling, budgets):
        raise JobError("the first call failed")

    with pytest.raises(JobError, match="first call failed"):
        run_job(rows, out, generate=failing, job={"seed": 1}, batch_size=2, progress=False)
    assert not (tmp_path / "out.jsonl.job.json").exists()
    working = lambda prompts, keys, sampling, budgets: fake_output(len(prompts))  # noqa: E731
    summary = run_job(rows, out, generate=working, job={"seed": 2}, batch_size=2, progress=False)
    assert summary["rows_run"] == 3 and len(out.read_text().splitlines()) == 3
    assert json.loads((tmp_path / "out.jsonl.job.json").read_text()) == {"seed": 2}
    with pytest.raises(JobError, match="belongs to a different job"):
        run_job(rows, out, generate=working, job={"seed": 1}, batch_size=2, progress=False)


# ------------------------------------------------------------------ minor flags


@pytest.mark.parametrize("seed", [str(2**70), "-1"])
def test_generate_seed_outside_63_bits_is_refused(pair, seed, capsys):
    argv = ["generate", "x", *model_args(pair), f"--seed={seed}"]
    assert f"--seed must lie in [0, 2**63), got {seed}" in one_line(cli_refusal(argv, capsys))


def test_batch_rows_per_call_zero_is_refused(pair, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n')
    argv = batch_argv(pair, inp, tmp_path / "out.jsonl", "--rows-per-call", "0")
    assert "--rows-per-call must lie in [1, " in one_line(cli_refusal(argv, capsys))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--n", "0"], "--n must lie in [1, 65536], got 0"),
        (["--stop", ""], "--stop must not hold an empty string"),
    ],
)
def test_batch_n_zero_and_an_empty_stop_are_refused(pair, tmp_path, capsys, flags, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n')
    out = tmp_path / "out.jsonl"
    assert message in one_line(cli_refusal(batch_argv(pair, inp, out, *flags), capsys))
    assert not out.exists() and not (tmp_path / "out.jsonl.job.json").exists()


def test_prompt_file_with_bad_utf8_is_named(pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"def f():\nx = '\xff\xfe'\n")
    argv = ["generate", "--prompt-file", str(prompts), *model_args(pair)]
    assert f"{prompts} line 2 is not valid UTF-8" in one_line(cli_refusal(argv, capsys))
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "\xff"}\n')
    err = cli_refusal(batch_argv(pair, inp, tmp_path / "out.jsonl"), capsys)
    assert "line 2: not valid UTF-8" in one_line(err)


def test_tokenizer_mismatch_with_a_gguf_draft_names_the_file(pair, tmp_path, capsys):
    draft = write_gguf(tmp_path / "draft.gguf", "llama", "F32")
    argv = ["generate", "x", "--target", str(pair / "target"), "--draft", str(draft)]
    err = one_line(cli_refusal(argv, capsys))
    assert f"the draft's tokenizer ({draft}) differs from the target's" in err


# ------------------------------------------------------- found by the sweep


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--output", "/nonexistent/dir/out.jsonl"], "--output: the directory /nonexistent/dir"),
        (["--output", "/"], "--output: / is a directory"),
        (["--errors", "/"], "--errors: / is a directory"),
        (["--mesh", "0x1"], "each axis needs at least one device"),
        (["-k", "500"], "--num-draft-tokens 500 must be below the models' context of 128"),
    ],
    ids=["output-dir-missing", "output-is-dir", "errors-is-dir", "mesh-0", "gamma"],
)
def test_batch_flags_found_by_the_sweep(pair, tmp_path, capsys, extra, match):
    """A missing output directory used to fail after the first call, with a traceback; a
    --mesh axis of 0 was an IndexError; a γ past the context compiled without end."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n')
    assert match in one_line(cli_refusal([*batch_argv(pair, inp, tmp_path / "o"), *extra], capsys))


def test_generate_draft_length_past_the_context_is_refused(pair, capsys):
    argv = ["generate", "x", *model_args(pair), "-k", "100000", "--max-new-tokens", "3"]
    assert "--num-draft-tokens 100000 must be below" in one_line(cli_refusal(argv, capsys))


def test_a_byte_order_mark_starts_a_batch_input(tmp_path):
    from jax_specdec.batch import read_rows

    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'\xef\xbb\xbf{"id": 1, "tokens": [1, 2]}\n')
    rows, _ = read_rows(
        inp, tokenizer=None, vocab_size=9, job_seed=0, sampling=SamplingConfig(), max_new_tokens=2
    )
    assert [r.tokens for r in rows] == [(1, 2)]


def test_loaders_found_by_the_sweep(pair, tmp_path):
    from jax_specdec.io.hf import load_tokenizer

    model = tmp_path / "target"
    shutil.copytree(pair / "target", model)
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{model / 'tokenizer.json'} is not a readable"):
        load_tokenizer(model)  # was a bare Exception from tokenizers
    with pytest.raises(ValueError, match="^dtype must be float32 or bfloat16, got 'float64'$"):
        load_model(pair / "target", dtype="float64")
    with pytest.raises(ValueError, match="is a file but not a .gguf"):
        load_model(model / "config.json")


def train_argv(tmp_path, pair, *extra):
    argv = ["train", "--preset", "tiny", "--steps", "2", "--warmup-steps", "0", "--seq-len", "16"]
    argv += ["--batch-size", "1", "--eval-every", "1", "--out", str(tmp_path / "m")]
    return [*argv, "--tokenizer", str(pair / "target" / "tokenizer.json"), *extra]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--tokenizer", "/nonexistent.json"], "tokenizer file /nonexistent.json does not exist"),
        (["--tokenizer", "BAD"], "is not a readable tokenizer.json"),
        (["--out", "FILE"], "is a file, not a directory"),
        (["--seed", "-1"], "seed must lie in [0, 2**32), got -1"),
        (["--learning-rate", "inf"], "learning_rate must be a finite number > 0, got inf"),
        (["--seq-len", str(2**40)], "seq_len must be an integer in [1, 2147483647]"),
    ],
    ids=["tokenizer-missing", "tokenizer-corrupt", "out-is-file", "seed", "lr-inf", "seq-len"],
)
def test_train_flags_found_by_the_sweep(pair, tmp_path, capsys, extra, match):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "BAD").write_text("{not json")
    extra = [str(tmp_path / e) if e in ("FILE", "BAD") else e for e in extra]
    assert match in one_line(cli_refusal(train_argv(tmp_path, pair, *extra), capsys))


def test_train_vocab_size_below_the_bytes_is_refused(tmp_path, capsys):
    argv = ["train", "--preset", "tiny", "--vocab-size", "0", "--out", str(tmp_path / "m")]
    assert "vocab_size must be >= 257" in one_line(cli_refusal(argv, capsys))


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line(pair, tmp_path, capsys):
    from jax_specdec.cli import main

    assert main(train_argv(tmp_path, pair)) == 0
    err = one_line(cli_refusal(train_argv(tmp_path, pair, "--preset", "draft"), capsys))
    assert f"{tmp_path / 'm' / 'checkpoints'} holds a checkpoint (step 2) of another" in err


def test_train_drafter_missing_target_is_one_line(tmp_path, capsys):
    argv = ["train-drafter", "--target", "/nonexistent", "--out", str(tmp_path / "h")]
    assert "--target: /nonexistent is not a model directory" in one_line(cli_refusal(argv, capsys))


def test_generator_refuses_a_gamma_past_the_context_and_a_pad_outside_the_vocabulary():
    """A γ at or past the target's context compiled one branch per width without end; any
    pad_token_id was taken."""
    from helpers import make_model

    from jax_specdec import Generator, NGram

    target = make_model(0)  # max_len 128
    with pytest.raises(ValueError, match=r"largest γ \(128\) must be below the target's context"):
        Generator(target, NGram(), schedule=128)
    for pad in (-1, 6, 2**40):
        with pytest.raises(ValueError, match="pad_token_id"):
            Generator(target, pad_token_id=pad)
