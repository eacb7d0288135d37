"""`jax-specdec batch --distributed`: one job over two processes of 4 simulated CPU devices
each (gloo collectives, coordinator on localhost), mesh (4, 2) over all 8 devices.

Each process runs in a directory of its own (its "host"), with the same command: the
relative --input and --output are that host's files. The one-process reference runs
without a mesh, started once per module beside the first test.
"""

import json
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
from flax import nnx

from jax_specdec.cli import main
from jax_specdec.io.hf import save_model
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.training.corpus import stdlib_corpus, train_tokenizer

RUNNER = pathlib.Path(__file__).with_name("batch_multihost_run.py")
ROWS = 12
# Rows of five sampling settings and three budgets; prompts of one length in tokens, so
# that every call of 4 rows is one program shape (3 calls).
SETTINGS = [
    {},
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9},
    {"top_k": 20},
    {"temperature": 1.5, "seed": 11},
]
FLAGS = ["--input", "in.jsonl", "--output", "out.jsonl", "--temperature", "1", "--seed", "3"]
FLAGS += ["--max-new-tokens", "8", "--slots", "4", "--rows-per-call", "4"]


def write_rows(path: pathlib.Path, vocab: int, changed: bool = False) -> None:
    rows = []
    for i in range(ROWS):
        tokens = [(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(5)]
        rows.append({"id": f"r{i}", "tokens": tokens, "max_new_tokens": 4 + i % 3 * 2})
        rows[-1].update(SETTINGS[i % len(SETTINGS)])
    if changed:
        rows[5]["tokens"] = [1, 2, 3, 4, 5]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny models (vocabulary 300) and the reference: the one-process job's output,
    from a subprocess started here and awaited by `reference`."""
    root = tmp_path_factory.mktemp("multihost")
    corpus = stdlib_corpus()
    tokenizer = train_tokenizer(corpus.read(corpus.train[:10]), 300)
    vocab = tokenizer.get_vocab_size()
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        config = TransformerConfig.tiny(vocab_size=vocab, num_layers=layers, num_kv_heads=4)
        model = Transformer(config, rngs=nnx.Rngs(seed), init_scale=0.3)
        save_model(model, root / name, tokenizer=tokenizer)
    models = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    (root / "one").mkdir()
    write_rows(root / "one" / "in.jsonl", vocab)
    reference = subprocess.Popen(
        [sys.executable, "-m", "jax_specdec.cli", "batch", *models, *FLAGS],
        cwd=root / "one",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield {"root": root, "models": models, "vocab": vocab, "reference": reference}
    if reference.poll() is None:
        reference.kill()
        reference.communicate()


def reference(job) -> tuple[bytes, bytes]:
    """The one-process job's output and job file."""
    _, err = job["reference"].communicate(timeout=600)
    assert job["reference"].returncode == 0, err[-3000:]
    one = job["root"] / "one"
    return (one / "out.jsonl").read_bytes(), (one / "out.jsonl.job.json").read_bytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def hosts(job, name: str, changed=(False, False)) -> list[pathlib.Path]:
    """A directory per process, each with its input (process i's changed if changed[i])."""
    dirs = []
    for i in range(2):
        d = job["root"] / name / f"host{i}"
        d.mkdir(parents=True)
        write_rows(d / "in.jsonl", job["vocab"], changed[i])
        dirs.append(d)
    return dirs


def start(job, dirs) -> list[subprocess.Popen]:
    """The same command on both processes (each in its own directory)."""
    place = ["--mesh", "4x2", "--coordinator", f"localhost:{free_port()}", "--num-processes"]
    return [
        subprocess.Popen(
            [sys.executable, str(RUNNER), *job["models"], *FLAGS, *place, "2"]
            + ["--process-id", str(i)],
            cwd=d,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, d in enumerate(dirs)
    ]


def summary(out: str) -> dict:
    """The summary a process printed (gloo's connection lines may come first)."""
    return json.loads(out[out.index("{\n") :])


def finish(procs) -> list[tuple[int, str, str]]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append((p.returncode, out, err))
    return results


@pytest.mark.slow
def test_processes_with_different_inputs_stop_before_generating(job):
    dirs = hosts(job, "different", changed=(False, True))
    for rc, out, err in finish(start(job, dirs)):
        assert rc == 2, err[-3000:]
        assert "--input in.jsonl differs between processes (SHA-256 " in err
        assert "on process 0" in err and "on process 1" in err
        assert "{" not in out  # no summary: nothing ran
    for d in dirs:
        assert not (d / "out.jsonl").exists() and not (d / "out.jsonl.job.json").exists()


@pytest.mark.slow
def test_two_processes_write_the_one_process_output(job):
    dirs = hosts(job, "clean")
    results = finish(start(job, dirs))
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    first = summary(results[0][1])  # printed by process 0 alone
    assert first["processes"] == 2 and first["rows_run"] == ROWS
    assert "{" not in results[1][1]
    lines, job_file = reference(job)
    assert (dirs[0] / "out.jsonl").read_bytes() == lines
    assert (dirs[0] / "out.jsonl.job.json").read_bytes() == job_file
    assert not (dirs[1] / "out.jsonl").exists()  # process 1 writes nothing


@pytest.mark.slow
def test_resumes_after_a_process_is_killed(job):
    dirs = hosts(job, "killed")
    output = dirs[0] / "out.jsonl"
    procs = start(job, dirs)
    deadline = time.monotonic() + 300
    while not (output.exists() and output.read_bytes().count(b"\n") >= 4):
        assert time.monotonic() < deadline and procs[0].poll() is None, finish(procs)
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)  # the first call is written; kill mid-job
    procs[1].wait()
    time.sleep(0.5)  # what process 0 does now, alone, must not spoil the output
    procs[0].send_signal(signal.SIGKILL)
    finish(procs)
    written = output.read_bytes()
    assert written.endswith(b"\n")
    assert written.count(b"\n") in (4, 8)  # killed mid-job, whole calls of 4 rows written
    results = finish(start(job, dirs))
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    second = summary(results[0][1])
    assert second["rows_skipped_as_finished"] == written.count(b"\n")
    assert second["rows_run"] == ROWS - written.count(b"\n")
    lines, job_file = reference(job)
    assert output.read_bytes() == lines  # hence no id twice
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == ROWS
    assert (dirs[0] / "out.jsonl.job.json").read_bytes() == job_file


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-processes", "2", "--process-id", "0"], "--num-processes needs --coordinator"),
        (["--coordinator", "h:1"], "--coordinator needs --num-processes and --process-id"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "in [0, 2)"),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "at least 1"),
        (["--coordinator", "h", "--num-processes", "2", "--process-id", "0"], "be HOST:PORT"),
        (["--distributed", "--ray"], "--ray and --distributed"),
        (["--distributed", "--mesh", None], "--distributed needs --mesh"),
        (["--distributed", "--num-processes", "2", "JAX_COORDINATOR_ADDRESS"], "go together"),
    ],
)
def test_bad_distributed_flags_are_refused_first(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    if flags[-1] == "JAX_COORDINATOR_ADDRESS":  # the coordinator from the environment
        monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h:1")
        flags = flags[:-1]
    argv = ["batch", "--input", "missing.jsonl", "--output", "out.jsonl", "--mesh", "4x2"]
    if flags[-1] is None:  # no --mesh
        argv, flags = argv[:-2], flags[:-2]
    with pytest.raises(SystemExit) as stop:
        main(argv + flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
