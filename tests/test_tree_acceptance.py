"""A head's measured tree acceptance: `jax-specdec calibrate-tree` on a small head, the
record beside the weights (`io.head_acceptance`), and `load_head` taking it only for
the weights it was measured with."""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from jax_specdec.cli import main
from jax_specdec.cli.calibrate_tree import _prompt_ids
from jax_specdec.io.head_acceptance import (
    ACCEPTANCE,
    acceptance_table,
    read_tree_acceptance,
    write_tree_acceptance,
)
from jax_specdec.io.heads import load_head, save_head, tokenizer_sha256
from jax_specdec.io.hf import load_model, load_tokenizer
from jax_specdec.nn.feature_head import FeatureHead, FeatureHeadConfig
from jax_specdec.training.prompts import chat_requests


def _save_head(pair, path, seed=2):
    target, tokenizer = load_model(pair / "target"), load_tokenizer(pair / "target")
    config = FeatureHeadConfig.for_target(
        target.config, 64, tokenizer_sha256=tokenizer_sha256(tokenizer)
    )
    head = FeatureHead(config, rngs=nnx.Rngs(seed), init_scale=0.3)
    head.vocab_map.set_value(np.arange(64, dtype=np.int32) * 3)
    save_head(head, path)
    return path


@pytest.fixture
def head_dir(tmp_path):
    """A directory with weights to name (the records only hash them)."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    return tmp_path


def test_the_table_leaves_out_rates_measured_too_rarely():
    table = acceptance_table([[40, 20, 3], [10, 0, 0]], [[30, 5, 1], [4, 0, 0]], min_tests=10)
    assert table == [[0.75, 0.25, None], [0.4, None, None]]
    with pytest.raises(ValueError, match="must be \\[depth, ranks\\]"):
        acceptance_table([1, 2], [1, 2])


def test_a_record_is_read_back_with_its_gaps_filled(head_dir):
    table = [[0.5, 0.25, None], [0.4, None], [None]]
    write_tree_acceptance(head_dir, table, {"tree": "8:3:3"})
    # a gap takes the rate one level up, else the rank before's at its level
    assert read_tree_acceptance(head_dir) == ((0.5, 0.25, 0.25), (0.4, 0.25), (0.4,))
    record = json.loads((head_dir / ACCEPTANCE).read_text())
    assert record["measured"] == {"tree": "8:3:3"}


def test_a_record_of_other_weights_is_ignored_with_a_warning(head_dir):
    write_tree_acceptance(head_dir, [[0.5]], {})
    (head_dir / "model.safetensors").write_bytes(b"weights trained further")
    with pytest.warns(UserWarning, match="measured with other weights"):
        assert read_tree_acceptance(head_dir) == ()
    assert read_tree_acceptance(head_dir / "elsewhere") == ()  # no record: no rates


@pytest.mark.parametrize(
    "table, words",
    [
        ([[1.5]], "acceptance\\[0\\]\\[0\\] = 1.5 is not in \\[0, 1\\]"),
        ([[None, 0.2]], "the first child at depth 0\\) is unmeasured"),
        ([[0.5], []], "non-empty lists"),
        ([[True]], "is not in"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_file(head_dir, table, words):
    write_tree_acceptance(head_dir, [[0.5]], {})
    record = json.loads((head_dir / ACCEPTANCE).read_text())
    (head_dir / ACCEPTANCE).write_text(json.dumps({**record, "acceptance": table}))
    with pytest.raises(ValueError, match=f"{ACCEPTANCE}.*{words}"):
        read_tree_acceptance(head_dir)
    with pytest.raises(ValueError, match=words):
        write_tree_acceptance(head_dir, table, {})


@pytest.mark.slow
def test_calibrate_tree_measures_a_head_and_its_trees_follow(pair, tmp_path, capsys):
    head = _save_head(pair, tmp_path / "head")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "def read(path):\\n    with open(path) as f:\nimport os\nclass A:\nx = [1, 2,\n"
    )
    argv = ["calibrate-tree", str(head), "--target", str(pair / "target"), "--tree", "8:3:3"]
    argv += ["--prompt-file", str(prompts), "--max-new-tokens", "24", "--batch", "2"]
    argv += ["--min-tests", "1"]
    assert main(argv) == 0
    assert "depth 0:" in capsys.readouterr().out
    record = json.loads((head / ACCEPTANCE).read_text())
    tested, kept = np.asarray(record["measured"]["tested"]), np.asarray(record["measured"]["kept"])
    assert tested.shape == (3, 3) and tested[0, 0] > 0 and (kept <= tested).all()
    assert record["acceptance"] == acceptance_table(tested, kept, 1)
    assert record["measured"]["rounds"] > 0 and record["measured"]["prompts"] == 4
    rates = load_head(head).config.tree_acceptance
    assert rates == read_tree_acceptance(head) and rates[0][0] == record["acceptance"][0][0]
    assert len(rates) == 3 and all(len(row) == 3 for row in rates)
    # the measurement is of these weights: a config written anew does not carry it, and
    # a head saved over them (trained further) removes it
    assert "tree_acceptance" not in json.loads((head / "head_config.json").read_text())
    _save_head(pair, head, seed=3)
    assert not (head / ACCEPTANCE).exists()
    assert load_head(head).config.tree_acceptance == ()


def test_a_config_refuses_rates_outside_zero_to_one(pair):
    config = FeatureHeadConfig.for_target(load_model(pair / "target", weights=False).config, 64)
    for table in [((1.5,),), ((0.5,), ()), ((float("nan"),),), (("a",),)]:
        with pytest.raises(ValueError, match="FeatureHeadConfig.tree_acceptance must be"):
            dataclasses.replace(config, tree_acceptance=table)
    assert dataclasses.replace(config, tree_acceptance=[[1, 0.5]]).tree_acceptance == ((1.0, 0.5),)


def test_calibrate_tree_prompts_are_held_out_chat_requests_and_code(pair):
    tokenizer = load_tokenizer(pair / "target")
    loaded = SimpleNamespace(tokenizer=tokenizer, target_dir=pair / "target")
    ids = _prompt_ids(SimpleNamespace(prompt_file=None, prompts=6), loaded)
    texts = [tokenizer.decode(i) for i in ids]
    assert len(texts) == 6 and texts[0] == chat_requests("held_out")[0]  # no template here
    assert texts[1].startswith("def ") and texts[3].startswith("def ")
    with pytest.raises(ValueError, match="--prompts 100000: only"):
        _prompt_ids(SimpleNamespace(prompt_file=None, prompts=100000), loaded)


def test_calibrate_tree_refuses_bad_arguments_naming_them(pair, tmp_path, capsys):
    base = ["calibrate-tree", "--target", str(pair / "target")]
    for extra, words in [
        ([str(tmp_path)], "is not a feature head directory"),
        ([str(_save_head(pair, tmp_path / "h")), "--temperature", "0"], "--temperature"),
        ([str(tmp_path / "h"), "--prompts", "0"], "--prompts must be >= 1"),
        ([str(tmp_path / "h"), "--tree", "8:3:3,4:2:2"], "--tree:"),
        ([str(tmp_path / "h"), "--tree", "8:3:3:2"], "--tree: a sampled tree has no prompt"),
        ([str(tmp_path / "h"), "--tree", "8:3"], "--tree: '8:3' is not"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*base, *extra])
        assert exit_.value.code == 2
        assert words in capsys.readouterr().err
