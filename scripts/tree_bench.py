"""Trees against chains on a real target: tokens per round and speed against our own
autoregressive decoding, batch 1, interleaved runs (medians, compilation apart), on code
prompts written for this benchmark (not in any training corpus of the shipped head).

  python scripts/tree_bench.py --temperature 0 --chains 4,6,8 --trees 8:6:2,8:4:4
  python scripts/tree_bench.py --temperature 1 --block      # chains with block verification too
  python scripts/tree_bench.py --no-speed                   # tokens per round only

A tree is NODES:DEPTH:BRANCH (`Tree(nodes, depth, branch)`); a chain is its γ. The JSON
on the last line holds every figure; --out writes it to a file too.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import numpy as np

from jax_specdec import Generator, SamplingConfig
from jax_specdec.acceptance import accept_block_with_noise
from jax_specdec.bench import measure
from jax_specdec.cli.common import load_pair, trees
from jax_specdec.io import zoo

CODE_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import json\n\n\ndef load_settings(path):\n"
    '    """Read a JSON settings file and return a dict."""\n    with open(path) as f:\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'
    "        self.items = []\n\n    def push(self, item):\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n",
    'import csv\n\n\ndef read_rows(path):\n    """Yield each row of a CSV file as a dict."""\n',
    'def is_prime(n: int) -> bool:\n    """Whether n is a prime number."""\n    if n < 2:\n'
    "        return False\n",
    "def word_counts(text):\n    counts = {}\n    for word in text.split():\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def distance(self, other):\n",
]


def _generators(args, loaded, sampling):
    """{label: Generator} for autoregressive decoding, each chain and each tree."""
    target, draft = loaded.target, loaded.draft
    gens = {"autoregressive": Generator(target, sampling=sampling)}
    for gamma in map(int, filter(None, args.chains.split(","))):
        gens[f"chain {gamma}"] = Generator(target, draft, schedule=gamma, sampling=sampling)
        if args.block:
            gens[f"chain {gamma} block"] = Generator(
                target, draft, schedule=gamma, sampling=sampling, acceptance=accept_block_with_noise
            )
    for tree in trees(args.trees):
        label = f"tree {tree.nodes}:{tree.depth}:{tree.branch}"
        gens[label] = Generator(target, draft, schedule=tree.depth, tree=tree, sampling=sampling)
    return gens


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="models/smollm2-135m-eagle", help="a head, or ngram")
    p.add_argument("--chains", default="4,6,8", help="γ of each chain, comma-separated")
    p.add_argument("--trees", default="8:6:2,8:4:4", help="NODES:DEPTH:BRANCH, comma-separated")
    p.add_argument("--block", action="store_true", help="chains with block verification too")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(CODE_PROMPTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-speed", action="store_true", help="tokens per round only")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    zoo.enable_compilation_cache(True)
    loaded = load_pair(args.target, args.draft)
    ids = [loaded.tokenizer.encode(t).ids for t in CODE_PROMPTS[: args.prompts]]
    width = max(map(len, ids))  # one shape: every prompt reuses the compiled programs
    gens = _generators(args, loaded, SamplingConfig(args.temperature))
    totals = {label: {"tokens": 0, "rounds": 0, "seconds": 0.0} for label in gens}
    for i, prompt in enumerate(ids):
        array = np.zeros((1, width), np.int32)
        array[0, : len(prompt)] = prompt
        bound = dict(key=jax.random.key(i), max_new_tokens=args.max_new_tokens)
        runs = {
            label: gen.bind(array, prompt_lengths=[len(prompt)], **bound)
            for label, gen in gens.items()
        }
        outs = {label: jax.block_until_ready(run()) for label, run in runs.items()}
        if not args.no_speed:
            timed = measure(list(runs.values()), repeats=args.repeats)
            for label, t in zip(runs, timed, strict=True):
                totals[label]["seconds"] += t.seconds
        row = {"prompt": i}
        for label, out in outs.items():
            made = int(np.asarray(out.lengths)[0]) - 1  # the prefill's token is no round's
            rounds = int(np.asarray(out.stats.rounds)[0])
            totals[label]["tokens"] += made
            totals[label]["rounds"] += rounds
            row[label] = round(made / max(rounds, 1), 3)
        print(json.dumps(row), flush=True)
    summary = {}
    ar_seconds = totals["autoregressive"]["seconds"]
    for label, t in totals.items():
        entry = {"tokens_per_round": round(t["tokens"] / max(t["rounds"], 1), 3)}
        if not args.no_speed:
            entry["speedup"] = round(ar_seconds / t["seconds"], 3)
        summary[label] = entry
        print(f"{label:>22}: {entry}")
    result = {"args": vars(args), "summary": summary}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
