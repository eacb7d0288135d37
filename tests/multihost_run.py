"""One of several processes of a `jax.distributed` run on this machine (CPU, gloo
collectives, 4 simulated devices each), or the one-process reference.

    python tests/multihost_run.py <process_id> <num_processes> <port> <out.json>
    python tests/multihost_run.py reference - - <out.json>

Every process builds the same models and inputs and calls `speculative_generate` on a
(data, model) mesh over all processes' devices; process 0 gathers the tokens and
writes them as JSON.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_specdec import SamplingConfig, speculative_generate  # noqa: E402


def generate(mesh):
    from helpers import make_model, ragged_prompts

    target = make_model(10, vocab=32, scale=0.3, num_kv_heads=4)
    draft = make_model(11, vocab=32, scale=0.3, num_layers=1, num_kv_heads=4)
    prompts = ragged_prompts(8, 32, seed=1)
    keys = jax.random.split(jax.random.key(5), 8)
    result = {}
    for name, sampling in (("greedy", SamplingConfig(0.0)), ("sampled", SamplingConfig(1.0))):
        out = speculative_generate(
            target,
            draft,
            prompts,
            key=keys,
            max_new_tokens=16,
            num_draft_tokens=3,
            sampling=sampling,
            mesh=mesh,
        )
        tokens = out.tokens
        if mesh is not None and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            tokens = multihost_utils.process_allgather(tokens, tiled=True)
        result[name] = np.asarray(tokens).tolist()
    return result


if __name__ == "__main__":
    which, count, port, path = sys.argv[1:5]
    if which == "reference":
        result = generate(None)
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=int(count),
            process_id=int(which),
        )
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        result = generate(mesh)
        result["process_count"] = jax.process_count()
        result["global_devices"] = len(jax.devices())
        result["local_devices"] = len(jax.local_devices())
    if which in ("reference", "0"):
        with open(path, "w") as f:
            json.dump(result, f)
