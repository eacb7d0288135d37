"""`jax-specdec calibrate-tree HEAD`: measure how often a feature head's sampled tree
keeps each child, by depth and rank, and write it beside the head
(`io.head_acceptance`), so that its sampled trees grow where its walk goes.

It runs sampled-tree rounds (`--tree`, drawn at `--temperature`) over held-out
prompts: chat requests of the target's chat template and openings of functions from
Python's own standard library, files the shipped heads were not trained on (or one
prompt a line of `--prompt-file`), and counts at every step of the walk which child
ranks were tested and which was kept (`GenerationStats.rank_acceptance`).
"""

from __future__ import annotations

import dataclasses
import sys

from jax_specdec.cli import common


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate-tree",
        help="measure a feature head's acceptance in sampled trees by depth and child "
        "rank, and write it beside the head (tree_acceptance.json): its sampled trees "
        "then take the shape that acceptance favours",
    )
    p.add_argument("head", help="the feature head's directory (written into)")
    p.add_argument(
        "--target",
        default=common.DEFAULT_TARGET,
        help="the target the head drafts for (default: %(default)s)",
    )
    p.add_argument(
        "--tree",
        default="64:8:8",
        help="the measuring tree, NODES:DEPTH:BRANCH: its depth and branch bound the "
        "table (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the sampling the rounds run at; the table shapes sampled trees at every "
        "temperature (default: %(default)s)",
    )
    p.add_argument(
        "--prompts", type=int, default=16, help="held-out prompts (default: %(default)s)"
    )
    p.add_argument("--prompt-file", help="one prompt per line (\\n for newlines) instead")
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument(
        "--batch", type=int, default=8, help="rows the prompts run through (default: %(default)s)"
    )
    p.add_argument(
        "--min-tests",
        type=int,
        default=20,
        help="a rate measured on fewer tested children is left out (null) (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run, parser=p)


def run(args, parser) -> int:
    from jax_specdec.io.heads import is_feature_head

    try:
        if not is_feature_head(args.head):
            raise ValueError(f"HEAD: {args.head} is not a feature head directory")
        try:
            shapes = common.trees(args.tree)
        except ValueError as e:  # named as this flag
            raise ValueError(str(e).replace("--trees:", "--tree:")) from None
        if len(shapes) != 1:
            raise ValueError(f"--tree: one NODES:DEPTH:BRANCH, got {args.tree!r}")
        tree = shapes[0]
        if tree.lookup:
            raise ValueError("--tree: a sampled tree has no prompt lookup (NODES:DEPTH:BRANCH)")
        tree = dataclasses.replace(tree, sampled=True)
        if not args.temperature > 0:
            raise ValueError("--temperature must be > 0: a sampled tree draws its children")
        for name in ("prompts", "max_new_tokens", "batch", "min_tests"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        path, table, measured = _calibrate(args, tree)
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    print(f"wrote {path}: acceptance by depth (rows) and child rank (columns)", file=sys.stderr)
    for d, row in enumerate(table):
        print(f"  depth {d}: " + " ".join("  -  " if r is None else f"{r:.3f}" for r in row))
    print(f"  from {measured['rounds']} rounds over {measured['prompts']} prompts")
    return 0


def _calibrate(args, tree):
    import jax
    import numpy as np

    from jax_specdec import Generator, SamplingConfig
    from jax_specdec.io.draft import load_pair
    from jax_specdec.io.head_acceptance import acceptance_table, write_tree_acceptance

    loaded = load_pair(args.target, args.head)
    head = loaded.draft
    head.config = dataclasses.replace(head.config, tree_acceptance=())  # measure afresh
    ids = _prompt_ids(args, loaded)
    gen = Generator(
        loaded.target,
        head,
        schedule=tree.depth,
        tree=tree,
        sampling=SamplingConfig(args.temperature),
    )
    print(
        f"calibrating: {len(ids)} prompts, {args.max_new_tokens} tokens each, through "
        f"{min(args.batch, len(ids))} rows (one call; the first compiles)",
        file=sys.stderr,
    )
    out = gen(
        ids,
        key=jax.random.key(args.seed),
        max_new_tokens=args.max_new_tokens,
        num_slots=min(args.batch, len(ids)),
    )
    tested = np.asarray(out.stats.rank_tested).sum(0)
    kept = np.asarray(out.stats.rank_kept).sum(0)
    rounds = int(np.asarray(out.stats.rounds).sum())
    if tested[0, 0] < args.min_tests:
        raise ValueError(
            f"the first child was tested {tested[0, 0]} times, fewer than --min-tests "
            f"{args.min_tests}: give more --prompts or --max-new-tokens"
        )
    table = acceptance_table(tested, kept, args.min_tests)
    measured = {
        "target": str(loaded.target_dir),
        "tree": tree.label,
        "temperature": args.temperature,
        "prompts": len(ids),
        "prompt_file": args.prompt_file,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "rounds": rounds,
        "tested": tested.tolist(),
        "kept": kept.tolist(),
    }
    return write_tree_acceptance(args.head, table, measured), table, measured


def _prompt_ids(args, loaded) -> list[list[int]]:
    """--prompt-file's prompts, or --prompts held-out ones: chat requests (through the
    target's chat template, if it has one) and function openings, alternating."""
    tokenizer = loaded.tokenizer
    if args.prompt_file is not None:
        return [tokenizer.encode(t).ids for t in common.read_prompts(args.prompt_file)]
    from jax_specdec.io.chat import encode_chat, load_chat_template
    from jax_specdec.training.corpus import stdlib_corpus
    from jax_specdec.training.prompts import chat_requests, code_openings

    template = load_chat_template(loaded.target_dir)
    chats = [
        tokenizer.encode(t).ids
        if template is None
        else encode_chat(tokenizer, template, [{"role": "user", "content": t}])
        for t in chat_requests("held_out")
    ]
    corpus = stdlib_corpus()
    code = [tokenizer.encode(t).ids for t in code_openings(corpus.read(corpus.validation))]
    code = code[:: max(len(code) // args.prompts, 1)]
    mixed = [p for pair in zip(chats, code, strict=False) for p in pair]
    if len(mixed) < args.prompts:
        raise ValueError(f"--prompts {args.prompts}: only {len(mixed)} held-out prompts exist")
    return mixed[: args.prompts]
