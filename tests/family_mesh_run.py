"""Runs in its own process with 4 simulated CPU devices (XLA_FLAGS must be set before
jax starts): one model family's target with its drafters on a (2, 2) mesh against one
device, greedy. Prints one JSON object: the device count and, per drafter, the tokens
on one device and on the mesh.

    python tests/family_mesh_run.py qwen3   # q/k norms (scales not 1)
    python tests/family_mesh_run.py gemma   # every Gemma switch, a window of 3 shorter
                                            # than the rows

Drafters: a draft model's chain, a feature head's tree, n-gram slots.
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
from flax import nnx  # noqa: E402

from jax_specdec import Generator, NGram  # noqa: E402
from jax_specdec.nn import Transformer, TransformerConfig  # noqa: E402

GEMMA = dict(
    mlp="geglu", embed_scale=True, norm_plus_one=True, post_norms=True, qk_norm=True,
    query_pre_attn_scalar=6.0, attn_softcap=8.0, final_softcap=6.0, sliding_window=3,
    local_layers=(0,),
)  # fmt: skip


def model(seed, family, **overrides):
    """A tiny model of `family` with every norm's scale moved away from its identity."""
    switches = GEMMA if family == "gemma" else dict(qk_norm=True)
    config = TransformerConfig.tiny(vocab_size=32, **{**switches, **overrides})
    m = Transformer(config, rngs=nnx.Rngs(seed), init_scale=0.3)
    flat = nnx.to_flat_state(nnx.state(m, nnx.Param))
    for i, (path, leaf) in enumerate(flat):
        if "scale" in path:
            noise = 0.3 * jax.random.normal(jax.random.key(100 * seed + i), leaf.get_value().shape)
            leaf.set_value((0.0 if config.norm_plus_one else 1.0) + noise)
    nnx.update(m, nnx.from_flat_state(flat))
    return m


def drafters(family, target):
    """A random draft model drafts nothing the target takes at this size: the target's own
    weights in a model of their own are the draft model (every draft accepted), beside
    drafters accepted in part."""
    from helpers import make_head

    return {
        "draft model chain": (model(1, family), dict(schedule=3), {}),
        "feature head tree": (make_head(target), dict(schedule=3, tree=6), {}),
        "n-gram slots": (NGram(), dict(schedule=3), dict(num_slots=2)),
    }


def run(family):
    target = model(1, family)
    prompts = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 6, 7], [10]]
    call = dict(key=jax.random.key(0), max_new_tokens=[10, 6, 12, 8])
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    result = {"devices": jax.device_count()}
    for name, (draft, settings, extra) in drafters(family, target).items():
        one = Generator(target, draft, **settings)(prompts, **call, **extra)
        sharded = Generator(target, draft, mesh=mesh, **settings)(prompts, **call, **extra)
        result[name] = {
            "one": np.asarray(one.tokens).tolist(),
            "mesh": np.asarray(sharded.tokens).tolist(),
            "accepted": int(np.asarray(one.stats.accepted).sum()),
        }
    return result


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
