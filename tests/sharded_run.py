"""Runs in its own process with 8 simulated CPU devices (XLA_FLAGS must be set before
jax starts): sharded generation vs one device. Prints one JSON object, the result of each
mode named (or the traceback of the mode that failed), so that one process (one JAX
start) serves several tests:

    python tests/sharded_run.py equality   # meshes (8,1), (4,2), (2,4) vs one device
    python tests/sharded_run.py exactness  # the enumerated exactness test on mesh (4,2)
    python tests/sharded_run.py batch      # the batch job on meshes vs one device
    python tests/sharded_run.py drafters   # heads and trees on meshes vs one device
    python tests/sharded_run.py reference  # multihost_run.py's one-process reference
    python tests/sharded_run.py equality batch  # several modes in one process
"""

import json
import os
import sys
import time
import traceback

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_specdec import SamplingConfig, autoregressive_generate, speculative_generate  # noqa: E402
from jax_specdec.decode import Generator  # noqa: E402
from jax_specdec.schedules import Heuristic  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4)]
# The runs of `equality` on each mesh: every run on (4, 2); on the others the chains and
# plain decoding (the heuristic's and the slots' programs cost most to compile).
MESH_RUNS = {(4, 2): ("greedy", "sampled", "heuristic", "autoregressive", "slots")}
MESH_RUNS |= dict.fromkeys([(8, 1), (2, 4)], ("greedy", "sampled", "autoregressive"))


def equality():
    from helpers import make_model, ragged_prompts

    target = make_model(10, vocab=32, scale=0.3, num_kv_heads=4)
    draft = make_model(11, vocab=32, scale=0.3, num_layers=1, num_kv_heads=4)
    prompts = ragged_prompts(8, 32, seed=1)
    keys = jax.random.split(jax.random.key(5), 8)

    def greedy(model, **kw):  # also run on the restored target below
        return speculative_generate(
            model,
            draft,
            prompts,
            key=keys,
            max_new_tokens=16,
            num_draft_tokens=3,
            sampling=SamplingConfig(0.0),
            eos_token_id=3,
            **kw,
        )

    runs = {
        "greedy": lambda **kw: greedy(target, **kw),
        "sampled": lambda **kw: speculative_generate(
            target,
            draft,
            prompts,
            key=keys,
            max_new_tokens=16,
            num_draft_tokens=3,
            sampling=SamplingConfig(1.0, top_k=20),
            **kw,
        ),
        "heuristic": lambda **kw: speculative_generate(
            target,
            draft,
            prompts,
            key=keys,
            max_new_tokens=16,
            schedule=Heuristic(initial=2, max_gamma=4),
            sampling=SamplingConfig(0.8),
            **kw,
        ),
        "autoregressive": lambda **kw: autoregressive_generate(
            target, prompts, key=keys, max_new_tokens=16, sampling=SamplingConfig(1.0), **kw
        ),
        # 20 prompts with their own budgets through 8 slots (rows over the data axis).
        "slots": lambda **kw: speculative_generate(
            target,
            draft,
            ragged_prompts(20, 32, seed=2),
            key=jax.random.key(6),
            max_new_tokens=[3 + 5 * (b % 4) for b in range(20)],
            num_draft_tokens=3,
            sampling=SamplingConfig(1.0),
            eos_token_id=3,
            num_slots=8,
            **kw,
        ),
    }
    result = {"devices": len(jax.devices()), "meshes": {}}
    reference = {}
    for name, run in runs.items():
        start = time.perf_counter()
        out = run()
        reference[name] = np.asarray(out.tokens)
        result.setdefault("one_device_seconds", {})[name] = time.perf_counter() - start
    for shape in MESHES:
        mesh = jax.make_mesh(shape, ("data", "model"))
        entry = {}
        for name in MESH_RUNS[shape]:
            run, start = runs[name], time.perf_counter()
            out = run(mesh=mesh)
            tokens = np.asarray(out.tokens)
            entry[name] = bool(np.array_equal(tokens, reference[name]))
            entry[f"{name}_seconds"] = time.perf_counter() - start
            if name == "greedy":  # rows stay over the data axis (slots' outputs need not)
                entry["output_sharding"] = str(out.tokens.sharding.spec)
        run = Generator(target, draft, schedule=2, mesh=mesh).bind(
            prompts, key=keys, max_new_tokens=4
        )
        state = run.args.target_state
        q = state["blocks"][0]["attn"]["q"]["kernel"][...]
        down = state["blocks"][0]["mlp"]["down"]["kernel"][...]
        entry["q_kernel"] = [list(q.shape), list(q.addressable_shards[0].data.shape)]
        entry["down_kernel"] = [list(down.shape), list(down.addressable_shards[0].data.shape)]
        entry["prompt_rows_per_device"] = run.args.prompts.addressable_shards[0].data.shape[0]
        result["meshes"][str(shape)] = entry
    # A checkpoint restored by orbax straight into the (4, 2) layout.
    import tempfile

    from jax_specdec.io.checkpoint import restore_checkpoint, save_checkpoint
    from jax_specdec.sharding import param_sharding

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    directory = save_checkpoint(target, tempfile.mkdtemp() + "/target")
    restored = restore_checkpoint(directory, sharding=param_sharding(mesh))
    q = restored.blocks[0].attn.q.kernel[...]
    out = greedy(restored, mesh=mesh)
    result["restored"] = {
        "q_kernel": [list(q.shape), list(q.addressable_shards[0].data.shape)],
        "greedy": bool(np.array_equal(np.asarray(out.tokens), reference["greedy"])),
    }
    # Meshes that do not fit: refused with a message, before compiling ("kv" fits now:
    # a model axis of 4 repeats the draft's 2 key/value heads).
    narrow = make_model(12, vocab=32, num_layers=1)  # 2 key/value heads
    bad = {
        "batch": (target, draft, prompts[:6], (8, 1)),
        "heads": (target, draft, prompts, (1, 8)),
        "kv": (target, narrow, prompts, (2, 4)),
    }
    result["errors"] = {}
    try:
        speculative_generate(
            target,
            draft,
            prompts,
            key=jax.random.key(0),
            max_new_tokens=2,
            num_slots=6,
            mesh=jax.make_mesh((4, 2), ("data", "model")),
        )
        result["errors"]["slots"] = None
    except ValueError as e:
        result["errors"]["slots"] = str(e)
    for name, (t, d, p, shape) in bad.items():
        try:
            speculative_generate(
                t,
                d,
                p,
                key=jax.random.key(0),
                max_new_tokens=2,
                mesh=jax.make_mesh(shape, ("data", "model")),
            )
            result["errors"][name] = None
        except ValueError as e:
            result["errors"][name] = str(e)
    return result


def exactness():
    from helpers import (
        PROMPTS,
        chi_square_pvalue,
        exact_sequence_probs,
        make_model,
        sample_sequences,
    )

    target = make_model(0)
    draft = make_model(1, num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, mlp_dim=32)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sampling = SamplingConfig(1.0)
    seqs, stats = sample_sequences(target, draft, sampling, 2, None, seed=11, mesh=mesh)
    pvalues = [
        chi_square_pvalue(seqs[i::2], exact_sequence_probs(target, np.array(p), sampling, None))
        for i, p in enumerate(PROMPTS)
    ]
    return {"pvalues": pvalues, "alpha": stats.alpha}


def batch_job():
    """`jax-specdec batch` on one device and on meshes (4,2) and (8,1), with fixed
    batches and with slots: the same rows."""
    import tempfile

    from helpers import save_tiny_pair

    from jax_specdec.cli import main

    root = tempfile.mkdtemp()
    save_tiny_pair(root, num_kv_heads=4)
    prompts = ["def f(x):", "import os", "class A:", "for i in", "x = [", "if a:", "y = 1", "z"]
    with open(f"{root}/in.jsonl", "w") as f:
        for i in range(11):  # 11 rows: batches of 3 are padded to the data axis
            f.write(json.dumps({"id": i, "prompt": prompts[i % len(prompts)]}) + "\n")
    outputs = {}
    ways = {"fixed": ["--fixed-batches", "--batch-size", "3"]}
    # Calls of 5 rows through 3 slots, padded to the data axis on a mesh.
    ways["slots"] = ["--slots", "3", "--rows-per-call", "5"]
    # Each mesh and each way once beside the one-device reference.
    for mesh, way in ((None, "fixed"), ("4x2", "slots"), ("8x1", "fixed")):
        flags = ways[way]
        out = f"{root}/out-{mesh}-{way}.jsonl"
        argv = ["batch", "--target", f"{root}/target", "--draft", f"{root}/draft"]
        argv += ["--input", f"{root}/in.jsonl", "--output", out, *flags]
        argv += ["--temperature", "1", "--max-new-tokens", "8"]
        assert main(argv + ([] if mesh is None else ["--mesh", mesh])) == 0
        rows = [json.loads(line) for line in open(out)]
        outputs[f"{mesh}-{way}"] = {r["id"]: r["tokens"] for r in rows}
    return {
        "same": {m: outputs[m] == outputs["None-fixed"] for m in outputs},
        "rows": len(outputs["None-fixed"]),
    }


def drafters():
    """Feature and EAGLE-3 heads (chains, slots, trees) and the n-gram proposer's trees on
    meshes (4,2) and (2,4): the one-device tokens, greedy and sampled, and the head's
    weights split like a target's."""
    from helpers import make_eagle3, make_head, make_model, ragged_prompts

    from jax_specdec import NGram
    from jax_specdec.decode.tree import Tree

    target = make_model(10, vocab=32, scale=0.3, num_kv_heads=4)
    drafts = {
        "feature": make_head(target),
        "eagle3": make_eagle3(target, kept_ids=[0, 1, 2, 4, 5, 6, 7, 8], scale=0.05),
        "ngram": NGram(),
    }
    prompts = ragged_prompts(8, 32, seed=1)
    keys = jax.random.split(jax.random.key(5), 8)
    cases = [  # (draft, sampling temperature, extra arguments, mesh)
        *[(h, 0.0, {}, (4, 2)) for h in ("feature", "eagle3")],
        *[(h, 1.0, {"num_slots": 4}, (4, 2)) for h in ("feature", "eagle3")],
        *[(h, 1.0, {"tree": Tree(6, 3, 2)}, (2, 4)) for h in ("feature", "eagle3")],
        ("eagle3", 0.0, {"tree": Tree(6, 3, 2)}, (4, 2)),
        ("ngram", 0.0, {"tree": Tree(6, 3, 2)}, (4, 2)),
    ]
    same = {}
    for name, t, extra, shape in cases:
        kw = dict(key=keys, max_new_tokens=12, num_draft_tokens=3, eos_token_id=3, **extra)
        kw["sampling"] = SamplingConfig(t)
        one = speculative_generate(target, drafts[name], prompts, **kw).tokens
        mesh = jax.make_mesh(shape, ("data", "model"))
        out = speculative_generate(target, drafts[name], prompts, mesh=mesh, **kw).tokens
        same[f"{name} T={t} {sorted(extra)} {shape}"] = bool(np.array_equal(out, one))
    same.update(_chunked_prefill(target, drafts, prompts, keys))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q_kernels = {}
    for name, layers in (("feature", "blocks"), ("eagle3", "layers")):
        gen = Generator(target, drafts[name], schedule=3, mesh=mesh)  # only the layout is read
        run = gen.bind(prompts, key=keys, max_new_tokens=4)
        q = run.args.draft_state["head"][layers][0]["attn"]["q"]["kernel"][...]
        q_kernels[name] = [list(q.shape), list(q.addressable_shards[0].data.shape)]
    return {"same": same, "head_q_kernels": q_kernels}


def _chunked_prefill(target, drafts, prompts, keys):
    """A whole batch's prefill in chunks of 4 positions (prompts of up to 8), the target's
    and a head's, on mesh (4, 2): the one-device tokens (chunked too; the chunks' tokens
    are the one call's, tests/test_prefill.py)."""
    from jax_specdec.decode import prefill

    assert max(map(len, prompts)) > 4, "the prompts should take more than one chunk"
    chunk, prefill.BATCH_CHUNK = prefill.BATCH_CHUNK, 4
    jax.clear_caches()  # programs traced under the other chunk
    try:
        same = {}
        for name in ("feature", "eagle3"):
            kw = dict(key=keys, max_new_tokens=12, num_draft_tokens=3, sampling=SamplingConfig(1.0))
            one = speculative_generate(target, drafts[name], prompts, **kw).tokens
            mesh = jax.make_mesh((4, 2), ("data", "model"))
            out = speculative_generate(target, drafts[name], prompts, mesh=mesh, **kw).tokens
            same[f"{name} T=1.0 chunked prefill (4, 2)"] = bool(np.array_equal(out, one))
        return same
    finally:
        prefill.BATCH_CHUNK = chunk
        jax.clear_caches()


def reference():
    """The one-device tokens that the two processes of multihost_run.py must match."""
    from multihost_run import generate

    return generate(None)


def run_modes(names):
    modes = {"equality": equality, "exactness": exactness, "batch": batch_job}
    modes["drafters"] = drafters
    modes["reference"] = reference
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = modes[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["mode_seconds"] = round(time.perf_counter() - start, 1)
    return results


if __name__ == "__main__":
    print(json.dumps(run_modes(sys.argv[1:])))
