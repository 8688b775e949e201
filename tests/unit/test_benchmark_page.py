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
