"""`jax-specdec batch` rows of `n` samples and with `stop` strings: sample i's tokens depend
on the row's seed and i alone, a restarted job runs only the missing samples, and a stop
string cuts a row's text, tokens and finish reason on the host. Every job here runs calls
of 4 rows of 4-token prompts, so all of them share one compiled program."""

import json
import shutil

import pytest

from jax_specdec.batch import derive_seed
from jax_specdec.batch.input import sample_seed
from jax_specdec.batch.output import merge
from jax_specdec.cli import main
from jax_specdec.io.hf import load_tokenizer

BASE = [
    {"id": 0, "tokens": [5, 6, 7, 8]},
    {"id": 2, "tokens": [13, 14, 15, 16]},
    {"id": "x1", "tokens": [17, 18, 19, 20]},
    {"id": "x2", "tokens": [21, 22, 23, 24]},
]
SAMPLED = {"id": "a", "tokens": [9, 10, 11, 12]}


def write_input(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(pair, inp, out, *extra):
    argv = ["batch", "--target", str(pair / "target"), "--draft", str(pair / "draft")]
    argv += ["--input", str(inp), "--output", str(out), "--max-new-tokens", "10"]
    argv += ["--temperature", "1", "--seed", "3", "--eos", "none", "--slots", "2"]
    return main([*argv, "--rows-per-call", "4", *extra])


def lines(path):
    return path.read_text().splitlines()


def by_key(path):
    return {(r["id"], r.get("sample")): r for r in map(json.loads, lines(path))}


def with_n(n):
    """BASE with the row "a" of n samples and row 2 of n = 1 (given)."""
    return [BASE[0], {**SAMPLED, "n": n}, {**BASE[1], "n": 1}, *BASE[2:]]


@pytest.fixture(scope="module")
def jobs(pair, tmp_path_factory):
    """The outputs of: BASE (no n), with_n(4), with_n(8) (4 + 8 + 12 rows, calls of 4)."""
    root = tmp_path_factory.mktemp("samples")
    outs = {}
    for name, rows in (("base", BASE), ("n4", with_n(4)), ("n8", with_n(8))):
        inp = write_input(root / f"{name}.in.jsonl", rows)
        assert run(pair, inp, root / f"{name}.jsonl") == 0
        outs[name] = root / f"{name}.jsonl"
    return outs


@pytest.mark.slow
def test_sample_i_depends_on_the_row_seed_and_i_only(jobs):
    n4, n8 = by_key(jobs["n4"]), by_key(jobs["n8"])
    seed = derive_seed(3, "a")
    assert [n8[("a", i)]["seed"] for i in range(8)] == [sample_seed(seed, i) for i in range(8)]
    assert n8[("a", 0)]["seed"] == seed and len({n8[("a", i)]["seed"] for i in range(8)}) == 8
    for i in range(4):
        assert n4[("a", i)] == n8[("a", i)], i
    assert ("a", 4) not in n4 and len(n4) == 8 and len(n8) == 12
    assert len({tuple(n8[("a", i)]["tokens"]) for i in range(8)}) > 1  # T = 1: they differ
    # One process writes a row's samples in order, in the call order of other rows.
    samples = [json.loads(t).get("sample") for t in lines(jobs["n8"])]
    assert [s for s in samples if s is not None][:8] == list(range(8))


def test_one_sample_is_the_line_without_n(jobs):
    base, n4 = lines(jobs["base"]), by_key(jobs["n4"])
    first = [t for t in lines(jobs["n4"]) if json.loads(t)["id"] == 0]
    assert first == [base[0]] and "sample" not in json.loads(base[0])  # byte for byte
    row2 = next(json.loads(t) for t in base if json.loads(t)["id"] == 2)
    assert n4[(2, 0)] == {"id": 2, "sample": 0, **row2}  # "n": 1 given: named sample 0
    assert list(n4[(2, 0)]) == ["id", "sample", "seed", "tokens", "text", "finish_reason", "stats"]


def test_a_restarted_job_runs_only_the_missing_samples(pair, jobs, tmp_path, capsys):
    inp = write_input(tmp_path / "n8.in.jsonl", with_n(8))
    cut = tmp_path / "cut.jsonl"
    shutil.copy(jobs["n8"].with_name("n8.jsonl.job.json"), tmp_path / "cut.jsonl.job.json")
    full = jobs["n8"].read_text()
    cut.write_text("".join(full.splitlines(keepends=True)[:4]) + '{"id": "a", "sam')
    capsys.readouterr()
    assert run(pair, inp, cut) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["rows_run"], summary["rows_skipped_as_finished"]) == (8, 4)
    assert cut.read_text() == full
    # The output of n = 4 grows to the output of n = 8: only samples 4..7 run.
    grown = tmp_path / "grown.jsonl"
    shutil.copy(jobs["n4"], grown)
    shutil.copy(jobs["n4"].with_name("n4.jsonl.job.json"), tmp_path / "grown.jsonl.job.json")
    assert run(pair, inp, grown) == 0
    assert json.loads(capsys.readouterr().out)["rows_run"] == 4
    assert by_key(grown) == by_key(jobs["n8"])


def test_the_job_flag_n_names_every_row_and_is_part_of_the_job(pair, jobs, tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", [BASE[0], {**SAMPLED, "n": 4}])
    out = tmp_path / "flag.jsonl"
    assert run(pair, inp, out, "--n", "3") == 0
    got, n4 = by_key(out), by_key(jobs["n4"])
    assert sorted(got, key=str) == sorted(
        [(0, 0), (0, 1), (0, 2), *(("a", i) for i in range(4))], key=str
    )
    assert got[(0, 0)] == {"id": 0, "sample": 0, **n4[(0, None)]}
    assert got[("a", 3)] == n4[("a", 3)]
    assert json.loads((tmp_path / "flag.jsonl.job.json").read_text())["defaults"]["n"] == 3
    assert "n" not in json.loads(jobs["n4"].with_name("n4.jsonl.job.json").read_text())["defaults"]
    with pytest.raises(SystemExit):
        run(pair, inp, out, "--n", "2")
    assert "belongs to a different job (defaults differ" in capsys.readouterr().err


def test_merge_keeps_a_rows_samples_in_order(tmp_path):
    out = tmp_path / "out.jsonl"
    rows = [{"id": "b", "sample": 2}, {"id": 1}, {"id": "b", "sample": 0}, {"id": "b", "sample": 1}]
    write_input(out, rows)
    merge(out)
    merged = [json.loads(t) for t in lines(out)]
    assert [r.get("sample") for r in merged if r["id"] == "b"] == [0, 1, 2]


def _first_end(tokens, sequences) -> int | None:
    """The length of the shortest prefix of `tokens` ending with one of `sequences`."""
    for end in range(1, len(tokens) + 1):
        if any(len(q) <= end and tokens[end - len(q) : end] == q for q in sequences):
            return end
    return None


@pytest.mark.slow
def test_logprobs_of_the_rows_that_ask(pair, jobs, tmp_path):
    """At T = 1 without transforms a row's log-probabilities are the model's: equal to
    `score` of its prompt and tokens; N alternatives for "logprobs": N, none without."""
    from jax_specdec import score
    from jax_specdec.io.hf import load_model

    asks = {0: 2, "x1": 0}
    rows = [{**r, "logprobs": asks[r["id"]]} if r["id"] in asks else r for r in BASE]
    out = tmp_path / "lp.jsonl"
    assert run(pair, write_input(tmp_path / "lp.in.jsonl", rows), out) == 0
    base, got = by_key(jobs["base"]), by_key(out)
    target = load_model(pair / "target")
    for r in BASE:
        row = got[(r["id"], None)]
        assert row["tokens"] == base[(r["id"], None)]["tokens"]
        if r["id"] not in asks:
            assert "logprobs" not in row
            continue
        entries = row["logprobs"]
        assert len(entries) == len(row["tokens"])
        assert all(len(e["top"]) == asks[r["id"]] for e in entries)
        expected = score(target, [r["tokens"]], [row["tokens"]]).logprobs[0]
        assert [e["logprob"] for e in entries] == pytest.approx(list(expected), abs=1e-5)
        for e in entries:  # the most likely first, none less likely than the emitted
            values = [v for _, v in e["top"]]
            assert values == sorted(values, reverse=True)
            assert not values or values[0] >= e["logprob"] - 1e-6


def _substrings(text: str) -> tuple[str, str] | None:
    """Two printable ASCII characters of `text` (the random models' texts hold few), each
    first found where it is taken, the second after the first; or None."""
    found = []
    for j, part in enumerate(text):
        if part.isascii() and part.isprintable() and not part.isspace() and text.find(part) == j:
            found.append(part)
        if len(found) == 2:
            return found[0], found[1]
    return None


@pytest.mark.slow
def test_stop_strings_cut_text_tokens_and_finish_reason(pair, jobs, tmp_path, capsys):
    base = by_key(jobs["base"])
    tokenizer = load_tokenizer(pair / "target")
    decode = tokenizer.decode
    picked = {k: _substrings(r["text"]) for k, r in base.items()}
    two = next(k for k, p in picked.items() if p is not None)  # early, late
    one = next(k for k, p in picked.items() if p is not None and k != two)
    flag = next(k for k in base if k not in (two, one) and picked[k] is not None)
    early, late = picked[two]
    stops = {two: [late, early], one: picked[one][1], flag: None}
    rows = [{**r, "stop": stops.get((r["id"], None), "\x00never")} for r in BASE]
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    inp = write_input(tmp_path / "stop.in.jsonl", rows)
    out = tmp_path / "stop.jsonl"
    assert run(pair, inp, out, "--stop", picked[flag][0]) == 0
    got = by_key(out)
    cases = {two: early, one: picked[one][1], flag: picked[flag][0]}
    row_stops = {two: [late, early], one: [picked[one][1]], flag: [picked[flag][0]]}
    for key, stop in cases.items():
        row, text = got[key], base[key]["text"]
        assert (row["finish_reason"], row["stop"]) == ("stop", stop), key
        assert row["text"] == text[: text.find(stop)] and stop not in row["text"]
        n = len(row["tokens"])
        assert row["tokens"] == base[key]["tokens"][:n]
        assert stop in decode(row["tokens"]) and stop not in decode(row["tokens"][:-1])
        # The program ended the row where one of its stops' own tokenizations completed.
        own = [tokenizer.encode(t, add_special_tokens=False).ids for t in row_stops[key]]
        generated = len(base[key]["tokens"])
        assert row["stats"]["generated"] == (_first_end(base[key]["tokens"], own) or generated)
    absent = next(k for k in base if k not in cases)
    assert got[absent] == base[absent] and "stop" not in got[absent]  # finish_reason "length"
    job = json.loads((tmp_path / "stop.jsonl.job.json").read_text())
    assert job["defaults"]["stop"] == [picked[flag][0]]
    capsys.readouterr()
