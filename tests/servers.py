"""The servers the test suite needs, and the databases its runs leave behind.

``bash scripts/test`` calls this module before pytest:

* ``python -m tests.servers``: one line saying which servers the tests need
  and whether each answers (standard library only: it runs before the
  Python packages are installed).
* ``python -m tests.servers --cleanup``: drop the test databases of earlier
  runs of ``scripts/test`` that are no longer running (an interrupted run
  leaves its 20 databases behind).

Each run of ``scripts/test`` has databases of its own: it sets
``DLOCK_TEST_DB_SUFFIX`` to a suffix of its own, ``_r<seconds>_<pid>`` (unless
the caller set one), so two runs on the same servers never share a database.
While it runs, its pytest process holds a PostgreSQL advisory lock named
after that suffix (:func:`hold_run_lock`, from ``tests/conftest.py``); a
suffix whose lock is free belongs to a run that ended, and ``--cleanup``
drops its databases on PostgreSQL and MariaDB (and its SQLite files).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

#: the suffix of a run of scripts/test (pytest-xdist workers add ``_gw<n>``)
RUN_SUFFIX = re.compile(r"_r\d+_\d+")
#: a test database of such a run, on either server: its run's suffix in group 1
RUN_DATABASE = re.compile(r"^(?:test_)?dlock(?:_q\d+)?(_r\d+_\d+)(?:_gw\d+)?$")
#: the advisory lock a run holds while it runs: (this class id, hashtext(suffix))
LOCK_CLASS = "django-dlock test run"


def servers() -> list[tuple[str, str, int]]:
    """(name, host, port) of each server the suite needs (tests/settings.py's overrides)."""
    env = os.environ.get
    return [
        (
            "PostgreSQL",
            env("DLOCK_TEST_PG_HOST", "127.0.0.1"),
            int(env("DLOCK_TEST_PG_PORT", "5432")),
        ),
        (
            "MariaDB",
            env("DLOCK_TEST_MYSQL_HOST", "127.0.0.1"),
            int(env("DLOCK_TEST_MYSQL_PORT", "3306")),
        ),
        ("RabbitMQ", "127.0.0.1", 5672),  # tests/celery_app.py's broker
    ]


def answers(host: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def status_line() -> str:
    parts = [
        f"{name} on {host}:{port} ({'answers' if answers(host, port) else 'NO ANSWER'})"
        for name, host, port in servers()
    ]
    return "scripts/test: the tests need " + ", ".join(parts)


def _pg(dbname: str = "postgres") -> Any:
    import psycopg

    env = os.environ.get
    return psycopg.connect(
        host=env("DLOCK_TEST_PG_HOST", "127.0.0.1"),
        port=int(env("DLOCK_TEST_PG_PORT", "5432")),
        user=env("DLOCK_TEST_PG_USER", "postgres"),
        dbname=dbname,
        autocommit=True,
        connect_timeout=5,
    )


def _mysql() -> Any:
    import pymysql

    env = os.environ.get
    return pymysql.connect(
        host=env("DLOCK_TEST_MYSQL_HOST", "127.0.0.1"),
        port=int(env("DLOCK_TEST_MYSQL_PORT", "3306")),
        user=env("DLOCK_TEST_MYSQL_USER", "root"),
        password=env("DLOCK_TEST_MYSQL_PASSWORD", ""),
        connect_timeout=5,
        autocommit=True,
    )


def hold_run_lock(suffix: str) -> Any:
    """Hold the run's lock on a connection of its own; keep the connection
    open as long as the run lasts (the lock goes with it)."""
    connection = _pg()
    connection.execute("SELECT pg_advisory_lock(hashtext(%s), hashtext(%s))", (LOCK_CLASS, suffix))
    return connection


def _ended(connection: Any, suffix: str) -> bool:
    """Whether the run of ``suffix`` has ended (its lock is free); the lock is
    held on ``connection`` afterwards, so that the run cannot begin meanwhile."""
    row = connection.execute(
        "SELECT pg_try_advisory_lock(hashtext(%s), hashtext(%s))", (LOCK_CLASS, suffix)
    ).fetchone()
    return bool(row[0])


def cleanup(current: str = "") -> list[str]:
    """Drop the databases of the runs that ended; their names. ``current``: this
    run's suffix (never dropped)."""
    dropped: list[str] = []
    pg = _pg()
    try:
        names = [
            row[0]
            for row in pg.execute("SELECT datname FROM pg_database WHERE datname LIKE '%dlock%'")
        ]
        mysql = None
        try:
            mysql = _mysql()
            with mysql.cursor() as cur:
                cur.execute("SHOW DATABASES LIKE '%dlock%'")
                mysql_names = [row[0] for row in cur.fetchall()]
        except Exception:  # MariaDB down: its databases stay, the run reports it
            mysql_names = []
        suffixes = {
            match.group(1)
            for name in [*names, *mysql_names]
            if (match := RUN_DATABASE.match(name)) and match.group(1) != current
        }
        for suffix in sorted(suffixes):
            if not _ended(pg, suffix):
                continue  # running
            for name in names:
                match = RUN_DATABASE.match(name)
                if match and match.group(1) == suffix:
                    pg.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                    dropped.append(f"PostgreSQL {name}")
            for name in mysql_names:
                match = RUN_DATABASE.match(name)
                if match and match.group(1) == suffix and mysql is not None:
                    with mysql.cursor() as cur:
                        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
                    dropped.append(f"MariaDB {name}")
            for path in Path(tempfile.gettempdir()).glob(f"django_dlock*{suffix}*.sqlite3*"):
                path.unlink(missing_ok=True)
            pg.execute(
                "SELECT pg_advisory_unlock(hashtext(%s), hashtext(%s))", (LOCK_CLASS, suffix)
            )
        if mysql is not None:
            mysql.close()
    finally:
        pg.close()
    return dropped


def main(argv: list[str]) -> int:
    if argv == ["--cleanup"]:
        current = os.environ.get("DLOCK_TEST_DB_SUFFIX", "")
        try:
            dropped = cleanup(current)
        except Exception as exc:  # PostgreSQL down: the status line said so
            print(f"scripts/test: no clean-up of earlier runs' databases ({exc})", file=sys.stderr)
            return 0
        if dropped:
            print(
                f"scripts/test: dropped {len(dropped)} database(s) of earlier runs that ended",
                file=sys.stderr,
            )
        return 0
    print(status_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
