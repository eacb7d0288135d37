"""`jax-specdec batch --ray`: one job over a local Ray cluster of two workers writes the
rows a one-process job writes, byte for byte, also when a worker is killed mid-job."""

import json
import os
import random
import signal
import threading
import time

import psutil
import pytest
from test_batch import SETTINGS, write_input

from jax_specdec.batch.output import id_hash
from jax_specdec.cli import main

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

# Prompts of one length (one program per call shape: few compiles), five sampling settings.
ROWS = [
    {"id": i if i % 2 else f"r{i}", "tokens": [3 + 7 * i, 40, 41, 42 + i, 43], **SETTINGS[i % 5]}
    for i in range(16)
]
# Calls of two rows through two slots: a worker is killed with calls to go.
CALLS = ["--slots", "2", "--rows-per-call", "2"]


def run(pair, inp, out, *extra):
    argv = ["batch", "--target", str(pair / "target"), "--draft", str(pair / "draft")]
    argv += ["--input", str(inp), "--output", str(out), "--max-new-tokens", "10"]
    argv += ["--temperature", "1", "--seed", "3", *CALLS, *extra]
    return main(argv)


@pytest.fixture(scope="module")
def reference(pair, tmp_path_factory):
    """The job's output from one process (no Ray), and its input."""
    root = tmp_path_factory.mktemp("reference")
    inp = write_input(root / "in.jsonl", ROWS)
    assert run(pair, inp, root / "out.jsonl") == 0
    return inp, root / "out.jsonl"


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of two CPUs: two workers of one CPU each."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def last_summary(stdout):
    """The job's summary: the raylet may print a line about a killed worker before it."""
    return json.loads(stdout[stdout.rindex('{\n "rows_run"') :])


def in_hash_order(path):
    lines = path.read_text().splitlines(keepends=True)
    return "".join(sorted(lines, key=lambda t: id_hash(json.dumps(json.loads(t)["id"]))))


def resume_from(reference, out, rows):
    """`out` as a one-process job killed after `rows` rows leaves it."""
    lines = reference.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:rows]))
    job = reference.with_name(reference.name + ".job.json")
    out.with_name(out.name + ".job.json").write_text(job.read_text())


def test_two_workers_write_the_rows_of_one_process(
    pair, reference, cluster, tmp_path, capsys, monkeypatch
):
    """From an input in another order: the one-process job's lines and job file, byte for
    byte, in the order of the ids' SHA-256. The driver (this process) reads no weights."""
    import jax_specdec.io.hf as hf

    built = []  # whether each model this process builds gets its weights
    build = hf.build_model
    monkeypatch.setattr(hf, "build_model", lambda c, parts: built.append(parts) or build(c, parts))
    inp, single = reference
    shuffled = ROWS[:]
    random.Random(1).shuffle(shuffled)
    out = tmp_path / "ray.jsonl"
    capsys.readouterr()
    assert run(pair, write_input(tmp_path / "in.jsonl", shuffled), out, "--ray") == 0
    summary = last_summary(capsys.readouterr().out)
    assert summary["rows_run"] == 16 and summary["workers"] == 2
    assert out.read_text() == in_hash_order(single)
    assert built == [None, None]  # the target and the draft, their shapes only
    job_file = (tmp_path / "ray.jsonl.job.json").read_text()
    assert job_file == single.with_name("out.jsonl.job.json").read_text()
    # Finished: a restart runs nothing and leaves the file as it is.
    assert run(pair, inp, out, "--ray") == 0
    assert last_summary(capsys.readouterr().out)["rows_run"] == 0
    assert out.read_text() == in_hash_order(single)


def _kill_a_worker(out, killed):
    """SIGKILLs one Ray Data worker of this process's cluster once `out` holds a call more
    than it started with (the job then has calls to go)."""
    start = out.read_text().count("\n")
    deadline = time.time() + 600
    while time.time() < deadline and out.read_text().count("\n") < start + 2:
        time.sleep(0.02)
    for proc in psutil.Process().children(recursive=True):
        try:
            if "_Worker" in " ".join(proc.cmdline()):
                os.kill(proc.pid, signal.SIGKILL)
                killed.append((proc.pid, out.read_text().count("\n")))
                return
        except psutil.Error:
            continue


def test_a_killed_worker_is_retried_and_the_output_is_the_same(
    pair, reference, cluster, tmp_path, capsys
):
    """Resumed after four rows of a one-process run (those never run again), the job's
    worker is SIGKILLed mid-job: Ray restarts it and runs its calls again, and the output is
    the one-process output."""
    inp, single = reference
    out = tmp_path / "ray.jsonl"
    resume_from(single, out, 4)
    killed = []
    killer = threading.Thread(target=_kill_a_worker, args=(out, killed))
    killer.start()
    capsys.readouterr()
    assert run(pair, inp, out, "--ray") == 0
    killer.join()
    summary = last_summary(capsys.readouterr().out)
    assert killed and killed[0][1] < 16, "a worker should have been killed mid-job"
    assert summary["rows_run"] == 12 and summary["rows_skipped_as_finished"] == 4
    assert out.read_text() == in_hash_order(single)


def test_output_of_another_job_is_refused_and_kept(pair, reference, tmp_path, capsys):
    inp, single = reference
    out = tmp_path / "out.jsonl"
    resume_from(single, out, 3)
    before = out.read_text()
    with pytest.raises(SystemExit):
        run(pair, inp, out, "--ray", "--seed", "4")
    assert "belongs to a different job (seed differ" in capsys.readouterr().err
    other = write_input(tmp_path / "other.jsonl", [{"id": 99, "prompt": "x"}])
    with pytest.raises(SystemExit):
        run(pair, other, out, "--ray")
    assert "not in the input" in capsys.readouterr().err
    assert out.read_text() == before
    with pytest.raises(SystemExit):
        run(pair, inp, out, "--ray", "--ray-worker-resources", "CPU")
    assert "--ray-worker-resources must be" in capsys.readouterr().err


def test_rows_of_samples_and_stops_write_the_lines_of_one_process(pair, cluster, tmp_path, capsys):
    """A row of 3 samples and rows with stop strings: the one-process job's lines, the
    samples spread over the shards and merged back in order."""
    from jax_specdec.batch.output import merge

    rows = [{**ROWS[0], "n": 3, "stop": ["e", "a"]}, {**ROWS[1], "stop": "_"}, ROWS[2]]
    inp = write_input(tmp_path / "in.jsonl", rows)
    single, out = tmp_path / "one.jsonl", tmp_path / "ray.jsonl"
    assert run(pair, inp, single) == 0
    merge(single)
    assert run(pair, inp, out, "--ray") == 0
    capsys.readouterr()
    assert out.read_text() == single.read_text()
    samples = [json.loads(t).get("sample") for t in out.read_text().splitlines()]
    assert [s for s in samples if s is not None] == [0, 1, 2]
