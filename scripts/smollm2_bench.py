"""SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32): our autoregressive
and n-gram speculative decoding against transformers' greedy `generate` and its prompt
lookup, all timed interleaved in one process, compilation apart.

    python scripts/smollm2_bench.py --prompts 2        # the batch-1 table of docs/models.md
    python scripts/smollm2_bench.py --batch 8          # one batch of 8 rows (4 prompts x 2)
    python scripts/smollm2_bench.py --compile-only     # compile times (run it twice: the
                                                       # second run reads the persistent cache)

Tokens/s counts generated tokens (`--max-new-tokens`, no EOS stop, so every method
emits the same number). `weight pass` is the float32 weights' bytes over the
streaming read bandwidth measured in the same run: a lower bound on one decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPTS = [
    'def read_config(path):\n    """Read a configuration file and return a dict."""\n',
    "<|im_start|>user\nWrite a Python function that checks whether a number is prime."
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France? Explain briefly.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


def read_bandwidth() -> float:
    """Bytes/s of a streaming read of a 256 MiB float32 array (median of 5 sums)."""
    import numpy as np

    a = np.ones(64 << 20, dtype=np.float32)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - start)
    return a.nbytes / statistics.median(times)


def ours(target, rows, new_tokens, draft):
    import jax

    from jax_specdec.decode import Generator

    run = Generator(target, draft).bind(rows, key=jax.random.key(0), max_new_tokens=new_tokens)
    return lambda: jax.block_until_ready(run())


def theirs(model, rows, new_tokens, **kw):
    import torch

    width = max(len(r) for r in rows)  # left-padded, as transformers generates
    x = torch.tensor([[2] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def call():
        with torch.no_grad():
            return model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=2,
                **kw,
            )

    return call


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compile_times(target, tok, new_tokens: int) -> None:
    from jax_specdec.decode import NGram

    ids = [tok.encode(PROMPTS[0]).ids]
    for name, draft in (("n-gram speculative", NGram()), ("autoregressive", None)):
        fn = ours(target, ids, new_tokens, draft)
        first = timed(fn)
        steady = statistics.median(timed(fn) for _ in range(3))
        print(
            f"{name}: first call {first:.1f} s, then {steady:.2f} s: compile {first - steady:.1f} s"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N")
    parser.add_argument(
        "--batch", type=int, default=1, help="B > 1: one batch of the prompts, cycled to B rows"
    )
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args(argv)

    from jax_specdec import zoo

    zoo.enable_compilation_cache()
    import torch
    import transformers

    from jax_specdec.decode import NGram
    from jax_specdec.hf import load_model, load_tokenizer

    path = zoo.model_path("smollm2-135m")
    target, tok = load_model(path), load_tokenizer(path)
    if args.compile_only:
        compile_times(target, tok, args.max_new_tokens)
        return 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    n = args.max_new_tokens
    methods = {
        "ours, autoregressive": lambda ids: ours(target, ids, n, None),
        "ours, n-gram speculative (γ=4)": lambda ids: ours(target, ids, n, NGram()),
        "transformers generate (greedy)": lambda ids: theirs(hf, ids, n),
        "transformers prompt lookup (10)": lambda ids: theirs(
            hf, ids, n, prompt_lookup_num_tokens=10
        ),
    }
    seconds = {m: [] for m in methods}
    compiles = {m: [] for m in methods}
    if args.batch > 1:  # transformers' prompt lookup runs at batch 1 only
        methods.pop("transformers prompt lookup (10)")
        groups = [[PROMPTS[i % args.prompts] for i in range(args.batch)]]
    else:
        groups = [[p] for p in PROMPTS[: args.prompts]]
    for group in groups:
        ids = [tok.encode(p).ids for p in group]
        fns = {m: make(ids) for m, make in methods.items()}
        firsts = {m: timed(fn) for m, fn in fns.items()}
        runs = {m: [] for m in methods}
        for _ in range(args.repeats):  # interleaved: each method once per repeat
            for m, fn in fns.items():
                runs[m].append(timed(fn))
        for m in methods:
            seconds[m].append(statistics.median(runs[m]))
            compiles[m].append(firsts[m] - statistics.median(runs[m]))
        row = ", ".join(f"{m}: {n * len(ids) / seconds[m][-1]:.1f} tok/s" for m in methods)
        print(f"group {len(seconds[m])}: {row}", flush=True)
    bandwidth = read_bandwidth()
    weight_bytes = sum(x.nbytes for x in __import__("jax").tree.leaves(_state(target)))
    base = sum(seconds["ours, autoregressive"])
    print(
        f"| method (batch {args.batch}, greedy, {n} new tokens, {args.prompts} prompts) "
        "| tokens/s "
        "| vs ours autoregressive | first-call overhead |"
    )
    print("|---|---|---|---|")
    for m in methods:
        total = sum(seconds[m])
        print(
            f"| {m} | {n * args.batch * len(groups) / total:.1f} | {base / total:.2f}x "
            f"| {statistics.median(compiles[m]):.1f} s |"
        )
    step = weight_bytes / bandwidth
    print(
        f"| one weight pass ({weight_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s) "
        f"| {args.batch / step:.1f} (bound) | | |"
    )
    return 0


def _state(model):
    from flax import nnx

    return nnx.state(model)


if __name__ == "__main__":
    raise SystemExit(main())
