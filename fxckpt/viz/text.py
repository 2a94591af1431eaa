"""Plain text and HTML for the tables fxckpt prints: byte counts, aligned columns, HTML tables.

The plan (:mod:`fxckpt.plan`) says which rows and columns it shows; how a table is laid out is
here, with nothing of fxckpt imported, so every view (the plan's text and notebook HTML, the
report, the CLI) lays tables out alike.
"""

from __future__ import annotations

import collections
import html
from typing import Mapping, Optional, Sequence

__all__ = ["format_bytes", "shorten", "count_kinds", "aligned", "html_table"]

Row = Sequence[str]


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ``...`` at the end when cut."""
    return text if len(text) <= width else text[: width - 3] + "..."


def count_kinds(kinds: Sequence[str]) -> str:
    """``addmm x2, gelu`` (most frequent first), or ``-``."""
    ranked = collections.Counter(kinds).most_common()
    return ", ".join(k if c == 1 else f"{k} x{c}" for k, c in ranked) or "-"


def aligned(header: Row, rows: Sequence[Row]) -> list[str]:
    """The header and the rows as text lines, each column as wide as its widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def html_table(header: Row, rows: Sequence[Row],
               hints: Optional[Mapping[str, str]] = None) -> str:
    """An HTML table; ``hints`` give a column's title (shown on hover)."""
    head = "".join(f'<th title="{html.escape((hints or {}).get(h, ""))}">{html.escape(h)}</th>'
                   for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
