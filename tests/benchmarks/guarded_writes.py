"""``python -m tests.benchmarks.guarded_writes``: a guarded write against a plain one.

One single-row ``UPDATE`` committed in ``transaction.atomic``, against the
same ``UPDATE`` in ``lk.guard()`` (the lock held throughout, as a holder
writes under a lock it took once), on PostgreSQL, SQLite and MariaDB. The
two run in turn, round after round, in one process; the table gives the
median rate of each and the median of the per-round time ratios
(guarded / plain), so drift between rounds cancels out.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.guard_settings")

PROBE = "dlock_bench_guard_probe"
LABELS = {"default": "PostgreSQL", "sqlite": "SQLite", "mysql": "MariaDB"}


def contenders(alias: str) -> dict[str, Callable[[], None]]:
    from django.db import connections, transaction

    import django_dlock as dlock

    connection = connections[alias]
    with connection.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {PROBE} (id INTEGER PRIMARY KEY, n INTEGER)")
        cur.execute(f"DELETE FROM {PROBE}")
        cur.execute(f"INSERT INTO {PROBE} (id, n) VALUES (1, 0)")
        # a run stopped midway leaves its lease (this database is the benchmark's own)
        cur.execute("DELETE FROM django_dlock_lock WHERE name = 'lock:bench:guard'")
    sql = f"UPDATE {PROBE} SET n = n + 1 WHERE id = 1"
    lk = dlock.lock("bench:guard", using=alias, ttl=3600)
    assert lk.acquire(timeout=10)

    def plain() -> None:
        with transaction.atomic(using=alias), connection.cursor() as cur:
            cur.execute(sql)

    def guarded() -> None:
        with lk.guard(), connection.cursor() as cur:
            cur.execute(sql)

    return {"plain": plain, "guarded": guarded}


#: what the benchmark page says above the table
INTRO = [
    "One single-row `UPDATE` committed in `transaction.atomic`, against the same",
    "`UPDATE` in `lk.guard()` (the lock held throughout), in turn, round after round,",
    "on each database ([safe writes](safe-writes.md)). On PostgreSQL a guard adds",
    "no round trip: its idle bound goes with `BEGIN`, its check (prepared once per",
    "session, in a savepoint) with `COMMIT`, in libpq's pipeline mode; what is left",
    "is the server's work on the check and the client's on the pipeline. On",
    "MySQL/MariaDB a guard adds three statements (the session's `wait_timeout` set",
    "and restored, the check), on SQLite one.",
]


def run_apart(rounds: int, seconds: float) -> list[str]:
    """The table, measured in a process of its own (it has databases of its own)."""
    from .common import run_apart as apart

    return apart(
        "tests.benchmarks.guarded_writes", "tests.benchmarks.guard_settings", rounds, seconds
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.guarded_writes")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)

    from .common import ensure_databases, interleaved, setup_django

    setup_django()
    ensure_databases()
    print("| database | plain atomic, writes/s | guarded, writes/s | guarded / plain, time |")
    print("| --- | ---: | ---: | ---: |")
    for alias, label in LABELS.items():
        series = interleaved(contenders(alias), args.rounds, args.seconds)
        plain, guarded = series["plain"], series["guarded"]
        ratio = statistics.median(p / g for p, g in zip(plain.rates, guarded.rates, strict=True))
        print(f"| {label} | {plain.rate:,.0f} | {guarded.rate:,.0f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
