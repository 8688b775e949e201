"""Benchmarks: ``python -m tests.benchmarks`` (not part of the test run).

Everything is measured side by side in one run on the same PostgreSQL (and
the local Redis for the comparisons), interleaved round by round (A B A B
...), and reported as medians with ratios. See ``docs/benchmarks.md``.
"""
