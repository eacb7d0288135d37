"""`jax-specdec sweep`: schedules × γ × temperature × batch on one pair; JSON, plots, table."""

from __future__ import annotations

import pathlib
import sys

from jax_specdec.cli import common
from jax_specdec.io.draft import load_pair
from jax_specdec.settings import check_seed

# Rows of one sweep call at most (each row holds its own caches for every program timed).
MAX_BATCH = 4096


def add_parser(sub) -> None:
    sw = sub.add_parser(
        "sweep",
        help="time draft-length schedules x γ x temperature x batch; JSON, plots, table",
    )
    sw.add_argument("--target", default=common.DEFAULT_TARGET, help="target model directory")
    sw.add_argument("--draft", default=common.DEFAULT_DRAFT, help="draft model directory")
    sw.add_argument(
        "--prompts", default=common.DEFAULT_PROMPTS, help="one prompt per line (\\n escapes)"
    )
    sw.add_argument("--batches", type=common.ints, default=[1, 8, 32, 64])
    sw.add_argument("--temperatures", type=common.floats, default=[0.0, 1.0])
    sw.add_argument("--gammas", type=common.ints, default=[1, 2, 3, 4, 6], help="constant γ values")
    sw.add_argument("--max-gamma", type=int, default=6, help="cap of the dynamic schedules")
    sw.add_argument("--threshold", type=float, default=0.4, help="confidence threshold τ")
    sw.add_argument("--max-new-tokens", type=int, default=64)
    sw.add_argument("--repeats", type=int, default=3)
    sw.add_argument(
        "--min-rows", type=int, default=8, help="small batches run on several prompt groups"
    )
    sw.add_argument(
        "--explore",
        type=float,
        default=0.0,
        help="also time the cost model planning this many posterior sds above its α (0: not)",
    )
    sw.add_argument(
        "--trees",
        default="",
        help="also time token trees NODES:DEPTH:BRANCH[:LOOKUP] (comma-separated; the draft "
        "a feature head)",
    )
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--out", default="sweep", help="output directory (default: ./sweep)")
    sw.set_defaults(handler=run, parser=sw)


def _check(args) -> None:
    args.trees = common.trees(args.trees)
    check_seed(args.seed)
    if pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
        raise ValueError(f"--out: {args.out} is a file; give a directory")
    if max(args.batches, default=1) > MAX_BATCH:
        raise ValueError(f"--batches must be at most {MAX_BATCH}, got {max(args.batches)}")
    if not args.batches or min(args.batches) < 1:
        raise ValueError(f"--batches must be positive integers, got {args.batches}")
    if not args.gammas or min(args.gammas) < 1:
        raise ValueError(f"--gammas must be positive integers, got {args.gammas}")
    if args.max_gamma < max(args.gammas):
        raise ValueError(f"--max-gamma ({args.max_gamma}) < largest --gammas")
    if not args.temperatures or min(args.temperatures) < 0:
        raise ValueError(f"--temperatures must be >= 0, got {args.temperatures}")
    if not 0.0 <= args.threshold <= 1.0:
        raise ValueError(f"--threshold must lie in [0, 1], got {args.threshold}")
    if not 0.0 <= args.explore < float("inf"):
        raise ValueError(f"--explore must be finite and >= 0, got {args.explore}")
    if args.max_new_tokens < 1 or args.repeats < 1 or args.min_rows < 1:
        raise ValueError("--max-new-tokens, --repeats and --min-rows must be >= 1")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the sweep's plots need matplotlib: pip install -e '.[plot]'") from None


def run(args, parser) -> int:
    try:
        _check(args)
        prompts = common.read_prompts(args.prompts)
        from jax_specdec.decode.drafters import drafting_model

        target, draft, tokenizer, _ = load_pair(args.target, args.draft)
        draft = drafting_model(draft, target)  # a head attached to the target, once
        if args.trees and not hasattr(draft, "head"):
            raise ValueError(
                "--trees needs a feature head as --draft (a draft model drafts chains)"
            )
    except (ValueError, OSError) as e:
        common.fail(parser, e)
    from jax_specdec.sweep import markdown_summary, run_sweep, write_report

    results = run_sweep(
        target,
        draft,
        [tokenizer.encode(p).ids for p in prompts],
        batches=args.batches,
        temperatures=args.temperatures,
        gammas=args.gammas,
        max_gamma=args.max_gamma,
        max_new_tokens=args.max_new_tokens,
        threshold=args.threshold,
        repeats=args.repeats,
        seed=args.seed,
        min_rows=args.min_rows,
        explore=args.explore,
        trees=args.trees,
    )
    results["models"] = {"target": str(args.target), "draft": str(args.draft)}
    paths = write_report(results, pathlib.Path(args.out))
    print(markdown_summary(results))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0
