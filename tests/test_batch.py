"""`jax-specdec batch`: a resumable JSONL job whose rows depend only on seed and id."""

import json
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jax_specdec.batch import derive_seed, seed_key_data
from jax_specdec.cli import main
from jax_specdec.cli.batch import INTERRUPTED

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def", "for i in range(", "x = [", "if a:"]


def write_input(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_rows(n=10):
    rows = []
    for i in range(n):
        row = {"id": f"r{i}" if i % 3 else i, "prompt": PROMPTS[i % len(PROMPTS)]}
        if i == 4:
            row = {"id": "tok", "tokens": [5, 6, 7, 8, 9, 10, 11]}
        if i == 5:
            row["seed"] = 12345
        if i == 7:
            row["temperature"] = 0.5
            row["max_new_tokens"] = 6
        rows.append(row)
    return rows


def run(pair, inp, out, *extra):
    argv = ["batch", "--target", str(pair / "target"), "--draft", str(pair / "draft")]
    argv += ["--input", str(inp), "--output", str(out), "--max-new-tokens", "10"]
    argv += ["--temperature", "1", "--seed", "3", *extra]
    return main(argv)


def by_id(path):
    return {json.dumps(r["id"]): r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_rows_do_not_depend_on_slots_batch_size_or_order(pair, tmp_path, capsys):
    rows = job_rows()
    inp = write_input(tmp_path / "in.jsonl", rows)
    assert run(pair, inp, tmp_path / "a.jsonl", "--slots", "3") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows_run"] == 10
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    inp2 = write_input(tmp_path / "in2.jsonl", shuffled)
    assert run(pair, inp2, tmp_path / "b.jsonl", "--fixed-batches", "--batch-size", "4") == 0
    fixed = json.loads(capsys.readouterr().out)
    a, b = by_id(tmp_path / "a.jsonl"), by_id(tmp_path / "b.jsonl")
    assert a.keys() == b.keys() and len(a) == 10
    for k in a:
        assert a[k]["tokens"] == b[k]["tokens"] and a[k]["seed"] == b[k]["seed"], k
    assert a['"r5"']["seed"] == 12345
    assert a["0"]["seed"] == derive_seed(3, 0) and a['"r1"']["seed"] == derive_seed(3, "r1")
    assert len(a['"r7"']["tokens"]) <= 6
    assert a['"r1"']["text"] and a['"r1"']["stats"]["generated"] == len(a['"r1"']["tokens"])
    # The summary adds up the rows' own counters.
    rows_stats = [r["stats"] for r in a.values()]
    assert summary["tokens"] == sum(s["generated"] for s in rows_stats)
    accepted = sum(s["accepted"] for s in rows_stats)
    assert summary["alpha"] == accepted / (accepted + sum(s["rejected"] for s in rows_stats))
    # Three slots are busier than fixed batches that wait for their slowest row.
    assert 0 < fixed["occupancy"] < summary["occupancy"] <= 1
    # Rows 0 and 6 share a prompt but not an id: different seeds, different samples.
    assert rows[0]["prompt"] == rows[6]["prompt"] and a["0"]["seed"] != a["6"]["seed"]
    assert a["0"]["tokens"] != a["6"]["tokens"]


SETTINGS = [
    {},
    {"temperature": 0},
    {"temperature": 0.7},
    {"top_p": 0.9},
    {"top_k": 5},
    {"min_p": 0.1},
    {"repetition_penalty": 1.3, "logit_bias": {"5": 2.0}},
    {"presence_penalty": 0.5, "frequency_penalty": 0.5, "temperature": 0.8},
]


@pytest.mark.slow
def test_a_job_of_mixed_settings_is_one_program_and_each_row_its_own(pair, tmp_path, capsys):
    """Rows of eight sampling settings (penalties and a logit bias among them) share the
    slots and one compiled generation program (as many as a job of one setting compiles);
    each row's tokens are those a job of its own setting writes for it."""
    from jax_specdec.decode import program

    rows = [{"id": i, "prompt": PROMPTS[i % len(PROMPTS)]} for i in range(10)]
    mixed = [{**r, **SETTINGS[i % len(SETTINGS)]} for i, r in enumerate(rows)]
    own = {}
    for k, setting in enumerate(SETTINGS[:2]):  # the job's default (T = 1), and greedy
        inp = write_input(tmp_path / f"own{k}.jsonl", [{**r, **setting} for r in rows])
        before = program.generate._cache_size()
        assert run(pair, inp, tmp_path / f"own{k}.out", "--slots", "3") == 0
        compiled = program.generate._cache_size() - before
        own[k] = by_id(tmp_path / f"own{k}.out")
    inp = write_input(tmp_path / "mixed.jsonl", mixed)
    before = program.generate._cache_size()
    assert run(pair, inp, tmp_path / "mixed.out", "--slots", "3") == 0
    capsys.readouterr()
    # Grouped by setting, it would compile one per plan.
    assert program.generate._cache_size() - before == compiled >= 1
    got = by_id(tmp_path / "mixed.out")
    for i in range(len(rows)):
        if i % len(SETTINGS) < 2:
            assert got[str(i)]["tokens"] == own[i % len(SETTINGS)][str(i)]["tokens"], i
    assert got["2"]["tokens"] != own[0]["2"]["tokens"]  # T = 0.7 is not T = 1


def test_seed_key_data_is_jax_random_key_for_32_bit_seeds():
    for seed in (0, 5, 2**32 - 1):
        key = jax.random.key_data(jax.random.key(seed))
        np.testing.assert_array_equal(seed_key_data(seed), np.asarray(key))
    assert seed_key_data(2**40 + 5).tolist() == [256, 5]
    assert derive_seed(0, "a") != derive_seed(0, "b") != derive_seed(1, "a")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_killed_job_restarts_to_the_uninterrupted_output(pair, tmp_path, sig):
    """SIGKILL, or Ctrl-C (the CLI stops between calls: one line, exit 130), mid-job; the
    same command again gives byte for byte the output of an uninterrupted run."""
    rows = [{"id": i, "prompt": PROMPTS[i % len(PROMPTS)]} for i in range(16)]
    inp = write_input(tmp_path / "in.jsonl", rows)
    full, cut = tmp_path / "full.jsonl", tmp_path / "cut.jsonl"
    slots = ["--slots", "2", "--rows-per-call", "2"]
    assert run(pair, inp, full, *slots) == 0
    argv = [sys.executable, "-m", "jax_specdec.cli", "batch", "--target", str(pair / "target")]
    argv += ["--draft", str(pair / "draft"), "--input", str(inp), "--output", str(cut)]
    argv += ["--max-new-tokens", "10", "--temperature", "1", "--seed", "3", *slots]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if cut.exists() and cut.read_text().count("\n") >= 4:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.communicate(timeout=300)[1]
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL, "the job should have been killed mid-run"
    else:
        assert proc.returncode == 130, err[-2000:]
        assert err.strip().splitlines()[-1] == INTERRUPTED and "Traceback" not in err
    lines = cut.read_text().count("\n")
    assert 4 <= lines < 16
    if sig == signal.SIGKILL:
        with open(cut, "a") as f:  # a torn last line, as a kill during a write leaves
            f.write('{"id": 9, "seed": 1, "tok')
    assert run(pair, inp, cut, *slots) == 0
    assert cut.read_text() == full.read_text()
    # Running it again finds every id finished and changes nothing.
    assert run(pair, inp, cut, "--fixed-batches", "--batch-size", "5") == 0
    assert cut.read_text() == full.read_text()


@pytest.mark.parametrize(
    "lines, match",
    [
        (
            ['{"id": 1, "prompt": "a"}', "{not json", '{"id": 2, "prompt": "b"}'],
            "line 2: not valid",
        ),
        (['{"prompt": "a"}'], "line 1: missing 'id'"),
        (['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}'], "line 2: duplicate id 1"),
        (['{"id": 1}'], "exactly one of 'prompt'"),
        (['{"id": 1, "tokens": [1, 99999]}'], "'tokens' must lie in"),
        (['{"id": 1, "prompt": "a", "temperature": -1}'], "line 1 (id 1): temperature"),
        (['{"id": "r", "prompt": "a", "top_p": 0}'], 'line 1 (id "r"): top_p'),
        (['{"id": 2, "prompt": "a", "top_k": -1}'], "line 1 (id 2): top_k"),
        (['{"id": 3, "prompt": "a", "min_p": 1}'], "line 1 (id 3): min_p"),
        (['{"id": 4, "prompt": "a", "repetition_penalty": 0}'], "(id 4): repetition_penalty"),
        (['{"id": 5, "prompt": "a", "presence_penalty": 3}'], "(id 5): presence_penalty"),
        (['{"id": 6, "prompt": "a", "logit_bias": {"99999": 1}}'], "(id 6): 'logit_bias' names"),
        (['{"id": 7, "prompt": "a", "logit_bias": {"x": 1}}'], "(id 7): logit_bias token ids"),
        (['{"id": 1, "prompt": "a", "colour": 3}'], "unknown field"),
        (['{"id": 1, "prompt": "a", "seed": -4}'], "'seed'"),
        (['{"id": 1, "prompt": "a"}', '{"id": 8, "prompt": "a", "n": 0}'], "line 2 (id 8): 'n'"),
        (['{"id": "s", "prompt": "a", "n": -2}'], "line 1 (id \"s\"): 'n' must be an integer"),
        (['{"id": 9, "prompt": "a", "n": 1.5}'], "(id 9): 'n' must be an integer in [1, 65536]"),
        (['{"id": 9, "prompt": "a", "n": "2"}'], "(id 9): 'n' must be an integer"),
        (['{"id": 9, "prompt": "a", "n": true}'], "(id 9): 'n' must be an integer"),
        (['{"id": 10, "prompt": "a", "stop": ""}'], "(id 10): 'stop' must not hold an empty"),
        (['{"id": 10, "prompt": "a", "stop": ["x", ""]}'], "(id 10): 'stop' must not hold an"),
        (['{"id": 11, "prompt": "a", "stop": 5}'], "(id 11): 'stop' must be a string or a list"),
        (['{"id": 11, "prompt": "a", "stop": ["x", 5]}'], "(id 11): 'stop' must be a string"),
        (['{"id": 12, "prompt": "a", "logprobs": -1}'], "(id 12): 'logprobs' must be an integer"),
        (['{"id": 12, "prompt": "a", "logprobs": 21}'], "'logprobs' must be an integer in [0, 20]"),
        (['{"id": 12, "prompt": "a", "logprobs": 1.5}'], "(id 12): 'logprobs' must be an"),
    ],
)
def test_bad_lines_stop_the_job_with_their_line_number(pair, tmp_path, capsys, lines, match):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exc:
        run(pair, inp, tmp_path / "out.jsonl")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_lines_can_be_skipped_and_listed(pair, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n{broken\n{"id": 1, "prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    assert run(pair, inp, out, "--on-error", "skip") == 0
    errors = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == [2, 3]
    assert "duplicate id" in errors[1]["error"]
    assert list(by_id(out)) == ["1"]
    assert json.loads(capsys.readouterr().out)["bad_lines"] == 2


def test_output_of_another_job_is_refused_and_kept(pair, tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}])
    out = tmp_path / "out.jsonl"
    assert run(pair, inp, out) == 0
    before = out.read_text()
    with pytest.raises(SystemExit):
        run(pair, inp, out, "--seed", "4")  # run() passes --seed 3 first; argparse keeps 4
    assert "belongs to a different job (seed differ" in capsys.readouterr().err
    stray = tmp_path / "stray.jsonl"
    stray.write_text('{"id": 1}\n')
    with pytest.raises(SystemExit):
        run(pair, inp, stray)
    assert "not an output of this tool" in capsys.readouterr().err
    other = write_input(tmp_path / "other.jsonl", [{"id": 2, "prompt": "b"}])
    with pytest.raises(SystemExit):
        run(pair, other, out)
    assert "not in the input" in capsys.readouterr().err
    assert out.read_text() == before


@pytest.mark.slow
def test_tree_rounds_in_a_batch_job_give_the_autoregressive_rows(pair, tmp_path, capsys):
    """Greedy: a job of n-gram trees writes the rows plain decoding writes; the tree is
    part of the job's identity."""
    inp = write_input(tmp_path / "in.jsonl", job_rows(6))
    base = ["--temperature", "0", "--slots", "2"]
    tree = ["--draft", "ngram", "--tree", "6", "-k", "3", *base]
    assert run(pair, inp, tmp_path / "tree.jsonl", *tree) == 0
    assert run(pair, inp, tmp_path / "ar.jsonl", "--autoregressive", *base) == 0
    capsys.readouterr()
    a, b = by_id(tmp_path / "tree.jsonl"), by_id(tmp_path / "ar.jsonl")
    assert a.keys() == b.keys() and all(a[k]["tokens"] == b[k]["tokens"] for k in a)
    assert json.loads((tmp_path / "tree.jsonl.job.json").read_text())["tree"] == "6:3:4"
    with pytest.raises(SystemExit):  # another tree: another job
        run(pair, inp, tmp_path / "tree.jsonl", *tree[:3], "8", *tree[4:])
    assert "tree differ" in capsys.readouterr().err
