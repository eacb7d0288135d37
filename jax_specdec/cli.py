"""The `jax-specdec` command line.

Subcommands import their heavy dependencies (jax, models) lazily, so `--help` and the
balance report start instantly.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _distribution(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.2,0.5,0.3, got {text!r}"
        ) from None


def format_balance(p, q) -> str:
    """The balance table of one position (see `exact.one_position`) as markdown text."""
    from jax_specdec.exact import one_position

    b = one_position(p, q)
    names = [chr(ord("A") + i) if len(b.output) <= 26 else str(i) for i in range(len(b.output))]
    rows = [
        ("p (target)", p),
        ("q (draft)", q),
        ("accepted min(p, q)", b.accepted),
        ("residual norm(max(0, p - q))", b.residual),
        ("output = accepted + rejected * residual", b.output),
        ("wrong: accepted + rejected * p", b.wrong_output),
    ]
    width = max(len(r[0]) for r in rows)
    lines = ["| " + "quantity".ljust(width) + " | " + " | ".join(f"{n:>6}" for n in names) + " |"]
    lines.append("|" + "-" * (width + 2) + "|" + "|".join("-" * 8 for _ in names) + "|")
    for label, values in rows:
        cells = " | ".join(f"{float(v):6.4f}" for v in values)
        lines.append(f"| {label.ljust(width)} | {cells} |")
    lines.append("")
    lines.append(
        f"Accepted proposals emit {b.accepted.sum():.4f}; the rejected mass "
        f"{b.rejected_mass:.4f} is carried by the residual. "
        f"max |output - p| = {abs(b.output - p).max():.1e}, "
        f"max |wrong - p| = {abs(b.wrong_output - p).max():.4f}."
    )
    return "\n".join(lines)


def _cmd_balance(args, parser) -> int:
    import numpy as np

    try:
        text = format_balance(np.asarray(args.p, np.float64), np.asarray(args.q, np.float64))
    except ValueError as e:
        parser.error(str(e))  # exit code 2, no traceback
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-specdec", description="Exact speculative decoding in JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bal = sub.add_parser(
        "balance",
        help="closed-form balance of one drafted position (DESIGN.md §2)",
        description="Shows that accepted mass plus the residual correction gives back p, "
        "and that resampling rejections from plain p does not.",
    )
    bal.add_argument("--p", type=_distribution, default=[0.2, 0.5, 0.3], help="target p")
    bal.add_argument("--q", type=_distribution, default=[0.6, 0.3, 0.1], help="draft q")
    bal.set_defaults(handler=_cmd_balance, parser=bal)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
