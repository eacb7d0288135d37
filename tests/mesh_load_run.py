"""Loading onto a mesh of 8 simulated CPU devices, in a process of its own (the device
count must be set before JAX starts). Prints one JSON line.

    python mesh_load_run.py tokens DIR...     # per checkpoint and mesh: shardings, tokens
    python mesh_load_run.py memory DIR MODE DATAxMODEL  # peak host memory of one load

MODE "sliced": `load_model(DIR, mesh=...)`; "whole": `load_model(DIR)` then
`Generator(mesh=...)` (whole tensors, then resharded: the path the sliced loader
replaces).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_specdec import Generator  # noqa: E402
from jax_specdec.io.hf import load_model  # noqa: E402
from jax_specdec.sharding import sharding_of  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11], [3, 3, 3]]
MESHES = ((1, 8), (2, 4))


def placed_as_planned(model, mesh) -> list[str]:
    """The parameters whose sharding is not `sharding_of`'s (none, when all is well)."""
    wrong = []
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        value = leaf.get_value()
        if not value.sharding.is_equivalent_to(sharding_of(mesh, path, value.shape), value.ndim):
            wrong.append("/".join(map(str, path)))
    return wrong


def tokens(directories):
    result = {}
    for directory in directories:
        one = load_model(directory)
        call = dict(key=jax.random.key(0), max_new_tokens=12)
        reference = np.asarray(Generator(one)(PROMPTS, **call).tokens)
        for shape in (s for s in MESHES if one.config.num_heads % s[1] == 0):
            mesh = jax.make_mesh(shape, ("data", "model"))
            on = load_model(directory, mesh=mesh)
            generator = Generator(on, mesh=mesh)
            leaves = jax.tree.leaves(nnx.state(on))
            held = jax.tree.leaves(generator._states[0])
            kept = all(a is b for a, b in zip(held, leaves, strict=True))
            resharded = Generator(one, mesh=mesh)(PROMPTS, **call).tokens
            result[f"{os.path.basename(directory)} {shape}"] = dict(
                wrong=placed_as_planned(on, mesh),
                kv_heads=[one.config.num_kv_heads, on.config.num_kv_heads],
                same=bool(np.array_equal(np.asarray(generator(PROMPTS, **call).tokens), reference)),
                same_resharded=bool(np.array_equal(np.asarray(resharded), reference)),
                kept=kept,
            )
    return result


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: getrusage's ru_maxrss would
    carry over the parent's peak through fork and exec, a pytest worker's gigabytes)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def device_bytes(tree) -> int:
    """What the devices hold of `tree`'s arrays (every replica counted: on simulated CPU
    devices, each is host memory)."""
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards)


def memory(directory, mode, shape):
    mesh = jax.make_mesh(tuple(map(int, shape.split("x"))), ("data", "model"))
    jax.numpy.zeros(8).block_until_ready()  # the backend up before the baseline
    before = peak_rss()
    if mode == "sliced":
        state = nnx.state(load_model(directory, mesh=mesh))
    else:
        state = Generator(load_model(directory), mesh=mesh)._states[0]  # resharded
    jax.block_until_ready(state)
    return dict(before=before, peak=peak_rss(), devices=device_bytes(state))


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    out = tokens(args) if what == "tokens" else memory(*args)
    print(json.dumps(out))
