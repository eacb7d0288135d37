"""`jax-specdec generate` on small model directories built here."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import cli_refusal

from jax_specdec import SamplingConfig, speculative_generate
from jax_specdec.cli import main
from jax_specdec.io.draft import context, load_pair
from jax_specdec.io.hf import load_model, load_tokenizer


def run_json(pair, *args):
    argv = ["generate", "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--json"]
    return argv + list(args)


@pytest.mark.slow
def test_generate_json_is_reproducible(pair, capsys):
    args = run_json(
        pair, "def f(x):", "--max-new-tokens", "12", "--temperature", "1", "--seed", "3", "-k", "4"
    )  # a fixed width: the reference below is a γ = 4 chain
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["outputs"] == second["outputs"]
    out = first["outputs"][0]
    assert out["prompt"] == "def f(x):" and len(out["tokens"]) <= 12
    # The figures are those of the library call with the same settings.
    target, draft = load_model(pair / "target"), load_model(pair / "draft")
    tokenizer = load_tokenizer(pair / "target")
    ids = tokenizer.encode("def f(x):").ids
    lib = speculative_generate(
        target,
        draft,
        [ids],
        key=jax.random.key(3),
        max_new_tokens=12,
        num_draft_tokens=4,
        sampling=SamplingConfig(1.0),
        eos_token_id=tokenizer.token_to_id("<|endoftext|>"),
    )
    assert out["tokens"] == np.asarray(lib.tokens)[0, : int(lib.lengths[0])].tolist()
    assert first["stats"]["alpha"] == lib.stats.alpha


@pytest.mark.slow
def test_generate_n_samples_and_stop_strings(pair, capsys):
    """--n 2: sample 0 is the lone sample's row, sample 1 the row of the seed derived from
    the seed and 1 alone; --stop cuts the text (finish_reason "stop", with "stop"). At a
    fixed width: with auto the widths, so the tokens (not their distribution), follow the
    costs measured for each batch size."""
    from jax_specdec.batch.input import sample_seed

    base = run_json(pair, "def f(x):", "--max-new-tokens", "10", "--temperature", "1", "-k", "4")
    base += ["--eos", "none"]
    assert main([*base, "--seed", "3", "--n", "2"]) == 0
    two = json.loads(capsys.readouterr().out)["outputs"]
    assert [o["sample"] for o in two] == [0, 1] and two[0]["tokens"] != two[1]["tokens"]
    assert main([*base, "--seed", str(sample_seed(3, 1))]) == 0
    (second,) = json.loads(capsys.readouterr().out)["outputs"]
    assert "sample" not in second and second == {k: v for k, v in two[1].items() if k != "sample"}
    text = two[0]["text"]
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable() and c not in text[:1])
    assert main([*base, "--seed", "3", "--stop", "\x00never", "--stop", stop]) == 0
    (cut,) = json.loads(capsys.readouterr().out)["outputs"]
    assert (cut["text"], cut["finish_reason"], cut["stop"]) == (
        text[: text.find(stop)],
        "stop",
        stop,
    )
    assert cut["tokens"] == two[0]["tokens"][: len(cut["tokens"])]
    assert two[0]["finish_reason"] == "length" and "stop" not in two[0]
    # --logprobs 3 --logprob-kind raw: the same tokens, an entry per token, the emitted
    # token among its top 3 where it is the most likely
    assert main([*base, "--seed", "3", "--logprobs", "3", "--logprob-kind", "raw"]) == 0
    (scored,) = json.loads(capsys.readouterr().out)["outputs"][:1]
    assert scored["tokens"] == two[0]["tokens"] and len(scored["logprobs"]) == 10
    for entry, token in zip(scored["logprobs"], scored["tokens"], strict=True):
        assert len(entry["top"]) == 3 and entry["logprob"] <= entry["top"][0][1] + 1e-6
        assert (entry["top"][0][0] == token) == (entry["logprob"] >= entry["top"][0][1] - 1e-6)


@pytest.mark.slow
def test_generate_compare_greedy_matches_autoregressive(pair, capsys):
    assert (
        main(run_json(pair, "import os\n", "--max-new-tokens", "10", "--compare", "--eos", "none"))
        == 0
    )
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["same_text_as_autoregressive"] is True
    assert stats["speedup"] == pytest.approx(stats["autoregressive_seconds"] / stats["seconds"])
    # The default is auto: what it chose, from which costs, and the setup it took.
    rounds = stats["rounds_per_width"]
    assert set(rounds) <= {"0", "1", "2", "3", "4", "6", "8"} and sum(rounds.values()) > 0
    costs = stats["round_costs"]
    assert costs["source"] in ("measured", "cache") and len(costs["seconds_per_round"]) == 7
    assert len(costs["acceptance_prior"]) == 8 and stats["setup_seconds"] > 0


def test_generate_prompt_file_and_plain_output(pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("class A:\\n    def\nfor i in\n")
    argv = [
        "generate",
        "--target",
        str(pair / "target"),
        "--draft",
        str(pair / "draft"),
        "--prompt-file",
        str(prompts),
        "--max-new-tokens",
        "5",
        "-k",
        "2",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.count("-" * 60) == 2
    assert captured.out.startswith("class A:\n    def")
    assert "tokens/round" in captured.err and "auto:" not in captured.err  # -k 2


@pytest.mark.parametrize(
    "extra,message",
    [
        (["x", "--target", "/nonexistent"], "not a model directory"),
        (["x", "--draft", "OTHER"], "tokenizer"),
        ([""], "prompt is empty"),
        (["x", "--temperature", "-1"], "temperature"),
        (["x", "--top-p", "2"], "top_p"),
        (["x", "--min-p", "1"], "min_p"),
        (["x", "--repetition-penalty", "0"], "repetition_penalty"),
        (["x", "--logit-bias", "5=1"], "--logit-bias must be ID:BIAS"),
        (["x", "--max-new-tokens", "5000"], "max_len"),
        (["x", "-k", "0"], "--num-draft-tokens must be 'auto' or an integer >= 1, got '0'"),
        (["x", "-k", "fast"], "--num-draft-tokens must be 'auto' or an integer >= 1"),
        (["x", "--n", "0"], "--n must lie in [1, 65536], got 0"),
        (["x", "--n", "-3"], "--n must lie in [1, 65536], got -3"),
        (["x", "--stop", "a", "--stop", ""], "--stop must not hold an empty string"),
        (["x", "--logprobs", "21"], "--logprobs must lie in [0, 20], got 21"),
        (["x", "--logprobs", "2"], "--logprobs needs --json"),
    ],
)
def test_generate_bad_input_one_line_exit_2(pair, extra, message, capsys):
    extra = [str(pair / "other") if e == "OTHER" else e for e in extra]
    argv = ["generate", "--target", str(pair / "target"), "--draft", str(pair / "draft"), *extra]
    err = cli_refusal(argv, capsys)
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def test_console_script_bad_input_one_line_exit_2(pair):
    """The same refusal through a real process (the installed module's entry point)."""
    argv = ["generate", "--target", str(pair / "target"), "x", "--top-p", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "jax_specdec.cli", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def sweep(target, draft, out, temperatures, capsys, extra=()):
    """A small sweep (batch 2, γ 2, 6 tokens) through the CLI: (printed table, JSON)."""
    prompts = out.parent / "prompts.txt"
    prompts.write_text("def f(x):\\n    return\nimport os\nclass A:\n")
    argv = ["sweep", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    argv += ["--batches", "2", "--temperatures", temperatures, "--gammas", "2"]
    argv += ["--max-gamma", "2", "--max-new-tokens", "6", "--repeats", "1"]
    assert main([*argv, *extra, "--out", str(out)]) == 0
    return capsys.readouterr().out, json.loads((out / "sweep.json").read_text())


@pytest.mark.slow
def test_sweep_writes_json_plots_and_table(pair, tmp_path, capsys):
    out = tmp_path / "sweep"
    table, results = sweep(pair / "target", pair / "draft", out, "0,1", capsys)
    assert "| batch | T | best constant γ |" in table and "exploring" not in table
    rows = results["rows"]
    # Per temperature: autoregressive, constant γ=2, heuristic, confidence, cost model, n-gram.
    assert len(rows) == 2 * 6
    assert {r["schedule"] for r in rows} == {
        "autoregressive",
        "constant",
        "heuristic",
        "confidence",
        "cost_model",
        "ngram",
    }
    greedy = [r for r in rows if r["temperature"] == 0 and r["schedule"] != "autoregressive"]
    assert all(r["same_tokens_as_autoregressive"] for r in greedy)
    assert len(results["switch"]) == 1 and results["switch"][0]["rounds"][0] > 0
    costs = results["costs"][0]
    assert len(costs["verify_ms"]) == 3
    # Rounds calibrated per temperature, γ = 0 … 2, all positive.
    assert all(len(costs[f"round_ms_t{t}"]) == 3 for t in (0, 1))
    assert min(costs["round_ms_t0"] + costs["round_ms_t1"]) > 0
    for name in [
        "acceptance_per_position.png",
        "tokens_per_round.png",
        "speedup_vs_gamma.png",
        "measured_vs_predicted.png",
        "sweep.md",
    ]:
        assert (out / name).stat().st_size > 100, name


@pytest.mark.slow
def test_sweep_takes_a_feature_head(pair, tmp_path, capsys):
    """A head has no confidence schedule: the sweep times the rest, and its draft step;
    with --explore, the exploring cost model beside the plain one."""
    from flax import nnx

    from jax_specdec.decode import as_drafter
    from jax_specdec.io.heads import save_head, tokenizer_sha256
    from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
    from jax_specdec.schedules import Constant

    target, tokenizer = load_model(pair / "target"), load_tokenizer(pair / "target")
    config = FeatureHeadConfig.for_target(
        target.config, 64, tokenizer_sha256=tokenizer_sha256(tokenizer)
    )
    head = FeatureHead(config, rngs=nnx.Rngs(2), init_scale=0.3)
    head.vocab_map.set_value(np.arange(64, dtype=np.int32) * 3)
    save_head(head, tmp_path / "head")
    # as a Ray job's driver loads it: the head attached to the target's shapes only
    shapes = load_pair(str(pair / "target"), str(tmp_path / "head"), weights=False)
    attached = as_drafter(shapes.draft, shapes.target, schedule=Constant(4)).model
    assert isinstance(attached.embed.get_value(), jax.ShapeDtypeStruct)
    assert context(shapes.target, shapes.draft) == context(target, shapes.draft)
    out = tmp_path / "sweep"
    extra = ["--explore", "1", "--trees", "4:2:2"]
    table, results = sweep(pair / "target", tmp_path / "head", out, "0", capsys, extra)
    names = {r["schedule"] for r in results["rows"]}
    assert names == {
        "autoregressive",
        "constant",
        "heuristic",
        "cost_model",
        "cost_model_explore",
        "ngram",
        "tree 4:2:2",
    }
    assert results["settings"]["explore"] == 1.0 and "exploring (mean γ)" in table
    assert all(r.get("same_tokens_as_autoregressive", True) for r in results["rows"])
    (constant,) = [r for r in results["rows"] if r["schedule"] == "constant"]
    assert constant["gamma_rounds"][2] > 0  # the head drafted
    assert results["costs"][0]["draft_step_ms"] > 0
    assert "—" in table and "—" in (out / "sweep.md").read_text()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--gammas", "0"], "--gammas"),
        (["--gammas", "4", "--max-gamma", "2"], "--max-gamma"),
        (["--temperatures", "-1"], "--temperatures"),
        (["--threshold", "2"], "--threshold"),
        (["--explore", "-1"], "--explore"),
        (["--explore", "nan"], "--explore"),
        (["--trees", "4:5:2"], "--trees"),
        (["--seed", "-1"], "--seed"),
        (["--out", __file__], "--out"),
        (["--batches", str(2**40)], "--batches must be at most 4096"),
        (["--trees", "8:2:2"], "--trees needs a feature head"),
        (["--target", "/nonexistent"], "nonexistent"),
        (["--prompts", "/nonexistent.txt"], "nonexistent"),
    ],
)
def test_sweep_bad_input(pair, args, match, capsys):
    argv = ["sweep", "--target", str(pair / "target"), "--draft", str(pair / "draft")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generate_help_names_the_real_model_gguf_and_ngram(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out[out.index("options:") :].split())  # argparse wraps lines
    target = text[text.index("--target TARGET") : text.index("--draft DRAFT")]
    draft = text[text.index("--draft DRAFT") : text.index("--max-new-tokens")]
    assert "smollm2-135m" in target and ".gguf" in target
    assert "ngram" in draft and ".gguf" in draft


def test_sweep_times_the_exploring_cost_model_with_its_explore():
    from jax_specdec.schedules import CostModel
    from jax_specdec.sweep.run import _schedules, run_sweep

    cost = CostModel(draft_cost=0.0, verify_costs=(1.0, 1.2, 1.4))
    rows = {name: s for name, _, _, s in _schedules([1, 2], 2, 0.4, cost, None, 1.5)}
    assert rows["cost_model"].explore == 0.0 and rows["cost_model_explore"].explore == 1.5
    assert rows["cost_model_explore"].verify_costs == cost.verify_costs
    assert "cost_model_explore" not in {r[0] for r in _schedules([1, 2], 2, 0.4, cost, None, 0.0)}
    with pytest.raises(ValueError, match="explore"):
        run_sweep(None, None, [[1, 2]], gammas=(1,), max_gamma=2, explore=float("nan"))


def test_the_auto_line_says_what_was_chosen_and_from_where():
    from jax_specdec.cli.generate import _auto_line

    summary = {
        "rounds_per_width": {0: 3, 2: 10},
        "round_costs": {"source": "measured", "measuring_seconds": 12.34, "drafts": True},
        "setup_seconds": 40.0,
    }
    line = _auto_line(summary)
    assert line.startswith("auto: rounds per draft width {0: 3, 2: 10}")
    assert "measured in 12.3 s, cached" in line and "compiling and measuring 40.0 s" in line
    summary["round_costs"]["source"] = "cache"
    del summary["setup_seconds"]
    assert "read from the cache" in _auto_line(summary) and "compiling" not in _auto_line(summary)
    summary |= {"rounds_per_width": {0: 13}}
    summary["round_costs"]["drafts"] = False  # autoregressive decoding's program ran
    line = _auto_line(summary)
    assert line.startswith("auto: no draft width pays at the first round")
    assert "autoregressive decoding's program, 13 steps" in line
