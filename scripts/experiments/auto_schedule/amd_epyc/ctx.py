"""Seconds per round of forced widths in auto's program, over the first 24 tokens and
over 128: python ctx.py PROMPT_INDEX"""

import sys

sys.path.insert(0, "scripts")
import argparse

import jax
import jax.numpy as jnp
from drafter_bench import prompt_ids

from jax_specdec import Generator
from jax_specdec.bench import measure
from jax_specdec.decode import auto_costs
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
args = argparse.Namespace(
    prompt_file=None, prompt_kind="code", chat=True, prompts=4, target_dir=loaded.target_dir
)
ids = [prompt_ids(args, loaded.tokenizer)[int(sys.argv[1])]]
a = Auto(widths=(0, 1, 2, 3, 4, 6, 8), round_costs=(1.0,) * 7)
base = Generator(loaded.target, loaded.draft, schedule=a).bind(
    ids, key=jax.random.key(0), max_new_tokens=128
)
runs, names = [], []
for tokens in (1, 24, 128):
    for w in (0, 2, 3, 4):
        if tokens == 1 and w:
            continue
        runs.append(
            auto_costs._with_input(base, a.forcing(w), jnp.minimum(base.args.budgets, tokens))
        )
        names.append((tokens, w))
ms = measure(runs, repeats=7)
pre = min(ms[0].timing.runs)
for (t, w), m in zip(names, ms, strict=False):
    r = int(m.stats.target_calls) - 1
    if r:
        print(
            f"tokens {t:3d} width {w}: rounds {r:3d} "
            f"ms/round min {1000 * (min(m.timing.runs) - pre) / r:6.2f} "
            f"median {1000 * (m.seconds - pre) / r:6.2f}",
            flush=True,
        )
