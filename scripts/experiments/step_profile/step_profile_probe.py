"""Profile decode loops on the SmolLM2 shapes; XLA:CPU thunk time per call, grouped by
op kind (custom calls by output shape). Cases are batch:tokens:cache:context.

    python scripts/experiments/step_profile/step_profile_probe.py 1:1:80:64,1:5:80:64

Op times are summed over threads, so they may add up to more than the call's wall time.
"""

import collections
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import jax
from flax import nnx
from step_cost import smollm_config

from jax_specdec.bench.timing import decode_step_loop
from jax_specdec.nn import Transformer

cases = [tuple(int(v) for v in c.split(":")) for c in sys.argv[1].split(",")]
steps, reps = 16, 5
model = Transformer(smollm_config(), rngs=nnx.Rngs(0))
for b, t, cl, ctx in cases:
    call, lower = decode_step_loop(
        model, batch=b, tokens_per_call=t, context=ctx, cache_len=cl, steps=steps
    )
    hlo = lower().compile().as_text()
    shapes = dict(re.findall(r"(ffi_call(?:\.\d+)?) = (\S+)", hlo))
    for _ in range(3):
        jax.block_until_ready(call())
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        walls.append((time.perf_counter() - t0) / steps)
    d = f"/tmp/step_profile/trace_{b}_{t}_{cl}"
    os.system(f"rm -rf {d}")
    with jax.profiler.trace(d):
        for _ in range(reps):
            jax.block_until_ready(call())
    f = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
    ev = json.load(gzip.open(f))["traceEvents"]
    tot = collections.Counter()
    cnt = collections.Counter()
    for e in ev:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        n = e["name"]
        if n.startswith(("$", "end:", "Pjit", "while", "Common", "Parse")) or "Thunk" in n:
            continue
        k = re.sub(r"\.\d+$", "", n)
        if k == "ffi_call":
            k = "ffi " + shapes.get(n, "?")
        tot[k] += e["dur"]
        cnt[k] += 1
    n = reps * steps
    walls.sort()
    ffi = sum(v for k, v in tot.items() if k.startswith("ffi"))
    print(
        f"== batch {b} tokens {t} cache {cl}: wall per call median {walls[2] * 1e3:.2f} ms; "
        f"ops sum {sum(tot.values()) / n / 1000:.2f} ms; ffi {ffi / n / 1000:.2f}"
    )
    for k, us in tot.most_common(22):
        print(f"{us / n / 1000:8.3f} ms  x{cnt[k] / n:6.1f}  {k[:100]}")
