"""The numbers other pages quote from the benchmark page, kept in step with it.

``docs/benchmarks.md`` (written by ``python -m tests.benchmarks``) is the one
source of every measured number in the docs. Another page that states one
quotes a cell of one of its tables, with a marker right before the value
(an HTML comment, invisible on the site)::

    reaches <!-- bench: Uncontended :: advisory :: vs its raw floor -->0.83x its rate

``section :: row :: column``: the benchmark page's section whose ``##``
heading contains ``section``, the row of one of its tables whose first cell
is ``row`` (backticks ignored), and the column headed ``column``. The value
after the marker is that cell as the benchmark page writes it (then the
page's own unit, ``ms``, where the cell's is in its column's header).

A full benchmark run rewrites every quoted value (:func:`refresh`, called by
``tests/benchmarks/__main__.py`` after it wrote the page); ``python -m
tests.benchmarks.quotes`` does the same after a hand edit of the page. The
docs test ``tests/unit/test_benchmark_quotes.py`` fails when a quoted value
differs from its cell, when a marker names no cell, and when a page states a
ratio (``0.9x``, ``1.2×``) without quoting it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BENCHMARK_PAGE = "benchmarks.md"

#: a quote: its reference (section, row, column), then the value it shows
MARKER = re.compile(
    r"<!-- bench: (?P<section>.+?) :: (?P<row>.+?) :: (?P<column>.+?) -->"
    r"(?P<value>[\d.,]+x?)(?P<unit>(?: ms| µs| s| %|%)?)"
)
#: a cell's number and its unit (``0.55 ms``), if the cell has one
UNIT = re.compile(r"(?P<number>[\d.,]+x?)(?P<unit>(?: ms| µs| s| %|%)?)")

#: a ratio as pages write one: 0.9x, 1.18×, 1.5-1.8x, ~0.42–0.49× (not 0x1F, 1.8 × 10¹³)
RATIO = re.compile(r"(?<![\w.])~?\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?[x×](?!\w)")


class QuoteError(ValueError):
    """A marker names no cell of the benchmark page (or more than one)."""


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may quote the benchmark page: README.md and docs/*.md."""
    docs = sorted(p for p in (root / "docs").rglob("*.md") if p.name != BENCHMARK_PAGE)
    return [root / "README.md", *docs]


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def _plain(text: str) -> str:
    return text.replace("`", "").strip()


def lookup(benchmark_page: str, section: str, row: str, column: str) -> str:
    """The cell (``section``, ``row``, ``column``) of the benchmark page."""
    parts = re.split(r"^## ", benchmark_page, flags=re.MULTILINE)[1:]
    chosen = [part for part in parts if section in part.split("\n", 1)[0]]
    if len(chosen) != 1:
        raise QuoteError(f"{len(chosen)} sections of the benchmark page have {section!r}")
    found: list[str] = []
    header: list[str] | None = None
    for line in chosen[0].splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [_plain(cell) for cell in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the line under the header
        if _plain(cells[0]) == _plain(row) and column in header:
            found.append(cells[header.index(column)])
    if len(found) != 1:
        raise QuoteError(
            f"{len(found)} cells of section {section!r} are in row {row!r}, column {column!r}"
        )
    return found[0]


def quoted(text: str, benchmark_page: str) -> str:
    """``text`` with every quoted value replaced by its cell of the benchmark page."""

    def replace(match: re.Match[str]) -> str:
        cell = lookup(benchmark_page, match["section"], match["row"], match["column"])
        shape = UNIT.fullmatch(cell)
        if shape is None:
            raise QuoteError(f"the cell {cell!r} is not a number")
        marker = match.group(0)[: match.start("value") - match.start()]
        # a cell without a unit (the unit is in its column's header): the
        # page's own unit after the value stays
        return marker + cell + ("" if shape["unit"] else match["unit"])

    return MARKER.sub(replace, text)


def unquoted_ratios(text: str) -> list[str]:
    """The ratios ``text`` states outside quotes (and outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = MARKER.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    return RATIO.findall(text)


def refresh(root: Path = ROOT) -> list[Path]:
    """Rewrite every page's quoted values from the benchmark page; the pages changed.

    Raises :class:`QuoteError` (naming the page) before writing anything when
    a quote names no cell: a section, row or column renamed by the run.
    """
    benchmark_page = (root / "docs" / BENCHMARK_PAGE).read_text()
    new: dict[Path, str] = {}
    for page in pages(root):
        text = page.read_text()
        try:
            updated = quoted(text, benchmark_page)
        except QuoteError as exc:
            raise QuoteError(f"{page.relative_to(root)}: {exc}") from None
        if updated != text:
            new[page] = updated
    for page, text in new.items():
        page.write_text(text)
    return list(new)


if __name__ == "__main__":
    changed = refresh()
    for page in changed:
        print(f"updated {page.relative_to(ROOT)}", file=sys.stderr)
