"""Slots vs fixed batches on the shipped pair: N prompts through S slots (one program
call) against N / S fixed batches of S rows (one call each, every batch running until
its slowest row is done), autoregressive and speculative, on two workloads:

- skewed: per-prompt budgets drawn from a geometric distribution (mean 32, cap 256);
- equal: every prompt has the same budget (32).

    python scripts/slots_bench.py [--prompts 256] [--slots 16] [--repeats 3]

Each program is compiled (and run once) before timing; the four ways of one workload
are then timed interleaved (`bench.time_interleaved`), medians of `--repeats` runs.
Writes bench_out/slots_bench.json (git-ignored; or --out) and prints a markdown table.
Run from the repository root.
"""

import json

import jax
import numpy as np
import pair_setup

from jax_specdec import Generator
from jax_specdec.bench import time_interleaved
from jax_specdec.report import markdown_table


def workloads(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    skewed = np.minimum(rng.geometric(1 / 32, size=n), 256)
    return {"skewed": skewed.tolist(), "equal": [32] * n}


def ways(generators, prompts, budgets, slots, key):
    """{(mode, way): fn} -> GenerationOutput-like (tokens generated, slot-rounds, rounds)."""
    out = {}
    for mode, g in generators.items():
        runs = [
            g.bind(prompts[part], key=key[part], max_new_tokens=budgets[part])
            for part in (slice(i, i + slots) for i in range(0, len(prompts), slots))
        ]
        out[mode, "fixed"] = lambda runs=runs: [r() for r in runs]
        one = g.bind(prompts, key=key, max_new_tokens=budgets, num_slots=slots)
        out[mode, "slots"] = lambda one=one: [one()]
    return out


def summary(outputs) -> dict:
    tokens = sum(int(np.sum(o.lengths)) for o in outputs)
    rounds = sum(int(np.sum(o.stats.rounds)) for o in outputs)
    slot_rounds = sum(int(o.stats.slot_rounds) for o in outputs)
    calls = sum(int(o.stats.target_calls) for o in outputs)
    return {"tokens": tokens, "occupancy": rounds / slot_rounds, "target_calls": calls}


def main() -> None:
    parser = pair_setup.parser(__doc__, "slots_bench")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    target, draft, tokenizer, texts = pair_setup.load_pair()
    prompts = [tokenizer.encode(texts[i % len(texts)]).ids for i in range(args.prompts)]
    keys = jax.random.split(jax.random.key(0), args.prompts)
    generators = {
        "autoregressive": Generator(target),
        "speculative": Generator(target, draft, schedule=args.gamma),
    }
    results = []
    for workload, budgets in workloads(args.prompts, seed=1).items():
        fns = ways(generators, prompts, budgets, args.slots, keys)
        timings = time_interleaved(list(fns.values()), repeats=args.repeats)
        for ((mode, way), fn), t in zip(fns.items(), timings, strict=True):
            s = summary(fn())
            row = {"workload": workload, "mode": mode, "way": way, **s}
            row |= {"seconds": t.median, "runs": list(t.runs), "first": t.first}
            row["tokens_per_second"] = s["tokens"] / t.median
            results.append(row)
            print(json.dumps(row), flush=True)
    meta = {"prompts": args.prompts, "slots": args.slots, "gamma": args.gamma}
    pair_setup.write_json(args.out, {"settings": meta, "results": results})
    print(markdown_table(*table(results)))


def table(results):
    rows = []
    for workload in ("skewed", "equal"):
        for mode in ("autoregressive", "speculative"):
            fixed, slots = (
                next(r for r in results if (r["workload"], r["mode"], r["way"]) == wanted)
                for wanted in ((workload, mode, "fixed"), (workload, mode, "slots"))
            )
            rows.append(
                [
                    workload,
                    mode,
                    f"{fixed['tokens_per_second']:.0f}",
                    f"{slots['tokens_per_second']:.0f}",
                    f"{slots['tokens_per_second'] / fixed['tokens_per_second']:.2f}",
                    f"{fixed['occupancy']:.2f}",
                    f"{slots['occupancy']:.2f}",
                ]
            )
    header = ["workload", "mode", "fixed tokens/s", "slots tokens/s", "slots / fixed"]
    return header + ["occupancy fixed", "occupancy slots"], rows


if __name__ == "__main__":
    main()
