"""Drafters compared on one target: tokens per round, acceptance per draft position and
speed against our own autoregressive decoding of the same target (interleaved runs,
medians, compilation apart), for chains of γ drafts and token trees.

  python scripts/drafter_bench.py --draft models/smollm2-135m-eagle --repeats 5
  python scripts/drafter_bench.py --draft HEAD_A --versus HEAD_B --versus ngram
  python scripts/drafter_bench.py --prompt-kind code --max-new-tokens 64 \\
      --chains 4,6,8 --trees 8:6:2,8:4:4
  python scripts/drafter_bench.py --target models/stdlib-target \\
      --draft models/stdlib-draft --prompt-kind code --max-new-tokens 16   # seconds

--draft and each --versus (timed in the same runs): a feature head's or an EAGLE-3
head's directory, a draft model's directory (the target's tokenizer) or ngram. Each
drafts every chain of --chains (also with block verification under --block) and every
tree of --trees (NODES:DEPTH:BRANCH[:LOOKUP]). Prompts (--prompt-kind): files, the first
--prompt-len tokens of standard-library files held out of training; functions, the
openings of their functions; code, eight openings written for this benchmark (in no
training corpus); or one prompt a line of --prompt-file. Prints a JSON line per batch of
prompts and a line per setting over all of them; writes both to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec import Auto, FeatureHead, Generator, SamplingConfig, load_draft
from jax_specdec.bench import measure
from jax_specdec.cli.common import read_prompts, trees
from jax_specdec.io import zoo
from jax_specdec.io.draft import load_pair
from jax_specdec.training.corpus import stdlib_corpus
from jax_specdec.training.prompts import code_openings

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


def held_out_prompts(tokenizer, count: int, length: int, kind: str) -> list[list[int]]:
    """`count` prompts from the validation files (held out of training): "files", the
    first `length` tokens of a file; "functions", a function's opening (its def line and
    three more) of at most `length` tokens, spaced evenly over the openings."""
    corpus = stdlib_corpus()
    if kind == "functions":
        encoded = [tokenizer.encode(t).ids for t in code_openings(corpus.read(corpus.validation))]
        fitting = [ids for ids in encoded if 8 <= len(ids) <= length]
        return fitting[:: max(len(fitting) // count, 1)][:count]
    prompts = []
    for text in corpus.read(corpus.validation):
        ids = tokenizer.encode(text).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


def prompt_ids(args, tokenizer) -> list[list[int]]:
    """The prompts' token ids: --prompts of them (default: 4 held-out ones, or every one
    of the code openings or of --prompt-file)."""
    if args.prompt_file is None and args.prompt_kind != "code":
        return held_out_prompts(tokenizer, args.prompts or 4, args.prompt_len, args.prompt_kind)
    texts = CODE_PROMPTS if args.prompt_file is None else read_prompts(args.prompt_file)
    if not args.chat:
        return [tokenizer.encode(t).ids for t in texts][: args.prompts]
    from jax_specdec.io.chat import encode_chat, load_chat_template

    template = load_chat_template(args.target_dir)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return [encode_chat(tokenizer, template, user(t)) for t in texts][: args.prompts]


def settings(args, target, drafters: dict) -> list[tuple[str, str, Generator]]:
    """(drafter, round, Generator): autoregressive decoding first, then every drafter's
    chains (with block verification too under --block) and trees."""
    shapes = []
    for gamma in filter(None, args.chains.split(",")):
        if gamma.startswith("auto"):  # the default (auto:E: with explore E)
            explore = gamma.partition(":")[2]
            schedule = Auto(explore=float(explore)) if explore else "auto"
            shapes.append((gamma, dict(schedule=schedule)))
            continue
        gamma = int(gamma)
        shapes.append((f"chain {gamma}", dict(schedule=gamma)))
        if args.block:
            shapes.append((f"chain {gamma} block", dict(schedule=gamma, acceptance="block")))
    for t in trees(args.trees):
        shapes.append((f"tree {t.label}", dict(schedule=t.depth, tree=t)))
    sampling = SamplingConfig(args.temperature)
    out = [("none", "autoregressive", Generator(target, sampling=sampling))]
    for name, draft in drafters.items():
        for shape, kw in shapes:
            out.append((name, shape, Generator(target, draft, sampling=sampling, **kw)))
    return out


def positions(values) -> list[float | None]:
    return [None if np.isnan(v) else round(float(v), 3) for v in values]


def run_batch(args, gens, chunk, width, key) -> tuple[list[dict], list]:
    """Every setting on one batch of prompts (padded to `width`: one compiled program
    per setting for all batches), timed interleaved unless --no-speed. Returns an entry
    and the output of each setting."""
    array = np.zeros((len(chunk), width), np.int32)
    for row, ids in enumerate(chunk):
        array[row, : len(ids)] = ids
    bound = dict(key=key, max_new_tokens=args.max_new_tokens, prompt_lengths=list(map(len, chunk)))
    runs, binds = [], []
    for *_, gen in gens:  # auto compiles and measures its round costs when bound
        start = time.perf_counter()
        runs.append(gen.bind(array, **bound))
        binds.append(time.perf_counter() - start)
    if args.no_speed:
        timed, outs = None, [jax.block_until_ready(run()) for run in runs]
    else:
        timed = measure(runs, repeats=args.repeats)
        outs = [m.output for m in timed]
    entries = []
    for i, ((drafter, shape, _), out) in enumerate(zip(gens, outs, strict=True)):
        lengths = np.asarray(out.lengths)
        entry = {"drafter": drafter, "round": shape, "tokens": int(lengths.sum())}
        entry["rounds"] = int(np.asarray(out.stats.rounds).sum())
        entry["tokens_per_round"] = round(out.stats.tokens_per_round(out.lengths), 3)
        entry["accepted_through"] = positions(out.stats.acceptance_at())
        entry["alpha_per_position"] = positions(out.stats.conditional_acceptance_at())
        if shape == "auto" or shape.startswith("auto:"):
            rounds = np.asarray(out.stats.gamma_rounds)
            entry["rounds_per_width"] = {int(w): int(n) for w, n in enumerate(rounds) if n}
        if timed is not None:
            m = timed[i]
            entry["seconds"] = round(m.seconds, 4)
            entry["speedup"] = round(timed[0].seconds / m.seconds, 3)
            entry["fastest_s"] = round(min(m.timing.runs), 6)
            entry["tokens_per_s"] = round(m.tokens_per_second, 1)
            entry["compile_s"] = round(m.timing.compile, 2)
            entry["setup_s"] = round(binds[i] + m.timing.compile, 2)  # with auto's measuring
        entries.append(entry)
    return entries, outs


head_pass = nnx.jit(lambda head, prev, tokens, embed: head(prev, tokens, embed))
target_features = nnx.jit(lambda target, tokens: target(tokens, features=True)[1])


def reference_acceptance(target, head, prompt, new_tokens, gamma, width) -> list[int]:
    """Greedy rounds replayed with full forward passes (the target's true features up
    to each round's pending token, the head's own predictions after), every call padded
    to `width` tokens: how many drafts were accepted at each position. The loop must
    give the same counts."""
    embed = target.embed[...]
    ids, seq = np.asarray(head.vocab_map[...]), list(prompt) + list(new_tokens)
    pad = lambda t: jnp.asarray([t + [0] * (width - len(t))])
    length, end, accepted = len(prompt) + 1, len(seq), [0] * gamma
    while length < end:
        prev = np.zeros((1, width, target.config.d_model), np.float32)
        true = np.asarray(target_features(target, pad(seq[: length - 1])))
        prev[0, 1:length] = true[0, : length - 1]
        drafts = seq[:length]
        for _ in range(gamma):
            logits, predicted = head_pass(head, jnp.asarray(prev), pad(drafts), embed)
            drafts.append(int(ids[int(np.argmax(np.asarray(logits)[0, len(drafts) - 1]))]))
            prev[0, len(drafts) - 1] = np.asarray(predicted)[0, len(drafts) - 2]
        n = 0
        while n < gamma and length + n < end and drafts[length + n] == seq[length + n]:
            accepted[n], n = accepted[n] + 1, n + 1
        length += n + 1
    return accepted


def check_reference(args, target, head, out, prompt, width) -> dict:
    """The first chain's output `out` on the batch's first row (`prompt`) against the
    replay; exits if they differ."""
    new = np.asarray(out.tokens)[0, : int(np.asarray(out.lengths)[0])]
    gamma = int(next((g for g in args.chains.split(",") if not g.startswith("auto")), 4))
    width += args.max_new_tokens + gamma + 1
    expected = reference_acceptance(target, head, prompt, new, gamma, width)
    loop = np.asarray(out.stats.accepted_at)[0].tolist()
    if loop != expected:
        raise SystemExit(f"the loop's acceptance {loop} differs from the reference {expected}")
    return {"reference_accepted_at": expected, "loop_accepted_at": loop}


def summarize(rows: list[dict]) -> list[dict]:
    """Each setting over all batches: tokens per round, speedup (autoregressive seconds
    over the setting's, each summed over batches: medians, and `speedup_fastest` from
    each run's fastest pass, which a machine's slow spells do not reach) and tokens per
    second."""
    summary = []
    for i, first in enumerate(rows[0]["settings"]):
        parts = [row["settings"][i] for row in rows]
        entry = {"drafter": first["drafter"], "round": first["round"]}
        new = sum(p["tokens"] for p in parts) - sum(len(row["prompts"]) for row in rows)
        entry["tokens_per_round"] = round(new / max(sum(p["rounds"] for p in parts), 1), 3)
        if "seconds" in first:
            seconds = sum(p["seconds"] for p in parts)
            ar = sum(row["settings"][0]["seconds"] for row in rows)
            entry["speedup"] = round(ar / seconds, 3)
            fastest = sum(row["settings"][0]["fastest_s"] for row in rows)
            entry["speedup_fastest"] = round(fastest / sum(p["fastest_s"] for p in parts), 3)
            entry["tokens_per_s"] = round(sum(p["tokens"] for p in parts) / seconds, 1)
        summary.append(entry)
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="models/smollm2-135m-eagle", help="a head, model or ngram")
    p.add_argument("--versus", action="append", default=[], help="another drafter (repeatable)")
    p.add_argument("--chains", "--gamma", default="4", help="γ of each chain, comma-separated")
    p.add_argument("--trees", default="", help="NODES:DEPTH:BRANCH[:LOOKUP], comma-separated")
    p.add_argument("--block", action="store_true", help="chains with block verification too")
    p.add_argument("--prompt-kind", choices=["files", "functions", "code"], default="files")
    p.add_argument("--prompt-file", help="one prompt per line (\\n for newlines)")
    p.add_argument("--chat", action="store_true", help="code or --prompt-file prompts as chat")
    p.add_argument("--prompts", type=int, help="how many (default: 4 held-out, all others)")
    p.add_argument("--prompt-len", type=int, default=64, help="files: tokens; functions: most")
    p.add_argument("--batch", type=int, default=1, help="prompts per call")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-speed", action="store_true", help="tokens per round only, untimed")
    p.add_argument(
        "--reference",
        action="store_true",
        help="greedy: check the first chain on each batch's first row against full re-runs "
        "of the feature head of --draft",
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/drafter_bench.json"))
    args = p.parse_args(argv)
    if args.reference and (args.temperature != 0 or not args.chains):
        p.error("--reference replays a chain's greedy rounds: give --chains, --temperature 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    zoo.enable_compilation_cache(True)
    try:
        loaded = load_pair(args.target, args.draft)
        target, draft, tokenizer = loaded[:3]
        args.target_dir = loaded.target_dir
        drafters = {args.draft: draft}
        drafters |= {v: load_draft(v, target, tokenizer) for v in args.versus}
        gens = settings(args, target, drafters)
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None
    head = getattr(draft, "head", draft)  # a feature head, attached or not
    if args.reference and not isinstance(head, FeatureHead):
        raise SystemExit("--reference replays a feature head's rounds: give one as --draft")
    prompts = prompt_ids(args, tokenizer)
    width = max(map(len, prompts))
    rows = []
    for start in range(0, len(prompts), args.batch):
        chunk, key = prompts[start : start + args.batch], jax.random.key(start)
        row = {"prompts": list(range(start, start + len(chunk)))}
        row["settings"], outs = run_batch(args, gens, chunk, width, key)
        if args.reference:
            row |= check_reference(args, target, head, outs[1], chunk[0], width)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"args": vars(args), "rows": rows, "summary": summarize(rows)}
    for entry in result["summary"]:
        print(json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
