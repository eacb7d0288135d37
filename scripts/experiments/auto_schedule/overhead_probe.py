import sys

import jax

from jax_specdec import Generator
from jax_specdec.bench import measure
from jax_specdec.decode import auto_costs
from jax_specdec.io.chat import encode_chat, load_chat_template
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
tpl = load_chat_template(loaded.target_dir)
TEXT = (
    "import json\n\n\ndef load_settings(path):\n"
    '    """Read a JSON settings file and return a dict."""\n    with open(path) as f:\n'
)
ids = [encode_chat(loaded.tokenizer, tpl, [{"role": "user", "content": TEXT}])]
# "bN" among the arguments: N rows of the prompt (default 1).
ids = ids * next((int(a[1:]) for a in sys.argv[1:] if a.startswith("b")), 1)
runs = {}
runs["ar"] = Generator(loaded.target).bind(ids, key=jax.random.key(0), max_new_tokens=96)
for g in (1, 2, 4):
    runs[f"c{g}"] = Generator(loaded.target, loaded.draft, schedule=g).bind(
        ids, key=jax.random.key(0), max_new_tokens=96
    )
menus = [tuple(int(x) for x in m.split(",")) for m in sys.argv[1:] if not m.startswith("b")]
for menu in menus:
    a = Auto(widths=menu, round_costs=tuple(1.0 for _ in menu))
    base = Generator(loaded.target, loaded.draft, schedule=a).bind(
        ids, key=jax.random.key(0), max_new_tokens=96
    )
    for g in (0, 1, 2, 4):
        if g in menu:
            runs[f"auto{menu}@{g}"] = auto_costs._with_input(base, a.forcing(g))
names = list(runs)
ms = measure([runs[n] for n in names], repeats=5)
ar = ms[0]
for n, m in zip(names, ms, strict=True):
    r = int(m.stats.target_calls) - 1
    print(
        f"{n:24s} {m.seconds * 1000 / r:7.1f} ms/round  rounds {r:3d} "
        f"tokens/round {m.stats.tokens_per_round(m.output.lengths):.2f}  "
        f"speedup {ar.seconds / m.seconds:.3f} compile {m.timing.compile:.1f}"
    )
