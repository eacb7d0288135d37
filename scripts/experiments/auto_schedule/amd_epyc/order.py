"""Position in the interleaved pass: the same autoregressive program twice, and auto's
fallback (autoregressive decoding's program with auto's config) before and after."""

import sys

sys.path.insert(0, "scripts")
import jax
from drafter_bench import held_out_prompts

from jax_specdec import Generator
from jax_specdec.bench import measure
from jax_specdec.io.draft import load_pair

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
ids = held_out_prompts(loaded.tokenizer, 16, 64, "functions")[:8]
kw = dict(key=jax.random.key(0), max_new_tokens=64)
ar = Generator(loaded.target).bind(ids, **kw)
ar2 = Generator(loaded.target).bind(ids, **kw)
fb = Generator(loaded.target, loaded.draft).bind(ids, **kw)
assert fb.config.drafter is None
names = ["fb", "ar", "ar2", "fb again"]
ms = measure([fb, ar, ar2, fb], repeats=7)
for n, m in zip(names, ms, strict=True):
    print(
        f"{n:9s} fastest {min(m.timing.runs):.3f} median {m.seconds:.3f} runs",
        " ".join(f"{x:.2f}" for x in m.timing.runs),
        flush=True,
    )
