"""Sharded generation on simulated CPU devices and across two processes.

Each check runs in a subprocess: the device count (XLA_FLAGS) and jax.distributed must
be set before jax starts, and the rest of the suite runs on one device. The 8-device
checks of the selected tests share one subprocess (`sharded`), which JAX starts once.
"""

import json
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jax_specdec import speculative_generate
from jax_specdec.nn import Transformer, TransformerConfig
from jax_specdec.sharding import param_spec

HERE = pathlib.Path(__file__).parent


# The mode of sharded_run.py each test checks.
MODES = {
    "test_meshes_give_the_one_device_tokens_and_split_the_weights": "equality",
    "test_batch_job_rows_do_not_depend_on_the_mesh": "batch",
    "test_enumerated_exactness_on_a_sharded_mesh": "exactness",
    "test_two_processes_match_one_process": "reference",
    "test_heads_and_trees_on_meshes_give_the_one_device_tokens": "drafters",
}


@pytest.fixture(scope="module")
def sharded(request):
    """The results of the selected tests' modes, from one run of sharded_run.py."""
    selected = {item.originalname for item in request.session.items}
    modes = [mode for test, mode in MODES.items() if test in selected]
    proc = subprocess.run(
        [sys.executable, str(HERE / "sharded_run.py"), *modes],
        capture_output=True,
        text=True,
        timeout=900 * len(modes),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mode_result(sharded, mode):
    result = sharded[mode]
    assert "error" not in result, result["error"][-3000:]
    return result


@pytest.mark.slow
def test_meshes_give_the_one_device_tokens_and_split_the_weights(sharded):
    result = mode_result(sharded, "equality")
    print("\nSHARDING " + json.dumps(result))
    assert result["devices"] == 8
    runs = {"(4, 2)": ("greedy", "sampled", "heuristic", "autoregressive", "slots")}
    runs |= dict.fromkeys(["(8, 1)", "(2, 4)"], ("greedy", "sampled", "autoregressive"))
    assert set(result["meshes"]) == set(runs)
    for shape, entry in result["meshes"].items():
        data, model = eval(shape)
        for name in runs[shape]:
            assert entry[name], f"{name} differs on mesh {shape}"
        (q_full, q_shard), (down_full, down_shard) = entry["q_kernel"], entry["down_kernel"]
        assert q_shard == [q_full[0], q_full[1] // model]  # heads split over model
        assert down_shard == [down_full[0] // model, down_full[1]]  # MLP rows split
        assert entry["prompt_rows_per_device"] == 8 // data
        assert "data" in entry["output_sharding"]
    restored = result["restored"]  # orbax restore straight into the (4, 2) layout
    assert restored["q_kernel"][1] == [restored["q_kernel"][0][0], restored["q_kernel"][0][1] // 2]
    assert restored["greedy"]
    errors = result["errors"]
    assert "data axis (8) does not divide the batch (6)" in errors["batch"]
    assert "data axis (4) does not divide num_slots (6)" in errors["slots"]
    assert "model axis (8) does not divide the target model's num_heads" in errors["heads"]
    # A model axis wider than the draft's 2 KV heads repeats them (tokens: test_mesh_load).
    assert errors["kv"] is None


@pytest.mark.slow
def test_batch_job_rows_do_not_depend_on_the_mesh(sharded):
    result = mode_result(sharded, "batch")
    assert result["rows"] == 11
    assert result["same"] == dict.fromkeys(["None-fixed", "4x2-slots", "8x1-fixed"], True)


@pytest.mark.slow
def test_heads_and_trees_on_meshes_give_the_one_device_tokens(sharded):
    result = mode_result(sharded, "drafters")
    assert len(result["same"]) == 10 and all(result["same"].values()), result["same"]
    for full, shard in result["head_q_kernels"].values():  # q kernels [in, heads x hd]
        assert shard == [full[0], full[1] // 4]


@pytest.mark.slow
def test_enumerated_exactness_on_a_sharded_mesh(sharded):
    result = mode_result(sharded, "exactness")
    print(f"\nSHARDED-EXACTNESS mesh (4,2): {result}")
    assert min(result["pvalues"]) > 1e-3


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, sharded):
    script = str(HERE / "multihost_run.py")
    port, out = str(free_port()), tmp_path / "multi.json"
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(i), "2", port, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    multi, ref = json.loads(out.read_text()), mode_result(sharded, "reference")
    assert multi["process_count"] == 2 and multi["global_devices"] == 8
    assert multi["local_devices"] == 4
    assert multi["greedy"] == ref["greedy"]
    assert multi["sampled"] == ref["sampled"]


def test_param_specs():
    from jax.sharding import PartitionSpec as P

    assert param_spec(("blocks", 0, "attn", "q", "kernel")) == P(None, "model")
    assert param_spec(("blocks", 0, "attn", "k", "bias")) == P("model")
    assert param_spec(("blocks", 3, "attn", "o", "kernel")) == P("model", None)
    assert param_spec(("blocks", 0, "mlp", "down", "kernel")) == P("model", None)
    assert param_spec(("blocks", 0, "mlp", "gate", "kernel")) == P(None, "model")
    assert param_spec(("embed",)) == P() and param_spec(("final_norm", "scale")) == P()


def test_bad_meshes_are_refused_before_compiling():
    model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
    one = np.array(jax.devices()[:1]).reshape(1, 1)
    kwargs = dict(key=jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="axes named 'data' and 'model'"):
        speculative_generate(model, model, [[1]], mesh=Mesh(one, ("rows", "model")), **kwargs)
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        speculative_generate(model, model, [[1]], mesh="8x1", **kwargs)
