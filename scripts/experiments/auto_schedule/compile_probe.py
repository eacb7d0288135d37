import sys
import time

import jax

from jax_specdec import Generator
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
ids = [loaded.tokenizer.encode("def read_config(path):\n    pass").ids]
for name in sys.argv[1:]:
    if name == "c4":
        sched = 4
    else:
        w = tuple(int(x) for x in name.split(","))
        sched = Auto(widths=w, round_costs=tuple(1.0 + 0.1 * i for i in range(len(w))))
    g = Generator(loaded.target, loaded.draft, schedule=sched)
    run = g.bind(ids, key=jax.random.key(0), max_new_tokens=64)
    t = time.time()
    c = run.lower().compile()
    print(name, "compile %.1f s" % (time.time() - t), flush=True)
