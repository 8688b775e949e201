"""The quorum's own statements on one database, beyond the lease strategy's.

A quorum lease acquires, extends and releases with the ``lease`` strategy's
statements; these are the ones it adds: raising a holder's fencing number,
asking whether a key is held, reading a key's live lease (:class:`LiveRow`,
for leader elections), and a task lock's release that keeps the lease for
its minimum hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock
from django_dlock.keys import Key
from django_dlock.strategies.base import Request
from django_dlock.strategies.connection import execute
from django_dlock.strategies.lease import TABLE, lease

__all__ = ["LiveRow", "fence_raise_sql", "live_row", "owned_sql", "release_after_on"]


@dataclasses.dataclass(frozen=True)
class LiveRow:
    """One database's live lease of a key, as :meth:`QuorumLease.live_rows` reads it."""

    owner: str
    fence: int
    since: Any
    expires: Any
    #: seconds until it ends, on that database's clock
    left: float


def fence_raise_sql(connection: BaseDatabaseWrapper) -> str:
    """Raise a live holding's fencing number (params: fence, name, token)."""
    biggest = "MAX" if connection.vendor == "sqlite" else "GREATEST"
    return (
        f"UPDATE {TABLE} SET fence = {biggest}(fence, %s) "
        f"WHERE name = %s AND token = %s AND {dbclock.live_row_sql(connection)}"
    )


def owned_sql(connection: BaseDatabaseWrapper, mine: bool) -> str:
    """A row if the key is held (params: name), by ``mine`` (params: name, token)."""
    now = dbclock.now_sql(connection)
    token = " AND token = %s" if mine else ""
    return f"SELECT 1 FROM {TABLE} WHERE name = %s{token} AND expire_at > {now}"


def live_row(connection: BaseDatabaseWrapper, key: Key) -> LiveRow | None:
    """The live lease of ``key`` on this database (``None``: free there)."""
    left = dbclock.seconds_until_sql(connection, "expire_at")
    sql = (
        f"SELECT owner, fence, acquired_at, expire_at, {left} FROM {TABLE} "
        f"WHERE name = %s AND token <> '' AND expire_at > {dbclock.now_sql(connection)}"
    )
    found = execute(connection, sql, [key.name])[0]
    if found is None:
        return None
    owner, fence, since, expires, seconds = found
    return LiveRow(str(owner), int(fence), since, expires, float(seconds))


def release_after_on(connection: BaseDatabaseWrapper, req: Request, min_hold: float) -> bool:
    """TaskLock's release on one database: keep the lease until ``acquired_at + min_hold``.

    Runs on ``connection``, the worker's private connection with its connect
    and statement timeouts, like every other statement of a quorum.
    """
    return lease.release_after_on(connection, req, min_hold)
