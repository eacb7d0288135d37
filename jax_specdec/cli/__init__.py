"""The `jax-specdec` command line: one module per subcommand, each with `add_parser(sub)`
and `run(args, parser)`.

Subcommands import their heavy dependencies (jax, models) lazily, so `--help` and the
balance report start instantly.
"""

from __future__ import annotations

import argparse

from jax_specdec.cli import (
    balance,
    batch,
    calibrate_tree,
    convert,
    convert_head,
    generate,
    sweep,
    train,
    train_drafter,
)

__all__ = ["build_parser", "main"]

SUBCOMMANDS = (
    balance,
    generate,
    sweep,
    batch,
    train,
    train_drafter,
    calibrate_tree,
    convert,
    convert_head,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-specdec", description="Exact speculative decoding in JAX."
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (~/.cache/jax_specdec/xla; "
        "also off with JAX_SPECDEC_COMPILE_CACHE=0)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jax_specdec.io.zoo import enable_compilation_cache

    args = build_parser().parse_args(argv)
    enable_compilation_cache(not args.no_compile_cache)
    return args.handler(args, args.parser)
