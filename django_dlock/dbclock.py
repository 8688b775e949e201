"""The database clock: SQL for "now" and "now + n seconds", per database.

Leases are judged by the database's clock only, never the app server's.
Every statement and query that compares or sets ``expire_at`` uses these
expressions, so all writers and readers of a lease agree on one clock.

* PostgreSQL: ``statement_timestamp()`` (the start of the current statement;
  equal to ``now()`` in autocommit, and still current inside a long
  transaction).
* SQLite: ``strftime('%Y-%m-%d %H:%M:%f', 'now')``: UTC, milliseconds, in the
  text format Django stores datetimes in.

The fragments are written for statements executed *with parameters* through
Django's cursor, so a literal ``%`` is doubled (``%%``): Django turns it back
into ``%`` for the driver, and its debug SQL logging formats it safely.
* MySQL/MariaDB: ``UTC_TIMESTAMP(6)``: UTC whatever the session time zone,
  as Django stores datetimes with ``USE_TZ = True``.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField, Func
from django.db.models.sql.compiler import SQLCompiler

_NOW = {
    "postgresql": "statement_timestamp()",
    "sqlite": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')",
    "mysql": "UTC_TIMESTAMP(6)",
}

# "now + %s seconds": one float parameter.
_NOW_PLUS = {
    "postgresql": "(statement_timestamp() + %s * interval '1 second')",
    "sqlite": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s || ' seconds')",
    "mysql": "(UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND)",
}

# seconds from now until a datetime column (negative when past).
_SECONDS_UNTIL = {
    "postgresql": "EXTRACT(EPOCH FROM ({col} - statement_timestamp()))",
    "sqlite": "((julianday({col}) - julianday('now')) * 86400.0)",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {col}) / 1000000.0)",
}


# "the row's lease is live", for a write that names its row (by ``name``).
# On MySQL/MariaDB a single-table UPDATE chooses its index by estimate: with
# one live lease in the table, ``expire_at > now`` looks as selective as the
# unique name and MariaDB scans the expire_at index, locking every live
# lease's row it passes (other keys', other permits'). Locking rows in that
# order deadlocked against a transaction locking a semaphore's permits in
# name order. Compared through TIMESTAMPDIFF the column is no index range, so
# the statement finds its row by its name alone and locks only that row.
_LIVE_ROW = {
    "postgresql": "expire_at > statement_timestamp()",
    "sqlite": "expire_at > strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')",
    "mysql": "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_at) > 0",
}


def vendor(connection: BaseDatabaseWrapper) -> str:
    if connection.vendor not in _NOW:
        from django_dlock.exceptions import StrategyNotSupported

        raise StrategyNotSupported(
            f"django-dlock does not support the {connection.vendor!r} database "
            "(PostgreSQL, SQLite and MySQL/MariaDB are supported)"
        )
    return connection.vendor


def now_sql(connection: BaseDatabaseWrapper) -> str:
    return _NOW[vendor(connection)]


def now_plus_sql(connection: BaseDatabaseWrapper) -> str:
    """SQL for "now + %s seconds" (takes one float parameter)."""
    return _NOW_PLUS[vendor(connection)]


def live_row_sql(connection: BaseDatabaseWrapper) -> str:
    """SQL for "the row's lease is live" in a write that names its row: the
    database finds the row by its name, never by ``expire_at`` (see above)."""
    return _LIVE_ROW[vendor(connection)]


def seconds_until_sql(connection: BaseDatabaseWrapper, column: str) -> str:
    """SQL for the seconds from the database's now until ``column``."""
    return _SECONDS_UNTIL[vendor(connection)].format(col=column)


class DbNow(Func):
    """The database's current time as an ORM expression (see module doc)."""

    output_field = DateTimeField()
    template = "CURRENT_TIMESTAMP"

    def as_sql(  # type: ignore[override]
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        **extra_context: Any,
    ) -> tuple[str, list[Any]]:
        return now_sql(connection), []
