"""The course's one table: plain text that nbval can compare (``str``/``repr``, deterministic) and an HTML table
in Lab (``_repr_html_``). Build it from cells already formatted (``Table(header, rows, caption)``) or from dicts
or lists with per-column formats (``Table.of(rows, columns, formats=...)``).

Text layout: an optional caption line, the header, a line of dashes, one line per row; columns left-aligned,
two spaces apart, each line without trailing spaces. A table with no header prints its rows only.
"""
from __future__ import annotations

import html
from dataclasses import dataclass


@dataclass
class Table:
    header: list[str]
    rows: list[list]
    caption: str = ""

    @classmethod
    def of(cls, rows: list[dict] | list[list], columns: list[str] | None = None, *, formats: dict | None = None,
           caption: str = "") -> "Table":
        """Rows as dicts (``columns``: which keys, in order; the first row's keys by default; a missing key is an
        empty cell) or as lists (``columns``: the header, or none). ``formats`` maps a column to a format string
        (``"{:.1e}"``); other floats print to 4 significant digits, everything else as ``str``."""
        formats = formats or {}
        if rows and isinstance(rows[0], dict):
            columns = list(columns or rows[0])
            rows = [[r.get(c, "") for c in columns] for r in rows]
        header = list(columns or [])
        names = header or [None] * max((len(r) for r in rows), default=0)
        return cls(header, [[_cell(v, formats.get(c)) for v, c in zip(r, names)] for r in rows], caption)

    def __str__(self) -> str:
        lines = ([self.header] if self.header else []) + [list(r) for r in self.rows]
        widths = [max(len(str(c)) for c in col) for col in zip(*lines)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        out = [self.caption] if self.caption else []
        if self.header:
            out += [line(self.header), line(["-" * w for w in widths])]
        out += [line(r) for r in self.rows]
        return "\n".join(out)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = lambda s: html.escape(str(s))  # noqa: E731
        head = "".join(f"<th style='text-align:left'>{esc(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{esc(c)}</td>" for c in r) + "</tr>"
                       for r in self.rows)
        cap = f"<caption style='text-align:left'>{esc(self.caption)}</caption>" if self.caption else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value, fmt: str | None) -> str:
    if fmt is not None:
        return fmt.format(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
