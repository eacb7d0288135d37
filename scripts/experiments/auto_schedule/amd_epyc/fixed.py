"""auto forced to plain steps against autoregressive decoding at 2 and 64 tokens per row:
what is fixed and what is per step. python fixed.py BATCH"""

import copy
import sys

sys.path.insert(0, "scripts")
import jax
import jax.numpy as jnp
from drafter_bench import held_out_prompts

from jax_specdec import Generator
from jax_specdec.bench import measure
from jax_specdec.decode import auto_costs
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto

batch = int(sys.argv[1])
loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
ids = held_out_prompts(loaded.tokenizer, batch, 64, "functions")
kw = dict(key=jax.random.key(0), max_new_tokens=64)
ar = Generator(loaded.target).bind(ids, **kw)
a = Auto(widths=(0, 1, 2, 3, 4, 6, 8), round_costs=(1.0,) * 7)
base = Generator(loaded.target, loaded.draft, schedule=a).bind(ids, **kw)
runs, names = [], []
for tokens in (2, 64):
    short = copy.copy(ar)
    short.args = ar.args._replace(budgets=jnp.minimum(ar.args.budgets, tokens))
    runs.append(short)
    names.append(f"ar {tokens}")
    runs.append(auto_costs._with_input(base, a.forcing(0), jnp.minimum(base.args.budgets, tokens)))
    names.append(f"auto@0 {tokens}")
ms = measure(runs, repeats=7)
for n, m in zip(names, ms, strict=False):
    print(
        f"{n:10s} fastest {min(m.timing.runs) * 1000:8.1f} ms "
        f"median {m.seconds * 1000:8.1f} ms steps {int(m.stats.target_calls)}",
        flush=True,
    )
