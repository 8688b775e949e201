"""Quorum locks: a pair on three databases vs on one, and with one database down.

``python -m tests.benchmarks.quorum [--rounds N] [--seconds S]`` prints a
table. The three databases are ``dlock_bench_q1..3`` (plus
``DLOCK_TEST_DB_SUFFIX``) on the benchmark's PostgreSQL server, created and
migrated by the run. "One down" refuses new connections to the third
database (``ALLOW_CONNECTIONS false``) and ends its sessions, as a server
that went away would.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

QUORUM = ["q1", "q2", "q3"]


def add_aliases() -> None:
    from tests.benchmarks import settings

    suffix = os.environ.get("DLOCK_TEST_DB_SUFFIX", "")
    for n, alias in enumerate(QUORUM, start=1):
        settings.DATABASES[alias] = {
            **settings.DATABASES["default"],
            "NAME": f"dlock_bench_q{n}{suffix}",
        }


def ensure() -> None:
    import psycopg
    from django.conf import settings
    from django.core.management import call_command

    db = settings.DATABASES["default"]
    dsn = f"host={db['HOST']} port={db['PORT']} user={db['USER']} dbname=postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:
        for alias in ["default", *QUORUM]:
            name = settings.DATABASES[alias]["NAME"]
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            if found.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')
            else:  # a run that was interrupted may have left it refusing connections
                conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    for alias in ["default", *QUORUM]:
        call_command("migrate", database=alias, verbosity=0)


def _availability(alias: str, up: bool) -> None:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    name = settings.DATABASES[alias]["NAME"]
    dsn = f"host={db['HOST']} port={db['PORT']} user={db['USER']} dbname=postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if up else "false"}')
        if not up:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                [name],
            )


def run(rounds: int, seconds: float) -> dict[str, Any]:
    import django_dlock as dlock
    from django_dlock.strategies import quorum

    from .common import interleaved

    single = dlock.lock("bench-quorum", using="q1", ttl=30)
    majority = dlock.lock("bench-quorum", using=QUORUM, ttl=30)

    def single_pair() -> None:
        with single:
            pass

    def quorum_pair() -> None:
        with majority:
            pass

    results = interleaved(
        {"lease on one database": single_pair, "quorum lease on 3 databases": quorum_pair},
        rounds,
        seconds,
    )
    _availability("q3", up=False)
    try:
        results.update(interleaved({"quorum, q3 down": quorum_pair}, rounds, seconds))
    finally:
        _availability("q3", up=True)
        quorum.close_all()
    return results


def table(results: dict[str, Any]) -> list[str]:
    base = results["lease on one database"].rate
    lines = [
        "| work | pairs/s | p50 | p99 | vs one database |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, series in results.items():
        lines.append(
            f"| {name} | {series.rate:,.0f} | {series.p(50) * 1000:.2f} ms "
            f"| {series.p(99) * 1000:.2f} ms | {series.rate / base:.2f}x |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.quorum")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args(argv)
    add_aliases()
    from .common import setup_django

    setup_django()
    ensure()
    print("\n".join(table(run(args.rounds, args.seconds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
