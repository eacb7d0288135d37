"""scripts/drafter_bench.py on the shipped stdlib pair: the JSON it writes holds a row per
batch of prompts and a summary entry per setting (autoregressive decoding, each drafter's
chains, block verification and trees), with tokens per round beside every speed figure."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "drafter_bench.py")
PAIR = ["--target", "models/stdlib-target", "--draft", "models/stdlib-draft"]


def run(tmp_path, *flags) -> dict:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, SCRIPT, *flags, "--max-new-tokens", "8", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_timed_draft_model_against_ngram(tmp_path):
    result = run(
        tmp_path, *PAIR, "--versus", "ngram", "--prompt-kind", "code", "--prompts", "2",
        "--batch", "2", "--chains", "2", "--repeats", "1",
    )  # fmt: skip
    expected = [
        ("none", "autoregressive"),
        ("models/stdlib-draft", "chain 2"),
        ("ngram", "chain 2"),
    ]
    assert len(result["rows"]) == 1 and result["rows"][0]["prompts"] == [0, 1]
    settings = result["rows"][0]["settings"]
    assert [(s["drafter"], s["round"]) for s in settings] == expected
    assert [(s["drafter"], s["round"]) for s in result["summary"]] == expected
    for entry in settings + result["summary"]:
        assert entry["tokens_per_round"] >= 1.0 and entry["speedup"] > 0
        assert entry["tokens_per_s"] > 0
    ar, draft, ngram = settings
    assert ar["tokens_per_round"] == 1.0 and ar["speedup"] == 1.0
    assert ar["tokens"] == draft["tokens"] == ngram["tokens"] == 2 * 8  # no EOS: all 8 each
    assert len(draft["alpha_per_position"]) == len(draft["accepted_through"]) == 2
    assert 1.0 <= draft["tokens_per_round"] <= 3.0
    # the summary over one batch is that batch
    assert result["summary"][1]["tokens_per_round"] == draft["tokens_per_round"]
    fastest = ar["fastest_s"] / draft["fastest_s"]
    assert result["summary"][1]["speedup_fastest"] == pytest.approx(fastest, abs=2e-3)


@pytest.mark.slow
def test_untimed_chains_block_and_trees_from_a_prompt_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return\nclass Point:\\n    def __init__(self):\n")
    result = run(
        tmp_path, "--target", "models/stdlib-target", "--draft", "ngram", "--prompt-file",
        str(prompts), "--chains", "2", "--block", "--trees", "6:3:2", "--no-speed",
    )  # fmt: skip
    expected = ["autoregressive", "chain 2", "chain 2 block", "tree 6:3:2"]
    assert [row["prompts"] for row in result["rows"]] == [[0], [1]]
    for row in result["rows"]:
        assert [s["round"] for s in row["settings"]] == expected
    assert [s["round"] for s in result["summary"]] == expected
    for entry in result["summary"]:
        assert entry["tokens_per_round"] >= 1.0 and "speedup" not in entry
    assert len(result["rows"][0]["settings"][3]["accepted_through"]) == 3  # the tree's depth


def test_bad_tree_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import drafter_bench
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit, match="NODES:DEPTH:BRANCH"):
        drafter_bench.main([*PAIR, "--trees", "8:four:2", "--out", str(tmp_path / "x.json")])
