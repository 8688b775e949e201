"""``python -m tests.benchmarks.semaphores``: a semaphore's acquire + release against a lock's.

``with dlock.semaphore(key, permits=3): pass`` against ``with dlock.lock(key):
pass``, a new object per call as users write them, uncontended, on
PostgreSQL, SQLite and MariaDB. The two run in turn, round after round, in
one process; the table gives the median rate of each and the median of the
per-round time ratios (semaphore / lock), so drift between rounds cancels out.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.guard_settings")

LABELS = {"default": "PostgreSQL", "sqlite": "SQLite", "mysql": "MariaDB"}
PERMITS = 3


def contenders(alias: str) -> dict[str, Callable[[], None]]:
    import django_dlock as dlock

    def lock() -> None:
        with dlock.lock("bench:semaphore", using=alias):
            pass

    def semaphore() -> None:
        with dlock.semaphore("bench:semaphore", permits=PERMITS, using=alias):
            pass

    return {"lock": lock, "semaphore": semaphore}


#: what the benchmark page says above the table
INTRO = [
    f"`with dlock.semaphore(key, permits={PERMITS})` against `with dlock.lock(key)`, a new",
    "object per call, uncontended, in turn, round after round, on each database",
    "([semaphores](semaphores.md)). A permit is a lease row like a lock's; its",
    "statement also picks the first free one of the semaphore's rows and counts",
    "the waiters ahead (on MySQL/MariaDB: one transaction that locks the rows).",
]


def run_apart(rounds: int, seconds: float) -> list[str]:
    """The table, measured in a process of its own (it has databases of its own)."""
    from .common import run_apart as apart

    return apart("tests.benchmarks.semaphores", "tests.benchmarks.guard_settings", rounds, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.semaphores")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)

    from .common import ensure_databases, interleaved, setup_django

    setup_django()
    ensure_databases()
    print("| database | lock, pairs/s | semaphore, pairs/s | semaphore / lock, time |")
    print("| --- | ---: | ---: | ---: |")
    for alias, label in LABELS.items():
        series = interleaved(contenders(alias), args.rounds, args.seconds)
        lock, semaphore = series["lock"], series["semaphore"]
        ratio = statistics.median(a / b for a, b in zip(lock.rates, semaphore.rates, strict=True))
        print(f"| {label} | {lock.rate:,.0f} | {semaphore.rate:,.0f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
