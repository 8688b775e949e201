"""``python -m tests.benchmarks.semaphores``: a semaphore's and a read lock's
acquire + release against a lock's.

``with dlock.semaphore(key, permits=3): pass`` and ``with dlock.lock(key,
shared=True): pass`` against ``with dlock.lock(key): pass``, a new object per
call as users write them, uncontended, on PostgreSQL, SQLite and MariaDB.
The three run in turn, round after round, in one process; the table gives
the median rate of each and the median of the per-round time ratios (… /
lock), so drift between rounds cancels out.
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

    def read_lock() -> None:
        with dlock.lock("bench:semaphore", shared=True, using=alias):
            pass

    return {"lock": lock, "semaphore": semaphore, "read lock": read_lock}


#: what the benchmark page says above the table
INTRO = [
    f"`with dlock.semaphore(key, permits={PERMITS})` against `with dlock.lock(key)`, a new",
    "object per call, uncontended, in turn, round after round, on each database",
    "([semaphores](semaphores.md)). A permit is a lease row like a lock's. On",
    "PostgreSQL a newcomer first tries the semaphore's first row alone, with a",
    "statement like a lock's acquire (it also checks that the caller holds no",
    "other permit); elsewhere one statement picks the first free row and counts",
    "the waiters ahead (on MySQL/MariaDB: one transaction that locks the rows).",
    "A read lock (`shared=True`, [read-write locks](semaphores.md#read-write-locks))",
    "writes the key's row and the reader's (on PostgreSQL in one statement); its",
    "release deletes the reader's row and shortens or frees the key's (on",
    "PostgreSQL a transaction of two statements).",
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
    print(
        "| database | lock, pairs/s | semaphore, pairs/s | read lock, pairs/s "
        "| semaphore / lock, time | read lock / lock, time |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for alias, label in LABELS.items():
        series = interleaved(contenders(alias), args.rounds, args.seconds)
        lock, semaphore, read = series["lock"], series["semaphore"], series["read lock"]

        def ratio(other: list[float], base: list[float] = lock.rates) -> float:
            return statistics.median(a / b for a, b in zip(base, other, strict=True))

        print(
            f"| {label} | {lock.rate:,.0f} | {semaphore.rate:,.0f} | {read.rate:,.0f} "
            f"| {ratio(semaphore.rates):.2f}x | {ratio(read.rates):.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
