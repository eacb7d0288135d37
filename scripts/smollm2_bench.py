"""SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32): our autoregressive
and n-gram speculative decoding against transformers' greedy `generate` and its prompt
lookup, all timed interleaved in one process, compilation apart.

    python scripts/smollm2_bench.py --prompts 2        # batch 1, the first 2 prompts
    python scripts/smollm2_bench.py --batch 8          # one batch of 8 rows (4 prompts x 2)
    python scripts/smollm2_bench.py --temperature 1    # sampling at T = 1 (no top-k/top-p)
    python scripts/smollm2_bench.py --head models/smollm2-135m-eagle  # the feature head too
    python scripts/smollm2_bench.py --compile-only     # compile times of the main command's
                                                       # programs (run it twice: the second
                                                       # run reads the persistent cache)

Tokens/s counts generated tokens (`--max-new-tokens`, no EOS stop, so every method
emits the same number). `weight pass` is the float32 weights' bytes over the
streaming read bandwidth measured in the same run: a lower bound on one decode step.
"""

from __future__ import annotations

import argparse
import os
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


def ours(target, rows, new_tokens, draft, temperature=0.0):
    import jax

    from jax_specdec import SamplingConfig
    from jax_specdec.decode import Generator

    sampling = SamplingConfig(temperature=temperature)
    generator = Generator(target, draft, schedule=4, sampling=sampling)  # the γ it reports
    run = generator.bind(rows, key=jax.random.key(0), max_new_tokens=new_tokens)
    return lambda: jax.block_until_ready(run())


def theirs(model, rows, new_tokens, temperature=0.0, **kw):
    import torch

    width = max(len(r) for r in rows)  # left-padded, as transformers generates
    x = torch.tensor([[2] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    if temperature > 0:  # plain sampling: no top-k / top-p from the generation config
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)

    def call():
        with torch.no_grad():
            return model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=2,
                **kw,
            )

    return call


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compile_times(target, tok, new_tokens: int) -> None:
    """Tracing + lowering and XLA compilation (or a persistent-cache load) of the main
    command's programs, wall and CPU seconds (CPU time is steadier on a shared machine),
    and the size of the lowered program."""
    import jax

    from jax_specdec.decode import Generator, NGram

    ids = [tok.encode(PROMPTS[0]).ids]
    for name, draft, kw in (
        ("n-gram speculative, γ = 4", NGram(), {"num_draft_tokens": 4}),
        ("autoregressive", None, {}),
    ):
        run = Generator(target, draft, eos_token_id=2, **kw).bind(
            ids, key=jax.random.key(0), max_new_tokens=new_tokens
        )
        wall, cpu = time.perf_counter(), time.process_time()
        lowered = run.lower()
        lower_s = (time.perf_counter() - wall, time.process_time() - cpu)
        wall, cpu = time.perf_counter(), time.process_time()
        lowered.compile()
        compile_s = (time.perf_counter() - wall, time.process_time() - cpu)
        print(
            f"{name}: trace + lower {lower_s[0]:.1f} s (CPU {lower_s[1]:.1f} s), "
            f"compile or cache load {compile_s[0]:.1f} s (CPU {compile_s[1]:.1f} s), "
            f"StableHLO {len(lowered.as_text()) / 1e6:.2f} MB",
            flush=True,
        )


def methods(target, hf, n: int, temperature: float, batch: int, head=None) -> dict:
    """Method name -> make(ids) -> a call that generates n tokens for the rows `ids`;
    `head`, a feature head attached to `target`, adds its row."""
    from jax_specdec.decode import NGram

    t = temperature
    made = {
        "ours, autoregressive": lambda ids: ours(target, ids, n, None, t),
        "ours, n-gram speculative (γ=4)": lambda ids: ours(target, ids, n, NGram(), t),
    }
    if head is not None:
        made["ours, feature head (γ=4)"] = lambda ids: ours(target, ids, n, head, t)
    made |= {
        "transformers generate": lambda ids: theirs(hf, ids, n, t),
        "transformers prompt lookup (10)": lambda ids: theirs(
            hf, ids, n, t, prompt_lookup_num_tokens=10
        ),
    }
    if batch > 1:  # transformers' prompt lookup runs at batch 1 only
        made.pop("transformers prompt lookup (10)")
    if hf is None:
        made = {m: make for m, make in made.items() if m.startswith("ours")}
    return made


def time_groups(made: dict, groups, tok, repeats: int, new_tokens: int):
    """Per method, the median seconds of each group of prompts and its first-call overhead;
    the methods run interleaved, each once per repeat."""
    seconds = {m: [] for m in made}
    compiles = {m: [] for m in made}
    for group in groups:
        ids = [tok.encode(p).ids for p in group]
        fns = {m: make(ids) for m, make in made.items()}
        firsts = {m: timed(fn) for m, fn in fns.items()}
        runs = {m: [] for m in made}
        for _ in range(repeats):
            for m, fn in fns.items():
                runs[m].append(timed(fn))
        for m in made:
            seconds[m].append(statistics.median(runs[m]))
            compiles[m].append(firsts[m] - seconds[m][-1])
        row = ", ".join(f"{m}: {new_tokens * len(ids) / seconds[m][-1]:.1f} tok/s" for m in made)
        print(f"group {len(seconds[m])}: {row}", flush=True)
    return seconds, compiles


def report(args, target, seconds, compiles, groups) -> None:
    n = args.max_new_tokens
    bandwidth = read_bandwidth()
    weight_bytes = sum(x.nbytes for x in __import__("jax").tree.leaves(_state(target)))
    base = sum(seconds["ours, autoregressive"])
    mode = "greedy" if args.temperature == 0 else f"T = {args.temperature:g}"
    print(
        f"| method (batch {args.batch}, {mode}, {n} new tokens, {args.prompts} prompts) "
        "| tokens/s | vs ours autoregressive | first-call overhead |"
    )
    print("|---|---|---|---|")
    for m in seconds:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N")
    parser.add_argument(
        "--batch", type=int, default=1, help="B > 1: one batch of the prompts, cycled to B rows"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--ours-only", action="store_true", help="skip transformers")
    parser.add_argument("--head", help="a feature head directory to time beside the others")
    args = parser.parse_args(argv)

    from jax_specdec.io import zoo

    zoo.enable_compilation_cache()
    # torch's OpenMP threads spin at barriers by default; on a shared machine that made
    # transformers 5-10x slower (docs/performance.md). Set before torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import transformers

    from jax_specdec.io.hf import load_model, load_tokenizer

    path = zoo.model_path("smollm2-135m")
    target, tok = load_model(path), load_tokenizer(path)
    if args.compile_only:
        compile_times(target, tok, args.max_new_tokens)
        return 0
    hf = None
    if not args.ours_only:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    head = None
    if args.head:
        from jax_specdec.decode.drafters import attach_head
        from jax_specdec.io.heads import load_head

        head = attach_head(load_head(args.head), target, tok)
    made = methods(target, hf, args.max_new_tokens, args.temperature, args.batch, head)
    if args.batch > 1:
        groups = [[PROMPTS[i % args.prompts] for i in range(args.batch)]]
    else:
        groups = [[p] for p in PROMPTS[: args.prompts]]
    seconds, compiles = time_groups(made, groups, tok, args.repeats, args.max_new_tokens)
    report(args, target, seconds, compiles, groups)
    return 0


def _state(model):
    from flax import nnx

    return nnx.state(model)


if __name__ == "__main__":
    raise SystemExit(main())
