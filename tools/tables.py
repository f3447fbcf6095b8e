"""Markdown tables of the benchmark reports and the generated docs pages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]]
) -> str:
    """A GitHub-markdown table, aligned so that it also reads in a terminal.

    Args:
      headers: the column names.
      rows: the rows, each with one cell per header (any ``str``-able).

    Returns:
      The table's lines joined by newlines, no trailing newline.

    Example::

      >>> print(markdown_table(["a", "bb"], [["xyz", 1]]))
      | a   | bb |
      |-----|----|
      | xyz | 1  |
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        cells = (c.ljust(w) for c, w in zip(row, widths, strict=True))
        return "| " + " | ".join(cells) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])
