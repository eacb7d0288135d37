"""Token streams of the shipped pair and SmolLM2 + its head, for the before/after check."""

import json
import sys

import jax
import numpy as np

from jax_specdec import SamplingConfig, load_head, speculative_generate

try:  # the drafters in decode/drafters/
    from jax_specdec.decode.drafters import attach_head as attach
except ImportError:
    try:  # before: decode/head_drafter.py
        from jax_specdec.decode.head_drafter import attach_head as attach
    except ImportError:  # before io/ and training/
        from jax_specdec.decode.feature_drafter import attach
try:
    from jax_specdec.io import zoo
    from jax_specdec.io.hf import load_model, load_tokenizer
except ImportError:
    from jax_specdec.hf import load_model, load_tokenizer

    from jax_specdec import zoo
root = sys.argv[1]
out = {}
prompts_text = [l for l in open(f"{root}/models/prompts.txt").read().splitlines() if l.strip()][:3]
target, draft = (
    load_model(f"{root}/models/stdlib-target"),
    load_model(f"{root}/models/stdlib-draft"),
)
tok = load_tokenizer(f"{root}/models/stdlib-target")
ids = [tok.encode(p.replace("\\n", "\n")).ids for p in prompts_text]
for t in (0.0, 1.0):
    for seed in (0, 1):
        for i, p in enumerate(ids):
            o = speculative_generate(
                target,
                draft,
                [p],
                key=jax.random.key(seed),
                max_new_tokens=24,
                schedule=4,
                sampling=SamplingConfig(t),
            )
            out[f"pair_b1_t{t}_s{seed}_p{i}"] = np.asarray(o.tokens)[
                0, : int(o.lengths[0])
            ].tolist()
        o = speculative_generate(
            target,
            draft,
            ids,
            key=jax.random.key(seed),
            max_new_tokens=24,
            schedule=4,
            sampling=SamplingConfig(t),
        )
        out[f"pair_b3_t{t}_s{seed}"] = [
            np.asarray(o.tokens)[b, : int(o.lengths[b])].tolist() for b in range(3)
        ]
path = zoo.model_path("smollm2-135m")
sm, stok = load_model(path), load_tokenizer(path)
head = attach(load_head(f"{root}/models/smollm2-135m-eagle"), sm, stok)
sp = [stok.encode(x).ids for x in ["def read_config(path):\n", "import numpy as np\n\ndef mean("]]
for t in (0.0, 1.0):
    for seed in (0, 1):
        for i, p in enumerate(sp):
            o = speculative_generate(
                sm,
                head,
                [p],
                key=jax.random.key(seed),
                max_new_tokens=24,
                schedule=4,
                sampling=SamplingConfig(t),
            )
            out[f"smollm_head_t{t}_s{seed}_p{i}"] = np.asarray(o.tokens)[
                0, : int(o.lengths[0])
            ].tolist()
json.dump(out, open(sys.argv[2], "w"))
print(len(out), "streams")
