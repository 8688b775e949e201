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
