import jax
import jax.numpy as jnp

from jax_specdec import Generator
from jax_specdec.bench import measure
from jax_specdec.decode import auto_costs
from jax_specdec.io.chat import encode_chat, load_chat_template
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto, Custom

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
tpl = load_chat_template(loaded.target_dir)
TEXT = (
    "import json\n\n\ndef load_settings(path):\n"
    '    """Read a JSON settings file and return a dict."""\n    with open(path) as f:\n'
)
ids = [encode_chat(loaded.tokenizer, tpl, [{"role": "user", "content": TEXT}])]


def four(s):
    return jnp.full(s.active.shape, 4, jnp.int32)


runs = {}
runs["ar"] = Generator(loaded.target).bind(ids, key=jax.random.key(0), max_new_tokens=96)
runs["c4"] = Generator(loaded.target, loaded.draft, schedule=4).bind(
    ids, key=jax.random.key(0), max_new_tokens=96
)
runs["custom4"] = Generator(loaded.target, loaded.draft, schedule=Custom(four, max_gamma=4)).bind(
    ids, key=jax.random.key(0), max_new_tokens=96
)
a = Auto(widths=(0, 4), round_costs=(1.0, 1.0))
runs["auto04@4"] = auto_costs._with_input(
    Generator(loaded.target, loaded.draft, schedule=a).bind(
        ids, key=jax.random.key(0), max_new_tokens=96
    ),
    a.forcing(4),
)
names = list(runs)
ms = measure([runs[n] for n in names], repeats=5)
for n, m in zip(names, ms, strict=True):
    r = int(m.stats.target_calls) - 1
    print(
        f"{n:12s} {m.seconds * 1000 / r:7.1f} ms/round rounds {r} "
        f"speedup {ms[0].seconds / m.seconds:.3f}"
    )
