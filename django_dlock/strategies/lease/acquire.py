"""Taking a lease: one try, for a newcomer or for a waiter with a ticket.

On PostgreSQL and SQLite a try is one statement; on MySQL/MariaDB it is one
short transaction that locks the row, decides and writes. A try succeeds
when the lease has ended and no live ticket is ahead of the caller's place,
or when the lease is already the caller's (a release that could not reach
the database left it, or a try whose answer was lost wrote it). Either way
it is a new grant, with a new fencing number: a holder that knows an older
number of the key can never be told the same one again. A granted ticket is
deleted with the grant.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.conf import conf
from django_dlock.strategies import queue
from django_dlock.strategies.base import Request
from django_dlock.strategies.connection import (
    DEADLOCK_RETRIES,
    cursor,
    deadlocked,
    execute,
    fetch_one,
    lock_wait_ended,
)
from django_dlock.strategies.lease.sql import (
    MYSQL_AHEAD,
    MYSQL_FLOOR,
    MYSQL_INSERT,
    MYSQL_SELECT,
    MYSQL_TAKE,
    PG_ACQUIRE_SQL,
    PG_ACQUIRE_TICKET_SQL,
    SQLITE_ACQUIRE,
    WAITERS,
)


def acquire_on(connection: BaseDatabaseWrapper, req: Request, ticket: int | None) -> int | None:
    """One try on ``connection``: the fencing number, or ``None`` if not granted."""
    vendor = connection.vendor  # one of the three: checked with the strategy
    if vendor == "mysql":
        return _mysql_acquire(connection, req, ticket)
    name, token = req.key.name, req.token
    place = queue.NEWCOMER if ticket is None else ticket
    if vendor == "postgresql":
        params = [name, token, req.owner, req.ttl, place, place]
        if ticket is not None:
            sql = PG_ACQUIRE_TICKET_SQL[conf.LEASE_SYNCHRONOUS_COMMIT]
            row = fetch_one(connection, sql, [*params, ticket], True)
            return None if row is None else int(row[0])
        row = execute(connection, PG_ACQUIRE_SQL[conf.LEASE_SYNCHRONOUS_COMMIT], params, True)[0]
        return None if row is None else int(row[0])
    params = [name, token, req.owner, req.ttl, name, place, name, token, place]
    row = fetch_one(connection, SQLITE_ACQUIRE, params, True)
    if row is None:
        return None
    if ticket is not None:
        queue.forget(connection, ticket)
    return int(row[0])


def _mysql_acquire(connection: BaseDatabaseWrapper, req: Request, ticket: int | None) -> int | None:
    # One short transaction: lock the row, decide, write. A missing row
    # is inserted above the fence floor; two racing inserters are told
    # apart by the unique index (the loser looks again), and a deadlock's
    # victim (a cleanup locks rows in another order) runs again. A row
    # that another session keeps locked until the acquire's deadline (a
    # stalled transaction, a guard's) is not taken this round.
    for _attempt in range(DEADLOCK_RETRIES):
        with cursor(connection) as cur:
            cur.execute("START TRANSACTION")
            try:
                fence = _mysql_take(cur, req, ticket)
            except IntegrityError:
                cur.execute("ROLLBACK")
                continue
            except OperationalError as exc:
                cur.execute("ROLLBACK")
                if lock_wait_ended(exc):  # a row held elsewhere until the deadline
                    return None
                if deadlocked(exc):  # rolled back whole: nothing was taken
                    continue
                raise
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT" if fence is not None else "ROLLBACK")
            return fence
    return None


def _mysql_take(cur: Any, req: Request, ticket: int | None) -> int | None:
    place = queue.NEWCOMER if ticket is None else ticket
    cur.execute(MYSQL_SELECT, [req.key.name, place, req.key.name])
    row = cur.fetchone()
    if row is None:
        # No row (never used, or deleted by cleanup): live tickets still go first.
        cur.execute(MYSQL_AHEAD, [req.key.name, place])
        if cur.fetchone()[0]:
            return None
        cur.execute(MYSQL_FLOOR)
        floor = cur.fetchone()
        fence = (int(floor[0]) if floor else 0) + 1
        cur.execute(MYSQL_INSERT, [req.key.name, req.token, req.owner, fence, req.ttl])
    else:
        token, free, fence, ahead = row[0], bool(row[1]), int(row[2]), bool(row[3])
        if not (token == req.token and not free) and not (free and not ahead):
            return None
        fence += 1  # a new grant, also over the caller's own live lease
        cur.execute(MYSQL_TAKE, [req.token, req.owner, fence, req.ttl, req.key.name])
    if ticket is not None:
        cur.execute(f"DELETE FROM {WAITERS} WHERE id = %s", [ticket])
    return fence
