"""device_bench.py's `load_8b` section: an 8B target through the sharded loader.

Writes a Llama-3.1-8B-shaped bfloat16 checkpoint (16 GB, constant weights: a step's time
does not depend on their values) on the measuring machine's disk, never carried there;
loads it with `load_model(path, mesh=...)` (every device's slice read by slice,
`jax_specdec.io.onto_mesh`) onto a (1, devices) mesh; then times one decode step and the
5-, 17- and 65-token verify calls (chains of 4, trees of 16 and 64 nodes) at batch 1, 8
and 64 against the bare weight matmuls (the weight-read floor). Deletes the checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import jax

from jax_specdec.bench import bare_matmul_time, decode_step_time
from jax_specdec.bench.random_checkpoint import LLAMA_8B, write_llama_checkpoint
from jax_specdec.io.hf import load_model

PLAN = dict(tokens=(1, 5, 17, 65), batches=(1, 8, 64), cache=(1024, 512), steps=8, repeats=3)
QUICK_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    rope_theta=10000.0,
)
QUICK_PLAN = dict(tokens=(1, 5), batches=(1,), cache=(64, 16), steps=2, repeats=1)


def load_8b(quick: bool, allows) -> dict:
    """The section's figures; `allows(label)` says whether the budget leaves time for a
    case (cases it refuses are left out, as device_bench's sections do)."""
    shape, plan = (QUICK_SHAPE, QUICK_PLAN) if quick else (LLAMA_8B, PLAN)
    root = tempfile.mkdtemp(prefix="jax_specdec_8b_")
    try:
        start = time.perf_counter()
        size = write_llama_checkpoint(f"{root}/ckpt", shape)
        written = time.perf_counter() - start
        mesh = jax.make_mesh((1, jax.device_count()), ("data", "model"))
        start = time.perf_counter()
        model = load_model(f"{root}/ckpt", mesh=mesh, dtype="bfloat16")
        jax.block_until_ready(jax.tree.leaves(model))
        loaded = time.perf_counter() - start
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = dict(bytes=size, write_s=written, load_s=loaded, devices=jax.device_count(), rows=[])
    cache_len, context = plan["cache"]
    for b in plan["batches"]:
        if not allows(f"load_8b B={b}"):
            break
        timing = dict(steps=plan["steps"], repeats=plan["repeats"])
        floor = bare_matmul_time(model, batch=b, **timing).median
        for t in plan["tokens"]:
            if not allows(f"load_8b T={t} B={b}"):
                continue
            call = decode_step_time(
                model, batch=b, tokens_per_call=t, context=context, cache_len=cache_len, **timing
            )
            result["rows"].append(
                dict(batch=b, tokens=t, ms=1e3 * call.median, floor_ms=1e3 * floor,
                     vs_floor=call.median / floor, compile_s=call.compile)
            )  # fmt: skip
    one = {r["batch"]: r["ms"] for r in result["rows"] if r["tokens"] == 1}
    for r in result["rows"]:
        r["vs_one_token"] = r["ms"] / one[r["batch"]] if r["batch"] in one else None
    return result


def markdown(result: dict) -> list[str]:
    """The section's lines of device_bench.md."""
    if not result:
        return []
    lines = [
        "",
        f"## An 8B target loaded onto the mesh ({result['bytes'] / 1e9:.1f} GB bfloat16, "
        f"{result['devices']} device(s)): written in {result['write_s']:.0f} s, loaded in "
        f"{result['load_s']:.1f} s",
        "",
        "| batch | tokens per row | ms | weight-read floor ms | vs floor | vs one token |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        one = "" if r["vs_one_token"] is None else f"{r['vs_one_token']:.2f}"
        lines.append(
            f"| {r['batch']} | {r['tokens']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | "
            f"{r['vs_floor']:.2f} | {one} |"
        )
    return lines
