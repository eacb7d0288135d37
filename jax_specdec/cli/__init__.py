"""The `jax-specdec` command line: one module per subcommand, each with `add_parser(sub)`
and `run(args, parser)`.

Subcommands import their heavy dependencies (jax, models) lazily, so `--help` and the
balance report start instantly.
"""

from __future__ import annotations

import argparse

from jax_specdec.cli import balance, batch, generate, sweep, train

__all__ = ["build_parser", "main"]

SUBCOMMANDS = (balance, generate, sweep, batch, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-specdec", description="Exact speculative decoding in JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args, args.parser)
