"""Models named by Hugging Face Hub ids (`org/name[@revision]`), resolved through
`huggingface_hub` from a cache this test builds in the layout it reads
(`models--org--name/refs/main`, `snapshots/<commit>/...`), with the Hub offline: the
Python API, `generate` and `batch` (`convert-head`: tests/test_eagle3.py); an id with
nothing cached fails in one line that says what to do."""

import json
import pathlib

import pytest
from helpers import hub_cache

from jax_specdec import Generator, load_draft
from jax_specdec.cli import main
from jax_specdec.io.hf import load_model
from jax_specdec.io.hub import is_hub_id
from jax_specdec.io.locate import locate

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub cache holding org/target and org/draft (the shipped pair), offline."""
    repos = {"org/target": MODELS / "stdlib-target", "org/draft": MODELS / "stdlib-draft"}
    commits = hub_cache(tmp_path / "hub", monkeypatch, repos)
    monkeypatch.chdir(tmp_path)  # no local directory named org/...
    return commits


def test_hub_ids_and_paths_are_told_apart():
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("RedHatAI/x.eagle3@v1.0")
    assert not is_hub_id("/abs/dir") and not is_hub_id("dir") and not is_hub_id("a/b/c")


@pytest.mark.slow
def test_python_api_loads_from_the_cache(hub):
    path = locate("org/target", "target")
    assert path.parts[-2:] == ("snapshots", hub["org/target"])
    assert locate(f"org/target@{hub['org/target']}", "target") == path
    target = load_model("org/target")
    draft = load_draft("org/draft", target)
    prompts = [[5, 6, 7, 8]]
    import jax

    key = jax.random.key(0)
    out = Generator(target, draft, schedule=3)(prompts, key=key, max_new_tokens=8)
    ref = Generator(load_model(MODELS / "stdlib-target"))(prompts, key=key, max_new_tokens=8)
    assert out.tokens.tolist() == ref.tokens.tolist()


@pytest.mark.slow
def test_generate_and_batch_take_hub_ids(hub, tmp_path, capsys):
    # -k 4: a fixed width (auto's compile and measurement are not what this checks)
    argv = ["generate", "import os", "--target", "org/target", "--draft", "org/draft", "-k", "4"]
    assert main([*argv, "--max-new-tokens", "6", "--json"]) == 0
    hub_out = json.loads(capsys.readouterr().out)["outputs"][0]["tokens"]
    local = ["--target", str(MODELS / "stdlib-target"), "--draft", str(MODELS / "stdlib-draft")]
    local += ["-k", "4"]
    assert main(["generate", "import os", *local, "--max-new-tokens", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["tokens"] == hub_out
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": 1, "prompt": "import os"}\n')
    job = ["batch", "--input", str(rows), "--output", str(tmp_path / "out.jsonl")]
    assert (
        main([*job, "--target", "org/target", "--draft", "org/draft", "--max-new-tokens", "6"]) == 0
    )
    line = json.loads((tmp_path / "out.jsonl").read_text())
    assert line["tokens"] == hub_out
    job_file = json.loads((tmp_path / "out.jsonl.job.json").read_text())
    assert job_file["target"]["path"] == "org/target" and job_file["target"]["sha256"]


def test_an_id_not_cached_fails_in_one_line(hub, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "x", "--target", "org/missing", "--draft", "ngram"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--target: org/missing is neither a local directory nor in the Hugging Face cache" in err
    assert "hf download org/missing" in err
    with pytest.raises(ValueError, match="--path: org/missing is neither"):
        load_model("org/missing")
