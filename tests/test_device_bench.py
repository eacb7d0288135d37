"""scripts/device_bench.py --quick runs end to end on CPU and writes its JSON and table."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quick_run_writes_json_and_table(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "device_bench.py"), str(out), "--quick"]
    # A generous budget: on a loaded CI machine no case may be skipped.
    subprocess.run(cmd + ["--budget-s", "900"], check=True, timeout=900, capture_output=True)
    result = json.loads((out / "device_bench.json").read_text())
    plan = result["plan"]
    assert result["quick"] and result["dtype"] == "bfloat16" and result["skipped"] == []
    steps = result["steps"]["rows"]
    cases = {(r["tokens"], r["batch"], r["cache_len"]) for r in steps}
    assert cases == {
        (t, b, c) for t in plan["tokens"] for b in plan["batches"] for c, _ in plan["caches"]
    }
    assert all(r["ms"] > 0 and r["vs_bare"] > 0 for r in steps)
    assert all(r["vs_one_token"] == 1.0 for r in steps if r["tokens"] == 1)
    rows = result["generation"]
    methods = {(r["model"], r["method"]) for r in rows}
    assert ("smollm", "autoregressive") in methods and ("target_1b", "draft γ=2") in methods
    assert ("smollm", "ngram γ=2") in methods
    for r in rows:
        assert r["tokens_per_s"] > 0
        assert ("alpha" in r) == (r["method"] != "autoregressive")
        assert 0.0 <= r.get("alpha", 0.0) <= 1.0
    params = result["parameters"]
    assert params["target_1b"] > params["smollm"] > params["draft"] > 0
    assert {r["kernel"] for r in result["kernels"]} == {"einsum", "xla", "cudnn"}
    assert all(r["ms"] > 0 for r in result["kernels"])  # on CPU "cudnn" falls back to "xla"
    mixes = [r["transform"] for r in result["sampling"]]
    assert len(mixes) == 3 and result["sampling"][0]["vs_one_setting"] == 1.0
    assert all(r["ms"] > 0 for r in result["sampling"])
    table = (out / "device_bench.md").read_text()
    assert "| smollm | 2 | autoregressive |" in table and "Attention kernels" in table
    assert "Per-row sampling transforms" in table


def test_unknown_section_is_refused(capsys):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import device_bench
    finally:
        sys.path.pop(0)
    try:
        device_bench.main(["/nonexistent", "--sections", "steps,bogus"])
    except SystemExit as exit:
        assert exit.code == 2
    else:
        raise AssertionError("--sections bogus was accepted")
    assert "--sections: unknown ['bogus']" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_load_8b_section_loads_onto_the_mesh_and_times_the_verify_calls(tmp_path):
    """--sections load_8b at --quick's tiny shape: a checkpoint written, loaded through the
    sharded loader, and its step and 5-token verify timed against the weight-read floor."""
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "device_bench.py"), str(out), "--quick"]
    cmd += ["--sections", "load_8b", "--budget-s", "600"]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    section = json.loads((out / "device_bench.json").read_text())["load_8b"]
    assert section["bytes"] > 0 and section["load_s"] > 0
    assert [(r["batch"], r["tokens"]) for r in section["rows"]] == [(1, 1), (1, 5)]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in section["rows"])
    assert "An 8B target loaded onto the mesh" in (out / "device_bench.md").read_text()
