"""A full benchmark run rewrites the benchmark page without dropping the
sections that benchmarks measured apart wrote there (no database)."""

from __future__ import annotations

from tests.benchmarks.report import kept_sections

OLD = """# Benchmarks

intro

## Targets

old targets

## 1. Uncontended

old one

## 11. Tracing

traced, measured apart

## 12. Where a lease pair's time goes

parts, measured apart
"""

NEW = """# Benchmarks

intro

## Targets

new targets

## 1. Uncontended

new one
"""


def test_sections_measured_apart_are_kept_and_the_others_replaced():
    kept = kept_sections(OLD, NEW)
    assert kept.startswith("## 11. Tracing\n")
    assert "traced, measured apart" in kept
    assert "## 12. Where a lease pair's time goes\n\nparts, measured apart" in kept
    assert "old one" not in kept and "old targets" not in kept


def test_a_section_is_matched_by_its_title_not_its_number():
    renumbered = NEW + "\n## 13. Tracing\n\nnew tracing\n"
    assert "Tracing" not in kept_sections(OLD, renumbered)
    assert kept_sections(NEW, NEW) == ""


def test_the_cpu_table_gives_client_and_server_cost_per_pair_ours_over_the_floor():
    from tests.benchmarks.report import cpu_table
    from tests.benchmarks.scaling import Point

    one = Point("lease", "distinct keys", 1, ours_cpu=[(300.0, 200.0)], floor_cpu=[(200.0, 250.0)])
    # a server on another machine: its CPU is not known, and its cell is left empty
    two = Point("lease", "distinct keys", 2, ours_cpu=[(90.0, None)], floor_cpu=[(60.0, None)])
    hot = Point("lease", "one hot key", 1, ours_cpu=[(1.0, 1.0)], floor_cpu=[(1.0, 1.0)])
    lines = cpu_table([one, two, hot])
    assert "| lease | client | 300 / 200 (1.50x) | 90 / 60 (1.50x) |" in lines
    assert "| lease | server | 200 / 250 (0.80x) |  |" in lines
    assert sum(line.startswith("| lease |") for line in lines) == 2  # the hot key is left out
    assert cpu_table([hot]) == []


def test_a_cell_is_the_median_of_its_rounds_ratios_not_the_ratio_of_the_medians():
    from tests.benchmarks.report import cpu_table, scaling_table
    from tests.benchmarks.scaling import Point

    # the third round ran on a fast spell of the machine: both sides moved
    rounds = ([100.0, 90.0, 200.0], [100.0, 100.0, 300.0])
    point = Point("lease", "distinct keys", 1, *rounds)
    assert point.ratio == 0.9  # (the ratio of the medians is 1.0)
    point.ours_cpu = [(rate, None) for rate in rounds[0]]
    point.floor_cpu = [(rate, None) for rate in rounds[1]]
    assert "| lease | client | 100 / 100 (0.90x) |" in cpu_table([point])

    others = [Point(strategy, "distinct keys", 1, [1.0], [1.0]) for strategy in ("advisory", "row")]
    text = "\n".join(scaling_table([point, *others]))
    assert "100 / 100 (0.90x)" in text
    assert "Rounds per cell: 1 (3 for `lease` on distinct keys)" in text
