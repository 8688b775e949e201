"""Measuring helpers: interleaved rounds, percentiles, raw connections."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.settings")
    import django

    django.setup()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Series:
    """Rounds of one contender: pairs per second per round, latency samples (s)."""

    name: str
    rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates) if self.rates else float("nan")

    def p(self, q: float) -> float:
        return percentile(self.latencies, q)


def run_for(pair: Callable[[], Any], seconds: float, series: Series) -> None:
    """Call ``pair`` for ``seconds``; record the rate and per-call latency."""
    samples: list[float] = []
    clock = time.perf_counter
    start = clock()
    end = start + seconds
    now = start
    while now < end:
        t0 = clock()
        pair()
        now = clock()
        samples.append(now - t0)
    series.rates.append(len(samples) / (now - start))
    series.latencies.extend(samples)


def interleaved(
    contenders: dict[str, Callable[[], Any]], rounds: int, seconds: float, warmup: float = 0.2
) -> dict[str, Series]:
    """Run every contender for ``seconds``, round after round, in turn."""
    results = {name: Series(name) for name in contenders}
    for pair in contenders.values():
        run_for(pair, warmup, Series("warmup"))
    for _ in range(rounds):
        for name, pair in contenders.items():
            run_for(pair, seconds, results[name])
    return results


#: the tables a lock writes (PostgreSQL): vacuumed between measured windows
LOCK_TABLES = ("django_dlock_lock", "django_dlock_waiter")


def vacuum(conn: Any, full: bool = False) -> None:
    """VACUUM the lock tables on ``conn`` (a raw autocommit connection to PostgreSQL).

    This machine's PostgreSQL runs with autovacuum off; a user's vacuums the
    tables while locks are taken. Without it the lock table only grows
    (every floor pair leaves a dead row and index entry, and an insert never
    reuses the space) and each window would start where the ones before left
    the table: a benchmark vacuums before each window, outside it, and once
    ``full`` at its start (the table rewritten to its live rows).
    """
    for table in LOCK_TABLES:
        conn.execute(f"VACUUM {'FULL ' if full else ''}{table}")


def raw_connection(alias: str = "default") -> Any:
    """A plain psycopg connection (autocommit) to the same database as ``alias``."""
    import psycopg
    from django.db import connections

    params = connections[alias].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
        params.pop(key, None)
    return psycopg.Connection.connect(autocommit=True, **params)


def ensure_databases() -> None:
    """Create the benchmark databases if missing (PostgreSQL and MySQL/MariaDB
    servers; SQLite makes its own), migrate them, and rewrite PostgreSQL's
    lock tables to their live rows (see :func:`vacuum`)."""
    from django.conf import settings
    from django.core.management import call_command

    for db in settings.DATABASES.values():
        engine = db["ENGINE"]
        if engine.endswith("postgresql"):
            import psycopg

            dsn = f"host={db['HOST']} port={db['PORT']} user={db['USER']} dbname=postgres"
            with psycopg.connect(dsn, autocommit=True) as conn:
                found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]])
                if found.fetchone() is None:
                    conn.execute(f'CREATE DATABASE "{db["NAME"]}"')
        elif engine.endswith("mysql"):
            import MySQLdb

            server = MySQLdb.connect(
                host=db["HOST"], port=int(db["PORT"]), user=db["USER"], password=db["PASSWORD"]
            )
            server.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{db['NAME']}`")
            server.close()
    for alias in settings.DATABASES:
        call_command("migrate", database=alias, verbosity=0)
        if settings.DATABASES[alias]["ENGINE"].endswith("postgresql"):
            with raw_connection(alias) as conn:
                vacuum(conn, full=True)


def run_apart(module: str, settings: str, rounds: int, seconds: float) -> list[str]:
    """What ``python -m <module> --rounds R --seconds S`` prints, as lines: a table
    measured in a process of its own (with ``settings``, its own databases)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", module, "--rounds", str(rounds), "--seconds", str(seconds)],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": settings},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()


def measure_in_turn(
    pairs: dict[str, tuple[Callable[[], None], Any]], rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Rates of each ``name -> (pair, settings or None)``, its rounds run in turn
    (a, b, c, a, ...) under its settings, after a warm-up of each."""
    from contextlib import AbstractContextManager, nullcontext

    from django.test.utils import override_settings

    results = {name: Series(name) for name in pairs}

    def scope(options: Any) -> AbstractContextManager[Any]:
        return nullcontext() if options is None else override_settings(**options)

    for pair, options in pairs.values():  # warm up
        with scope(options):
            run_for(pair, 0.3, Series("warmup"))
    for _ in range(rounds):
        for name, (pair, options) in pairs.items():
            with scope(options):
                run_for(pair, seconds, results[name])
    return {name: series.rates for name, series in results.items()}
