"""The lease strategy's SQL: its statements per database, and how it reads a row.

Acquire is one statement on PostgreSQL and SQLite (an upsert that takes the
row only when its lease has ended and no live ticket is ahead, or when it is
already the caller's; on PostgreSQL the queue is read only when the key's
row says somebody may wait) and a short transaction of several on MySQL/MariaDB.
Every acquire is a new grant: a new fencing number and a new
``acquired_at``, also over the caller's own live lease (left behind by a
release that could not reach the database, or written by a try whose answer
was lost with its connection).
On PostgreSQL the acquire and release statements come in two durabilities
(``DLOCK_LEASE_SYNCHRONOUS_COMMIT``): the fast one commits its own
transaction with ``synchronous_commit = off`` and takes fencing numbers that
also follow the database clock.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock
from django_dlock.strategies import queue
from django_dlock.strategies.connection import fetch_one, with_reconnect
from django_dlock.strategies.fence import NEXT_FENCE
from django_dlock.tables import FENCE_FLOOR_TABLE, LOCK_TABLE, WAITER_TABLE

TABLE = LOCK_TABLE
WAITERS = WAITER_TABLE
NOTIFY_CHANNEL = "django_dlock"

# PostgreSQL acquire, with {new_fence} and {returning} filled per durability.
# Parameters: name, token, owner, ttl, the caller's ticket (NEWCOMER without),
# and that ticket again. The queue is read only when the key's row says that
# somebody may wait (``queued``, set by every ticket on the key's row, which
# it creates if missing): a key without a row has no ticket. It is read by
# ``django_dlock_ahead``, a function, so that PostgreSQL does not set the
# queue's query up at every execution of this statement, as it would a
# subquery's (with the fencing number's function, 9 % fewer server
# instructions per uncontended pair than the two subqueries). The flag is
# cleared once no ticket is left, judged by ``django_dlock_queued`` after
# the row is locked (a snapshot of its own: it sees a ticket committed
# while this statement waited for the row).
_PG_ACQUIRE = f"""
INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at)
VALUES (%s, %s, %s, {{new_fence}}, statement_timestamp(),
        statement_timestamp() + %s * interval '1 second')
ON CONFLICT (name) DO UPDATE SET
    token = EXCLUDED.token,
    owner = EXCLUDED.owner,
    fence = GREATEST(EXCLUDED.fence, l.fence + 1),
    acquired_at = EXCLUDED.acquired_at,
    expire_at = EXCLUDED.expire_at,
    queued = CASE WHEN l.queued THEN {queue.PG_QUEUED.format(name="l.name", besides="%s")} END
WHERE (l.token = EXCLUDED.token AND l.expire_at > statement_timestamp())
   OR (l.expire_at <= statement_timestamp() AND (l.queued IS NOT TRUE
        OR NOT {queue.PG_AHEAD.format(name="l.name", ticket="%s")}))
RETURNING fence{{returning}}
"""
# Fast durability (DLOCK_LEASE_SYNCHRONOUS_COMMIT = False): the statement's
# own transaction commits without waiting for the WAL flush, and fencing
# numbers also follow the database clock, which a crash cannot roll back.
FAST_COMMIT = ", set_config('synchronous_commit', 'off', true)"
_FENCE = {
    True: NEXT_FENCE,
    False: f"GREATEST({NEXT_FENCE}, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)",
}
PG_ACQUIRE_SQL = {
    durable: _PG_ACQUIRE.format(new_fence=_FENCE[durable], returning="" if durable else FAST_COMMIT)
    for durable in (True, False)
}
# A waiter's acquire: its ticket goes in the same statement as it is granted.
PG_ACQUIRE_TICKET_SQL = {
    durable: f"WITH taken AS ({sql}), "
    f"gone AS (DELETE FROM {WAITERS} WHERE id = %s AND EXISTS (SELECT 1 FROM taken)) "
    "SELECT fence FROM taken"
    for durable, sql in PG_ACQUIRE_SQL.items()
}

SQLITE_ACQUIRE = f"""
INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at)
SELECT %s, %s, %s,
       COALESCE((SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1), 0) + 1,
       {{now}}, {{now_plus}}
WHERE NOT EXISTS (
        SELECT 1 FROM {WAITERS} w WHERE w.name = %s AND w.expire_at > {{now}} AND w.id < %s)
   OR EXISTS (
        SELECT 1 FROM {TABLE} o WHERE o.name = %s AND o.token = %s AND o.expire_at > {{now}})
ON CONFLICT (name) DO UPDATE SET
    token = excluded.token,
    owner = excluded.owner,
    fence = {TABLE}.fence + 1,
    acquired_at = excluded.acquired_at,
    expire_at = excluded.expire_at
WHERE ({TABLE}.token = excluded.token AND {TABLE}.expire_at > {{now}})
   OR ({TABLE}.expire_at <= {{now}} AND NOT EXISTS (
        SELECT 1 FROM {WAITERS} w WHERE w.name = {TABLE}.name
        AND w.expire_at > {{now}} AND w.id < %s))
RETURNING fence
""".format(now=dbclock._NOW["sqlite"], now_plus=dbclock._NOW_PLUS["sqlite"])

MYSQL_SELECT = (
    f"SELECT token, expire_at <= UTC_TIMESTAMP(6), fence, EXISTS ("
    f"SELECT 1 FROM {WAITERS} w WHERE w.name = %s AND w.expire_at > UTC_TIMESTAMP(6) "
    f"AND w.id < %s) FROM {TABLE} WHERE name = %s FOR UPDATE"
)
MYSQL_TAKE = (
    f"UPDATE {TABLE} SET acquired_at = UTC_TIMESTAMP(6), "
    "token = %s, owner = %s, fence = %s, "
    "expire_at = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND "
    "WHERE name = %s"
)
MYSQL_AHEAD = (
    f"SELECT EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %s "
    "AND w.expire_at > UTC_TIMESTAMP(6) AND w.id < %s)"
)
MYSQL_FLOOR = f"SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1 LOCK IN SHARE MODE"
# A missing row created free (a reader's key row, a semaphore's permit
# row), above the fence floor: its first grant is above it. The floor is
# read with a share lock (a cleanup that raises it commits first). An
# INSERT … VALUES: InnoDB takes a table's AUTO-INC lock for the whole of an
# INSERT … SELECT (a bulk insert), also while it waits for a row, and every
# other insert into the table then waits for it; a wait for that lock that
# ends in a deadlock or at its bound is error 1467.
MYSQL_CREATE = (
    f"INSERT IGNORE INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) "
    f"VALUES (%s, '', '', COALESCE((SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1 "
    "LOCK IN SHARE MODE), 0), NULL, UTC_TIMESTAMP(6))"
)
MYSQL_INSERT = (
    f"INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) "
    "VALUES (%s, %s, %s, %s, UTC_TIMESTAMP(6), "
    "UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND)"
)

# The row's end is judged when the row is examined (clock_timestamp), not when
# the statement began: a take-over that waited for a release in flight must
# find the row the release ended (stamped after the take-over began).
PG_TAKE_OVER = f"""
INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at)
VALUES (%s, %s, %s, {NEXT_FENCE}, statement_timestamp(),
        statement_timestamp() + %s * interval '1 second')
ON CONFLICT (name) DO UPDATE SET
    token = EXCLUDED.token,
    owner = EXCLUDED.owner,
    fence = CASE WHEN l.token = EXCLUDED.token THEN l.fence
                 ELSE GREATEST(EXCLUDED.fence, l.fence + 1) END,
    acquired_at = CASE WHEN l.token = EXCLUDED.token THEN l.acquired_at
                       ELSE EXCLUDED.acquired_at END,
    expire_at = EXCLUDED.expire_at
WHERE l.expire_at <= clock_timestamp() OR l.token = EXCLUDED.token OR l.token LIKE %s
RETURNING fence
"""

# Wakes the head of the key's queue when somebody may wait (``queued`` on the
# row as it is once locked: a ticket committed while the release waited for
# the row has set it). Parameters: the row's name, token, and the key of the
# queue (a semaphore's permit rows share their semaphore's queue).
# The wake-up is in the RETURNING list, evaluated once the row is updated
# (a SELECT around the UPDATE cost the server about 5 % of an uncontended
# pair).
_PG_RELEASE = f"""
UPDATE {TABLE} SET token = '', expire_at = statement_timestamp()
WHERE name = %s AND token = %s AND expire_at > statement_timestamp()
RETURNING CASE WHEN queued THEN {queue.PG_WAKE_HEAD.format(name="%s")} END{{returning}}
"""
PG_RELEASE_SQL = {
    durable: _PG_RELEASE.format(returning="" if durable else FAST_COMMIT)
    for durable in (True, False)
}


def read(alias: str, sql: str, params: list[Any]) -> Any:
    """One row of a read-only query with ``{now}`` / ``{left}`` filled per database."""

    def run(connection: BaseDatabaseWrapper) -> Any:
        query = sql.format(
            now=dbclock.now_sql(connection),
            left=dbclock.seconds_until_sql(connection, "expire_at"),
        )
        return fetch_one(connection, query, params)

    found, _ = with_reconnect(alias, run)
    return found
