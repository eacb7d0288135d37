"""`jax-specdec balance`: the closed-form balance of one drafted position."""

from __future__ import annotations

import argparse

from jax_specdec.cli.common import fail


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
    from jax_specdec.report import markdown_table

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
    table = markdown_table(
        ["quantity", *names],
        [[label, *(f"{float(v):.4f}" for v in values)] for label, values in rows],
    )
    return (
        f"{table}\n\nAccepted proposals emit {b.accepted.sum():.4f}; the rejected mass "
        f"{b.rejected_mass:.4f} is carried by the residual. "
        f"max |output - p| = {abs(b.output - p).max():.1e}, "
        f"max |wrong - p| = {abs(b.wrong_output - p).max():.4f}."
    )


def run(args, parser) -> int:
    import numpy as np

    try:
        text = format_balance(np.asarray(args.p, np.float64), np.asarray(args.q, np.float64))
    except ValueError as e:
        fail(parser, e)
    print(text)
    return 0


def add_parser(sub) -> None:
    bal = sub.add_parser(
        "balance",
        help="closed-form balance of one drafted position (docs/design.md)",
        description="Shows that accepted mass plus the residual correction gives back p, "
        "and that resampling rejections from plain p does not.",
    )
    bal.add_argument("--p", type=_distribution, default=[0.2, 0.5, 0.3], help="target p")
    bal.add_argument("--q", type=_distribution, default=[0.6, 0.3, 0.1], help="draft q")
    bal.set_defaults(handler=run, parser=bal)
