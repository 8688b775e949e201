"""Every measured number the docs state comes from the benchmark page (no database).

Pages quote cells of docs/benchmarks.md with a marker (tests/benchmarks/quotes.py);
a benchmark run rewrites them. The front page once said 0.7x and 1.1x where
the benchmark page said 0.92x and 1.18x.
"""

from __future__ import annotations

import pytest

from tests.benchmarks.quotes import (
    BENCHMARK_PAGE,
    ROOT,
    QuoteError,
    lookup,
    pages,
    quoted,
    refresh,
    unquoted_ratios,
)

#: pages whose ratios are not the current benchmark's: the changelog records
#: what each release measured then
HISTORY = {"changelog.md"}

BENCH = (ROOT / "docs" / BENCHMARK_PAGE).read_text()


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.name)
def test_each_quoted_number_is_the_benchmark_pages(page):
    text = page.read_text()
    assert quoted(text, BENCH) == text, (
        f"{page.name} quotes numbers the benchmark page no longer holds: "
        "run python -m tests.benchmarks.quotes"
    )


@pytest.mark.parametrize(
    "page", [p for p in pages() if p.name not in HISTORY], ids=lambda page: page.name
)
def test_a_page_states_no_ratio_without_quoting_the_benchmark_page(page):
    assert unquoted_ratios(page.read_text()) == []


def test_the_front_page_quotes_the_benchmark_page():
    front = (ROOT / "docs" / "index.md").read_text()
    assert "<!-- bench: Uncontended :: lease :: vs its raw floor -->" in front
    assert lookup(BENCH, "Uncontended", "lease", "vs its raw floor") in front


PAGE = """# Benchmarks

## 1. Uncontended

| contender | pairs/s | p50 ms | vs its floor |
| --- | ---: | ---: | ---: |
| `lease` | 1,815 | 0.54 | 0.92x |

## 8. Quorum

| work | p50 |
| --- | ---: |
| quorum | 1.36 ms |
"""


def test_a_new_run_rewrites_every_quote(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / BENCHMARK_PAGE).write_text(PAGE)
    (tmp_path / "README.md").write_text("no numbers\n")
    stale = (
        "lease reaches <!-- bench: Uncontended :: lease :: vs its floor -->0.70x its floor, "
        "<!-- bench: Uncontended :: lease :: p50 ms -->0.61 ms p50, "
        "a quorum <!-- bench: Quorum :: quorum :: p50 -->3.00 ms.\n"
    )
    (tmp_path / "docs" / "index.md").write_text(stale)
    assert refresh(tmp_path) == [tmp_path / "docs" / "index.md"]
    assert (tmp_path / "docs" / "index.md").read_text() == (
        "lease reaches <!-- bench: Uncontended :: lease :: vs its floor -->0.92x its floor, "
        "<!-- bench: Uncontended :: lease :: p50 ms -->0.54 ms p50, "
        "a quorum <!-- bench: Quorum :: quorum :: p50 -->1.36 ms.\n"
    )
    assert refresh(tmp_path) == []


def test_a_quote_of_a_cell_the_run_no_longer_has_is_an_error(tmp_path):
    with pytest.raises(QuoteError, match="row 'row', column 'vs its floor'"):
        quoted("<!-- bench: Uncontended :: row :: vs its floor -->0.67x", PAGE)
    with pytest.raises(QuoteError, match="0 sections"):
        quoted("<!-- bench: Scaling :: lease :: N = 1 -->0.9x", PAGE)


def test_ratios_are_found_outside_quotes_and_code():
    text = "about 0.7× its rate, 1.5-1.8x, ~0.42–0.49×; 0x1F; 1.8 × 10¹³\n```\n2.0x\n```\n"
    assert unquoted_ratios(text) == ["0.7×", "1.5-1.8x", "~0.42–0.49×"]
