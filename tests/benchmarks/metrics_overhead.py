"""Cost of ``DLOCK_METRICS``: uncontended ``with dlock.lock(k)`` pairs, metrics off vs on vs before.

``python -m tests.benchmarks.metrics_overhead [--rounds 21] [--seconds 0.5]``

* **before**: ``Lock.acquire`` as it was before the metrics hook (no test of
  ``metrics.observer``), run by a subclass with the old method body;
* **off**: today's ``Lock`` with ``DLOCK_METRICS = None`` (the default);
* **on**: today's ``Lock`` with ``DLOCK_METRICS = "prometheus"``.

Rounds are interleaved (before, off, on, before, ...) so that drift on a
shared machine hits the three alike; the report gives the median rate of
of *off* (for scale) and the median of the ratios of the same round: the
rates drift between rounds by more than the three differ, so ratios of the
medians of each would not agree with the paired ones. On PostgreSQL
(``default``, the lease strategy) and on an in-memory SQLite database (no
network: the relative cost is largest there). Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.metrics_settings")


def contenders(alias: str) -> dict[str, tuple[Callable[[], None], Any]]:
    """name -> (pair, settings to run its rounds under)."""
    import django_dlock as dlock
    from django_dlock.locks import UNSET
    from django_dlock.retry import Deadline

    class Before(dlock.Lock):
        def acquire(self, blocking: bool = True, timeout: Any = UNSET) -> bool:
            deadline = Deadline(self._resolve_timeout(blocking, timeout))
            return self._acquire(self._options(), deadline)

    before = Before("bench-metrics", using=alias)
    now = dlock.lock("bench-metrics", using=alias)

    def run_before() -> None:
        with before:
            pass

    def run_now() -> None:
        with now:
            pass

    return {
        "before": (run_before, None),
        "off": (run_now, None),
        "on": (run_now, {"DLOCK_METRICS": "prometheus"}),
    }


def measure(alias: str, rounds: int, seconds: float) -> dict[str, list[float]]:
    from .common import measure_in_turn

    return measure_in_turn(contenders(alias), rounds, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.metrics_overhead")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)

    from .common import ensure_databases, setup_django

    setup_django()
    ensure_databases()
    print("| database | off, pairs/s (median) | off / before | on / off |")
    print("| --- | ---: | ---: | ---: |")
    for alias, label in (("default", "PostgreSQL"), ("memory", "SQLite (memory)")):
        rates = measure(alias, args.rounds, args.seconds)
        off = statistics.median(rates["off"])
        # ratios of the same round (paired): drift between rounds cancels out
        off_before = statistics.median(
            a / b for a, b in zip(rates["off"], rates["before"], strict=True)
        )
        on_off = statistics.median(a / b for a, b in zip(rates["on"], rates["off"], strict=True))
        print(f"| {label} | {off:,.0f} | {off_before:.3f} | {on_off:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
