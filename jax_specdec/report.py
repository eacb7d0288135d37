"""Markdown tables: the one formatter behind every table the project prints or writes."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table"]


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x×%"))
    except ValueError:
        return False
    return True


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table with padded columns; cells are `str()`-ed, numbers right-aligned.

    Args:
      header: column titles.
      rows: one sequence of cells per row, as long as `header`.
    """
    cells = [[str(c) for c in header]]
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {i} has {len(row)} cells, the header {len(header)}")
        cells.append(["" if c is None else str(c) for c in row])
    widths = [max(len(r[j]) for r in cells) for j in range(len(header))]
    numeric = [all(_is_number(r[j]) for r in cells[1:] if r[j]) for j in range(len(header))]

    def line(row):
        padded = (
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(row, widths, numeric, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])
