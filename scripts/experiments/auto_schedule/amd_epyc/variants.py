"""auto's plain steps with parts of them taken out (monkeypatched, each compiled apart),
against autoregressive decoding: python variants.py BATCH TEMPERATURE [REPEATS]."""

import functools
import sys

sys.path.insert(0, "scripts")
import jax
import jax.numpy as jnp
from drafter_bench import held_out_prompts

from jax_specdec import Generator, SamplingConfig
from jax_specdec.bench import measure
from jax_specdec.decode import auto_costs, program
from jax_specdec.decode import round as rnd
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto

batch, temp = int(sys.argv[1]), float(sys.argv[2])
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
ids = held_out_prompts(loaded.tokenizer, batch, 64, "functions")
kw = dict(key=jax.random.key(0), max_new_tokens=64, sampling=SamplingConfig(temperature=temp))
ar = Generator(loaded.target).bind(ids, **kw)
a = Auto(widths=(0, 1, 2, 3, 4, 6, 8), round_costs=(1.0,) * 7)
base = Generator(loaded.target, loaded.draft, schedule=a).bind(ids, **kw)
auto0 = auto_costs._with_input(base, a.forcing(0))

orig_skipped, orig_then = rnd._skipped_round, program.then_skipping


def no_absorb(target, draft, state, config):
    return orig_skipped(target, None, state, config)


def const_skip(round_fn, target, draft, config):
    step = functools.partial(rnd._skipped_round, target, draft, config=config)
    return lambda s: jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, round_fn(s))


def compiled(run, patches):
    jax.clear_caches()
    for (mod, name), fn in patches.items():
        setattr(mod, name, fn)
    try:
        c = run.lower().compile()
    finally:
        rnd._skipped_round, program.then_skipping = orig_skipped, orig_then
    return lambda: c(*run.args)


runs = {
    "ar": compiled(ar, {}),
    "auto@0": compiled(auto0, {}),
    "no_absorb": compiled(auto0, {(rnd, "_skipped_round"): no_absorb}),
    "const_skip": compiled(auto0, {(program, "then_skipping"): const_skip}),
    "both": compiled(
        auto0, {(rnd, "_skipped_round"): no_absorb, (program, "then_skipping"): const_skip}
    ),
}
names = list(runs)
ms = measure([runs[n] for n in names], repeats=repeats)
for n, m in zip(names, ms, strict=True):
    r = int(m.stats.target_calls) - 1
    print(
        f"{n:10s} {m.seconds:7.3f} s {m.seconds * 1000 / r:7.2f} ms/round rounds {r:3d} "
        f"speed {ms[0].seconds / m.seconds:.3f} runs "
        + " ".join(f"{x:.2f}" for x in m.timing.runs),
        flush=True,
    )
