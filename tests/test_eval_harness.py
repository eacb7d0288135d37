"""lm-evaluation-harness as a front end: the `jax_specdec` model runs a local task (YAML
written here, data in tests/eval_tiny.jsonl; nothing from a hub) of each request type;
speculative generation answers as autoregressive generation does, greedy; the log-
likelihoods equal `score`'s; `python -m jax_specdec.eval` runs it from the command line."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")

from jax_specdec.eval.harness import JaxSpecdecLM, _settings  # noqa: E402
from jax_specdec.stop_strings import cut  # noqa: E402

DATA = pathlib.Path(__file__).with_name("eval_tiny.jsonl")
TASKS = {
    "tiny_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "tiny_choice": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
""",
    "tiny_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}}"
metric_list:
  - metric: word_perplexity
""",
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The task folder: each task's YAML over the local JSON lines."""
    folder = tmp_path_factory.mktemp("tasks")
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        head += f"    test: {DATA}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + body)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return folder


def evaluate(lm, tasks, names):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks))
    return simple_evaluate(model=lm, tasks=names, task_manager=manager, log_samples=True)


def responses(result, task):
    return [s["filtered_resps"] for s in result["samples"][task]]


@pytest.mark.slow
def test_every_request_type_and_speculative_equals_autoregressive(pair, tasks):
    args = dict(target=str(pair / "target"), batch_size=4)
    spec = JaxSpecdecLM(draft=str(pair / "draft"), num_draft_tokens=3, **args)
    plain = JaxSpecdecLM(**args)
    names = list(TASKS)
    got, expected = evaluate(spec, tasks, names), evaluate(plain, tasks, names)
    for name in names:
        assert name in got["results"], got["results"].keys()
        assert responses(got, name) == responses(expected, name), name
    generated = [r[0] for r in responses(got, "tiny_gen")]
    assert len(generated) == 6 and all("\n" not in text for text in generated)
    assert any(text for text in generated), "every answer empty: a vacuous test"
    # The choices' log-likelihoods are score's, one target pass each.
    from jax_specdec import score

    doc = got["samples"]["tiny_choice"][0]
    context, continuation = spec._encode_pair(*doc["arguments"][1])
    direct = score(spec.model, [context], [continuation])
    assert doc["resps"][1][0][0] == pytest.approx(float(direct.total[0]), rel=1e-5)


@pytest.mark.slow
def test_the_command_line_runs_a_local_task(pair, tasks, tmp_path):
    args = f"target={pair / 'target'},draft=ngram,num_draft_tokens=3"
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "jax_specdec.eval", "run", "--model", "jax_specdec"]
    cmd += ["--model_args", args, "--tasks", "tiny_gen", "--include_path", str(tasks)]
    cmd += ["--output_path", str(out), "--batch_size", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = list(out.rglob("results*.json"))
    assert found, proc.stdout[-2000:]
    assert "tiny_gen" in json.loads(found[0].read_text())["results"]


def test_stop_strings_cut_the_text_at_the_first():
    assert cut("a\nb END c", ("END", "\n")) == ("a", "\n")
    assert cut("abc", ("x",)) == ("abc", None) and cut("abc", ()) == ("abc", None)
    assert _settings({"until": "END"})[2] == ("END",) and _settings({})[2] == ()
    with pytest.raises(ValueError, match="'until' must not hold an empty string"):
        _settings({"until": ["a", ""]})


def test_unknown_model_args_are_refused(pair):
    with pytest.raises(ValueError, match=r"unknown model_args \['colour'\]"):
        JaxSpecdecLM(target=str(pair / "target"), colour="red")


def test_the_drafter_runs_auto_by_default_and_a_bad_width_is_named(pair):
    from jax_specdec.sampling import SamplingConfig
    from jax_specdec.schedules import Auto, Constant

    args = dict(target=str(pair / "target"), draft=str(pair / "draft"))
    assert isinstance(JaxSpecdecLM(**args)._generator(SamplingConfig()).schedule, Auto)
    fixed = JaxSpecdecLM(num_draft_tokens="3", **args)._generator(SamplingConfig()).schedule
    assert isinstance(fixed, Constant) and fixed.max_gamma == 3
    with pytest.raises(ValueError, match=r"num_draft_tokens must be 'auto' or an integer"):
        JaxSpecdecLM(num_draft_tokens="four", **args)
