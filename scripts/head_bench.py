"""A feature head (or a standalone draft model) in the loop on its target: acceptance per
draft position, tokens per round, and speed against our own autoregressive decoding
(interleaved runs, medians, compilation apart), on prompts from the standard-library
files held out of training.

  python scripts/head_bench.py --target smollm2-135m --head models/smollm2-135m-eagle \
      --gamma 4 --batch 1 --max-new-tokens 128
  python scripts/head_bench.py --target smollm2-135m --draft DRAFT_DIR --gamma 4
  python scripts/head_bench.py --head HEAD_A --versus HEAD_B   # two heads, same runs
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_specdec import Generator, NGram, SamplingConfig
from jax_specdec.bench import measure
from jax_specdec.io import zoo
from jax_specdec.training.corpus import stdlib_corpus
from jax_specdec.training.prompts import code_openings


def held_out_prompts(tokenizer, count: int, length: int, kind: str = "files") -> list[list[int]]:
    """`count` prompts from the validation files (held out of training): "files", the
    first `length` tokens of a file; "functions", a function's opening (its def line and
    three more, as `--data self` makes its code prompts) of at most `length` tokens,
    spaced evenly over the openings."""
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


def per_position(stats) -> tuple[list[float], list[float]]:
    """(share of rounds whose first i + 1 drafts were accepted, acceptance at position i
    given that the drafts before it were accepted)."""
    drafted = np.asarray(stats.drafted_at).sum(0)
    accepted = np.asarray(stats.accepted_at).sum(0)
    reached = np.concatenate([drafted[:1], accepted[:-1]])
    cumulative = accepted / np.maximum(drafted, 1)
    return cumulative.round(3).tolist(), (accepted / np.maximum(reached, 1)).round(3).tolist()


@nnx.jit
def _head_pass(head, prev, tokens, embed):
    return head(prev, tokens, embed)


@nnx.jit
def _target_features(target, tokens):
    return target(tokens, features=True)[1]


def reference_acceptance(target, draft, prompt, new_tokens, gamma, width) -> list[int]:
    """Greedy rounds replayed with full forward passes (the target's true features up
    to each round's pending token, the head's own predictions after), every call
    padded to `width` tokens: how many drafts were accepted at each position. The
    loop must give the same counts."""
    head, embed = draft.head, draft.embed[...]
    ids, seq = np.asarray(head.vocab_map[...]), list(prompt) + list(new_tokens)
    pad = lambda t: jnp.asarray([t + [0] * (width - len(t))])  # noqa: E731
    length, end, accepted = len(prompt) + 1, len(seq), [0] * gamma
    while length < end:
        prev = np.zeros((1, width, target.config.d_model), np.float32)
        true = np.asarray(_target_features(target, pad(seq[: length - 1])))
        prev[0, 1:length] = true[0, : length - 1]
        drafts = seq[:length]
        for _ in range(gamma):
            logits, predicted = _head_pass(head, jnp.asarray(prev), pad(drafts), embed)
            drafts.append(int(ids[int(np.argmax(np.asarray(logits)[0, len(drafts) - 1]))]))
            prev[0, len(drafts) - 1] = np.asarray(predicted)[0, len(drafts) - 2]
        n = 0
        while n < gamma and length + n < end and drafts[length + n] == seq[length + n]:
            accepted[n], n = accepted[n] + 1, n + 1
        length += n + 1
    return accepted


def load_drafter(args):
    """(target, drafter, tokenizer): the feature head of --head attached to the target,
    or the draft model of --draft, through the CLI's loader (which refuses a draft
    whose tokenizer is not the target's)."""
    from jax_specdec.cli.common import load_pair

    try:
        return load_pair(args.target, args.head or args.draft)[:3]
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _attach(directory, target, tokenizer):
    """The head saved in `directory` (a feature head, or an EAGLE-3 head in the
    `speculators` format or the release layout), attached to the loaded target."""
    from jax_specdec.decode.eagle3_drafter import attach_eagle3
    from jax_specdec.decode.head_drafter import attach_head
    from jax_specdec.io import speculators

    try:
        if speculators.is_speculators(directory) or speculators.is_eagle3_release(directory):
            return attach_eagle3(directory, target)[1]
        return attach_head(directory, target, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--versus: {e}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    drafter = p.add_mutually_exclusive_group(required=True)
    drafter.add_argument("--head", help="a feature head's or an EAGLE-3 head's directory")
    drafter.add_argument("--draft", help="a draft model's directory (same tokenizer)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4, help="prompts (batches of --batch)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument(
        "--prompt-kind",
        choices=["files", "functions"],
        default="files",
        help="files: the first --prompt-len tokens of held-out files; functions: openings "
        "of the held-out files' functions",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-speed", action="store_true", help="acceptance only")
    p.add_argument("--ngram", action="store_true", help="time the n-gram proposer beside it")
    p.add_argument("--versus", help="a second head's directory, timed in the same runs")
    p.add_argument(
        "--reference",
        action="store_true",
        help="greedy: check each batch's first row against full re-runs of the head",
    )
    args = p.parse_args()
    if args.reference and (args.temperature != 0 or args.head is None):
        p.error("--reference replays a head's greedy rounds: use it with --head, --temperature 0")
    if args.versus and (args.head is None or args.no_speed):
        p.error(
            "--versus times a second head beside --head: use it with --head, without --no-speed"
        )
    zoo.enable_compilation_cache(True)
    target, draft, tokenizer = load_drafter(args)
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_len, args.prompt_kind)
    sampling = SamplingConfig(args.temperature)
    spec = Generator(target, draft, num_draft_tokens=args.gamma, sampling=sampling)
    plain = Generator(target, sampling=sampling)
    ngram = Generator(target, NGram(), num_draft_tokens=args.gamma, sampling=sampling)
    versus = None
    if args.versus:
        other = _attach(args.versus, target, tokenizer)
        versus = Generator(target, other, num_draft_tokens=args.gamma, sampling=sampling)
    rows = []
    for start in range(0, len(prompts), args.batch):
        chunk, key = prompts[start : start + args.batch], jax.random.key(start)
        bound = dict(key=key, max_new_tokens=args.max_new_tokens)
        runs = [spec.bind(chunk, **bound), plain.bind(chunk, **bound)]
        runs += [ngram.bind(chunk, **bound)] if args.ngram else []
        runs += [versus.bind(chunk, **bound)] if versus else []
        t0 = time.perf_counter()
        out = jax.block_until_ready(runs[0]())
        row = {"compile_and_run_seconds": round(time.perf_counter() - t0, 2)}
        if not args.no_speed:
            timed = measure(runs, repeats=args.repeats)
            row["speedup"] = round(timed[1].seconds / timed[0].seconds, 3)
            row["spec_tokens_per_s"] = round(
                int(np.asarray(out.lengths).sum()) / timed[0].seconds, 1
            )
            row["ar_tokens_per_s"] = round(int(np.asarray(out.lengths).sum()) / timed[1].seconds, 1)
            if args.ngram:
                row["ngram_speedup"] = round(timed[1].seconds / timed[2].seconds, 3)
            if versus:
                other = timed[-1].output
                made = int(np.asarray(other.lengths).sum())
                row["versus_speedup"] = round(timed[1].seconds / timed[-1].seconds, 3)
                row["versus_tokens_per_s"] = round(made / timed[-1].seconds, 1)
                per_round = other.stats.tokens_per_round(other.lengths)
                row["versus_tokens_per_round"] = round(float(per_round), 3)
        row["accepted_through"], row["alpha_per_position"] = per_position(out.stats)
        row["tokens_per_round"] = round(float(out.stats.tokens_per_round(out.lengths)), 3)
        if args.reference:
            new = np.asarray(out.tokens)[0, : int(np.asarray(out.lengths)[0])]
            width = args.prompt_len + args.max_new_tokens + args.gamma + 1
            expected = reference_acceptance(target, draft, chunk[0], new, args.gamma, width)
            row["reference_accepted_at"] = expected
            row["loop_accepted_at"] = np.asarray(out.stats.accepted_at)[0].tolist()
            if row["loop_accepted_at"] != expected:
                raise SystemExit(f"the loop's acceptance differs from the reference: {row}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
