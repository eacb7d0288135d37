"""--dtype and --mesh on the commands that load models: the models come in the dtype
asked for, a job file records it, and `generate --mesh` runs the same program on a mesh
(one device here: the tokens of no mesh) or refuses a mesh the devices cannot hold."""

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jax_specdec.cli import main
from jax_specdec.io.draft import load_pair

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
PAIR = ["--target", str(MODELS / "stdlib-target"), "--draft", str(MODELS / "stdlib-draft")]


def _dtypes(model):
    return {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}


def test_load_pair_takes_a_dtype():
    loaded = load_pair(str(MODELS / "stdlib-target"), str(MODELS / "stdlib-draft"))
    assert _dtypes(loaded.target) == _dtypes(loaded.draft) == {jnp.dtype("float32")}
    loaded = load_pair(
        str(MODELS / "stdlib-target"), str(MODELS / "stdlib-draft"), dtype="bfloat16"
    )
    assert _dtypes(loaded.target) == _dtypes(loaded.draft) == {jnp.dtype("bfloat16")}


def _tokens(argv, capsys):
    assert main(["generate", "import os", *PAIR, "--max-new-tokens", "6", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["outputs"][0]["tokens"]


@pytest.mark.slow
def test_generate_mesh_and_dtype(capsys):
    """The mesh run keeps the default, auto: the suite's one run of auto on a mesh. The
    others draft a fixed 4 (auto's compile and measurement are not what they check); the
    tokens agree all the same, greedy decoding giving the target's tokens at any width."""
    plain = _tokens(["-k", "4"], capsys)
    assert _tokens(["--mesh", "1x1", "-k", "auto"], capsys) == plain
    assert len(_tokens(["--dtype", "bfloat16", "-k", "4"], capsys)) == 6
    with pytest.raises(SystemExit):
        main(["generate", "x", *PAIR, "--mesh", "2x1"])
    err = capsys.readouterr().err
    assert "--mesh must be DATAxMODEL with 1 devices in all" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_batch_job_records_its_dtype(tmp_path, capsys):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": 1, "prompt": "import os"}\n')
    out = tmp_path / "out.jsonl"
    job = ["batch", "--input", str(rows), "--output", str(out), *PAIR, "--max-new-tokens", "4"]
    assert main([*job, "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "out.jsonl.job.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):  # the same output with another dtype is another job
        main(job)
    assert "job" in capsys.readouterr().err
