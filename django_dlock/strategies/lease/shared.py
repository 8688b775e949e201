"""Shared (read) leases: many readers or one writer of a key, on the lease table.

``lock(key, shared=True)`` on the ``lease`` strategy. Each reader holds a
lease row of its own, named after the key and its holder
(``lock:report#reader:<16 hex digits>``), with its own ``expire_at``,
fencing number and owner, so a reader extends, renews, releases and loses
its lease alone. The key's own row, the one a writer (an ordinary
``lock(key)``) takes, says that readers hold the key: its token is
:data:`READERS`, and its ``expire_at`` is never earlier than any live
reader's. A writer therefore needs nothing new: it takes the key's row
when that row's lease has ended, as for any lock, and that happens only
when every reader has released (the last one frees the row) or every
reader's lease has run out on the database clock.

A reader's release (and extend, and an upgrade) is one short transaction
that first locks the key's row, then reads and writes with statements that
see everything committed before that lock was granted (PostgreSQL runs it
at READ COMMITTED, so each statement takes a fresh snapshot; MySQL/MariaDB
reads the readers' rows with locking reads; SQLite has one writer at a
time). A reader's acquire writes the key's row before its own (on
PostgreSQL in one statement, whose upsert rechecks the key's row at its
newest version; elsewhere in such a transaction). Writers, readers and the
queue all meet on that row, so a release that shortens the key's lease to
the last remaining reader's never misses a reader that was being granted
at the same moment: that reader's row is committed before the release can
lock the key's row, or its acquire waits for the release and then extends
the key's lease itself.

Waiting is the key's queue, first come, first served, writers and readers
alike: a reader is granted when no writer holds the key and no live ticket
is ahead of it, so a queued writer is never starved by a stream of
readers (readers arriving after it wait behind it). A waiting reader that
is granted wakes the next ticket, so the readers queued behind a writer
all go in when it leaves; the last reader to leave wakes the head.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

from django.db import DatabaseError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_dlock import dbclock
from django_dlock.conf import RetryInterval, conf
from django_dlock.exceptions import StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline, interval
from django_dlock.strategies import queue
from django_dlock.strategies.base import Request, Upgrades
from django_dlock.strategies.connection import (
    DEADLOCK_RETRIES,
    LockWaitEnded,
    cursor,
    deadlocked,
    fetch_one,
    in_savepoint,
    lock_connection,
    with_reconnect,
)
from django_dlock.strategies.lease.pins import CallerGone, in_caller_transaction
from django_dlock.strategies.lease.sql import (
    _FENCE,
    FAST_COMMIT,
    MYSQL_CREATE,
    TABLE,
    WAITERS,
    read,
)
from django_dlock.strategies.lease.strategy import (
    LeaseStrategy,
    _release_after_transaction,
    caller_pin,
)
from django_dlock.strategies.lease.waiting import Look
from django_dlock.tables import FENCE_FLOOR_TABLE

T = TypeVar("T")

__all__ = [
    "READERS",
    "READER_INFIX",
    "UPGRADEABLE",
    "SharedLeaseStrategy",
    "reader_row",
    "shared_lease",
]

#: the token of a key's row while readers hold the key (no holder's token
#: looks like it: theirs are hex digits)
READERS = "(readers)"
#: what a reader's row name adds to its key's name, before its holder's digest
READER_INFIX = "#reader:"


#: the last part of the row of a key's upgradeable reader (one at a time)
UPGRADEABLE = "upgradeable"


def reader_row(key: Key, token: str, upgradeable: bool = False) -> str:
    """The name of the lease row of ``token``'s read lease of ``key`` (its
    upgradeable read lease: the key's one upgradeable row)."""
    if upgradeable:
        return f"{key.name}{READER_INFIX}{UPGRADEABLE}"
    digest = hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]
    return f"{key.name}{READER_INFIX}{digest}"


_BEGIN = {
    # READ COMMITTED whatever the site's default: each statement sees what was
    # committed before it started, so after the key's row is locked
    "postgresql": "BEGIN ISOLATION LEVEL READ COMMITTED",
    "sqlite": "BEGIN IMMEDIATE",  # the one write lock, at once
    "mysql": "START TRANSACTION",
}
_LOCK_KEY_ROW = {
    # an upsert that changes nothing: it locks the row, creating it free if missing
    "postgresql": (
        f"INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at) "
        "VALUES (%s, '', '', 0, NULL, statement_timestamp()) "
        "ON CONFLICT (name) DO UPDATE SET name = l.name "
        "RETURNING l.token, l.expire_at > statement_timestamp(), l.fence"
    ),
    "sqlite": (
        f"SELECT token, expire_at > {dbclock._NOW['sqlite']}, fence FROM {TABLE} WHERE name = %s"
    ),
    "mysql": (
        f"SELECT token, expire_at > UTC_TIMESTAMP(6), fence FROM {TABLE} WHERE name = %s FOR UPDATE"
    ),
}
# A missing key row is created free, above the fence floor (SQLite in the
# transaction; MySQL/MariaDB before it, so the lock never falls on a gap).
_CREATE_KEY_ROW = {
    "sqlite": (
        f"INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) "
        f"SELECT %s, '', '', COALESCE((SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1), 0), "
        f"NULL, {dbclock._NOW['sqlite']} ON CONFLICT (name) DO NOTHING"
    ),
    "mysql": MYSQL_CREATE,
}
_GREATEST = {"postgresql": "GREATEST", "sqlite": "MAX", "mysql": "GREATEST"}


@functools.cache
def _write_reader(vendor: str) -> str:
    now, now_plus = dbclock._NOW[vendor], dbclock._NOW_PLUS[vendor]
    values = f"VALUES (%s, %s, %s, %s, {now}, {now_plus})"
    insert = f"INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) {values}"
    if vendor == "mysql":
        return (
            f"{insert} ON DUPLICATE KEY UPDATE token = VALUES(token), owner = VALUES(owner), "
            "fence = VALUES(fence), acquired_at = VALUES(acquired_at), "
            "expire_at = VALUES(expire_at)"
        )
    excluded = "EXCLUDED" if vendor == "postgresql" else "excluded"
    return (
        f"{insert} ON CONFLICT (name) DO UPDATE SET token = {excluded}.token, "
        f"owner = {excluded}.owner, fence = {excluded}.fence, "
        f"acquired_at = {excluded}.acquired_at, expire_at = {excluded}.expire_at"
    )


def _next_fence(vendor: str, durable: bool) -> str:
    """SQL for the key's row's next fencing number (a new grant of the key)."""
    return f"GREATEST({_FENCE[durable]}, fence + 1)" if vendor == "postgresql" else "fence + 1"


@functools.cache
def _mark(vendor: str, live: bool, durable: bool) -> str:
    """The key row's update for a new reader: ``READERS``, a new fencing number,
    a lease at least as long as the reader's."""
    now, now_plus = dbclock._NOW[vendor], dbclock._NOW_PLUS[vendor]
    fence = _next_fence(vendor, durable)
    if live:  # readers hold it already: keep their start, never shorten their lease
        times = f"expire_at = {_GREATEST[vendor]}(expire_at, {now_plus})"
    else:
        times = f"acquired_at = {now}, expire_at = {now_plus}"
    return (
        f"UPDATE {TABLE} SET token = '{READERS}', owner = %s, fence = {fence}, {times} "
        "WHERE name = %s" + ("" if vendor == "mysql" else " RETURNING fence")
    )


@functools.cache
def _shrink(vendor: str) -> str:
    """The key row's lease after a reader left: the latest remaining reader's
    end, or free (empty token, ended now) when none is left. Takes the
    latest end (or NULL) and the key's name."""
    now = dbclock._NOW[vendor]
    return (
        f"UPDATE {TABLE} SET token = CASE WHEN %s THEN '' ELSE token END, "
        f"expire_at = COALESCE(%s, {now}) WHERE name = %s AND token = '{READERS}'"
    )


def _readers_like(key: Key) -> str:
    """A ``LIKE`` pattern (escape character ``!``) of the names of ``key``'s readers' rows."""
    prefix = key.name + READER_INFIX
    return prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


def _readers(vendor: str, key: Key, what: str, but: str | None = None) -> tuple[str, list[str]]:
    """The query for ``what`` (``max(expire_at)``, ``count(*)``) over ``key``'s
    live readers' rows (all but the row ``but``), and its parameters. The rows
    are found by their name's prefix, through the name's index: on SQLite as
    a range of names (its ``LIKE`` ignores case), elsewhere with ``LIKE``;
    MySQL/MariaDB reads them with a locking read (the newest committed rows)."""
    now = dbclock._NOW[vendor]
    if vendor == "sqlite":
        prefix = key.name + READER_INFIX
        where, params = "name >= %s AND name < %s", [prefix, prefix[:-1] + ";"]
    else:
        where, params = "name LIKE %s ESCAPE '!'", [_readers_like(key)]
    if but is not None:
        where, params = f"{where} AND name <> %s", [*params, but]
    share = " LOCK IN SHARE MODE" if vendor == "mysql" else ""
    return f"SELECT {what} FROM {TABLE} WHERE {where} AND expire_at > {now}{share}", params


def _again(op: Callable[[], T]) -> T:
    """``op()``, run again when MySQL/MariaDB made its transaction a deadlock's
    victim (rolled back whole: it did nothing)."""
    for _attempt in range(DEADLOCK_RETRIES - 1):
        try:
            return op()
        except OperationalError as exc:
            if not deadlocked(exc):
                raise
    return op()


@functools.cache
def _pg_take(durable: bool) -> str:
    """PostgreSQL: a reader's acquire in one statement. The key's row is
    upserted as the readers' (taken when its lease has ended, joined when
    readers hold it), only if no live ticket is ahead or the caller's read
    lease is already live; the reader's row is written only if it was; a
    granted ticket is deleted and the ticket after it woken (a reader behind
    goes in too). Its decision rests on the key's row, which the upsert
    locks and rechecks at its newest version, as a lock's acquire does.
    (Each parameter is cast where it is used: a prepared statement deduces
    one type per parameter.)
    (Not for an upgradeable reader: its row is the key's one upgradeable
    row, which another may take at the same moment; it takes the
    transaction of the other databases.)"""
    now = "statement_timestamp()"
    now_plus = f"{now} + %(ttl)s::float8 * interval '1 second'"
    live_readers = f"(l.token = '{READERS}' AND l.expire_at > {now})"
    may = (
        f"(NOT EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %(name)s::text "
        f"AND w.expire_at > {now} AND w.id < %(place)s::bigint) "
        f"OR EXISTS (SELECT 1 FROM {TABLE} o WHERE o.name = %(row)s::text "
        f"AND o.token = %(token)s::text AND o.expire_at > {now}))"
    )
    returning = "" if durable else FAST_COMMIT
    return f"""
WITH k AS (
    INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at)
    SELECT %(name)s::text, '{READERS}', %(marker)s::text, {_FENCE[durable]}, {now}, {now_plus}
    WHERE {may}
    ON CONFLICT (name) DO UPDATE SET
        token = EXCLUDED.token,
        owner = EXCLUDED.owner,
        fence = GREATEST(EXCLUDED.fence, l.fence + 1),
        acquired_at = CASE WHEN {live_readers} THEN l.acquired_at ELSE EXCLUDED.acquired_at END,
        expire_at = CASE WHEN {live_readers} THEN GREATEST(l.expire_at, EXCLUDED.expire_at)
                    ELSE EXCLUDED.expire_at END
    WHERE (l.expire_at <= {now} OR l.token = '{READERS}') AND {may}
    RETURNING l.fence),
r AS (
    INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at)
    SELECT %(row)s::text, %(token)s::text, %(owner)s::text, k.fence, {now}, {now_plus} FROM k
    ON CONFLICT (name) DO UPDATE SET
        token = EXCLUDED.token, owner = EXCLUDED.owner, fence = EXCLUDED.fence,
        acquired_at = EXCLUDED.acquired_at, expire_at = EXCLUDED.expire_at
    RETURNING 1),
gone AS (DELETE FROM {WAITERS} WHERE id = %(ticket)s::bigint AND EXISTS (SELECT 1 FROM k)),
wake AS (
    SELECT pg_notify('{queue.CHANNEL}', '{queue.WAKE_PREFIX}' || w.id) FROM (
        SELECT w.id FROM {WAITERS} w
        WHERE w.name = %(name)s::text AND w.expire_at > {now} AND w.id > %(ticket)s::bigint
        ORDER BY w.id LIMIT 1
    ) w WHERE %(ticket)s::bigint > 0 AND EXISTS (SELECT 1 FROM k))
SELECT k.fence, (SELECT count(*) FROM r), (SELECT count(*) FROM wake){returning} FROM k
"""


# PostgreSQL: a reader's release in two statements of one transaction. The
# first deletes the reader's row and locks the key's row; the second, with a
# snapshot taken after that lock, shortens the key's lease to the latest
# remaining reader's (free when none is left, then waking the queue's head).
_PG_RELEASE_ROW = f"""
WITH d AS (
    DELETE FROM {TABLE} WHERE name = %(row)s::text AND token = %(token)s::text
    AND expire_at > statement_timestamp() RETURNING 1)
SELECT token, expire_at > statement_timestamp(), (SELECT count(*) FROM d){{fast}}
FROM {TABLE} WHERE name = %(name)s::text FOR UPDATE
"""
_PG_RELEASE_KEY = f"""
WITH m AS (
    SELECT max(expire_at) AS latest FROM {TABLE}
    WHERE name LIKE %(prefix)s::text ESCAPE '!' AND expire_at > statement_timestamp()),
u AS (
    UPDATE {TABLE} AS l SET token = CASE WHEN m.latest IS NULL THEN '' ELSE l.token END,
        expire_at = COALESCE(m.latest, statement_timestamp())
    FROM m WHERE l.name = %(name)s::text AND l.token = '{READERS}'
    RETURNING m.latest IS NULL AS freed)
SELECT {queue.PG_WAKE_HEAD.format(name="%(name)s::text")} FROM u WHERE u.freed
"""
# ... and an upgraded holder's: the key's row freed, the queue's head woken
_PG_RELEASE_UPGRADED = f"""
WITH u AS (
    UPDATE {TABLE} SET token = '', expire_at = statement_timestamp()
    WHERE name = %(name)s::text RETURNING 1)
SELECT {queue.PG_WAKE_HEAD.format(name="%(name)s::text")} FROM u
"""


class SharedLeaseStrategy(LeaseStrategy):
    """The lease strategy for ``shared=True`` holdings (see the module)."""

    shares = True

    def __repr__(self) -> str:
        return "<lease strategy, shared>"

    # -- one transaction, the key's row locked first ---------------------------

    @contextlib.contextmanager
    def _transaction(self, connection: BaseDatabaseWrapper) -> Iterator[CursorWrapper]:
        """A transaction of its own on ``connection`` (see :data:`_BEGIN`),
        committed when the block ends, rolled back if it raises; inside the
        caller's transaction (whose guard pinned the key's row), a savepoint
        of it."""
        if connection.in_atomic_block:
            with in_savepoint(connection) as cur:
                yield cur
            return
        with cursor(connection) as cur:
            cur.execute(_BEGIN[connection.vendor])
            try:
                yield cur
            except BaseException:
                if connection.connection is not None:
                    with contextlib.suppress(DatabaseError):
                        cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    @contextlib.contextmanager
    def _locked(self, connection: BaseDatabaseWrapper, key: Key) -> Iterator[tuple[Any, Any]]:
        """A transaction with ``key``'s row locked: the cursor and the row
        (token, live, fence). Commits when the block ends."""
        vendor = connection.vendor
        if connection.in_atomic_block:  # SQLite: inside the caller's writing transaction
            with in_savepoint(connection) as cur:
                yield cur, self._lock_key_row(cur, vendor, key)
            return
        for _attempt in range(DEADLOCK_RETRIES):
            with self._transaction(connection) as cur:
                row = self._lock_key_row(cur, vendor, key)
                if row is not None:
                    yield cur, row
                    return
            # MySQL/MariaDB: the key's row is missing. It is created outside the
            # transaction (a locking read of a gap would lock the gap), then locked.
            with cursor(connection) as cur:
                cur.execute(_CREATE_KEY_ROW["mysql"], [key.name])
        raise OperationalError(f"could not lock the row of {key.name!r}")

    @staticmethod
    def _lock_key_row(cur: CursorWrapper, vendor: str, key: Key) -> Any:
        if vendor == "sqlite":
            cur.execute(_CREATE_KEY_ROW["sqlite"], [key.name])
        elif vendor == "postgresql" and not conf.LEASE_SYNCHRONOUS_COMMIT:
            cur.execute("SET LOCAL synchronous_commit = off")
        cur.execute(_LOCK_KEY_ROW[vendor], [key.name])
        return cur.fetchone()

    # -- taking a read lease ---------------------------------------------------

    def acquire_on(
        self, connection: BaseDatabaseWrapper, req: Request, ticket: int | None
    ) -> int | None:
        try:
            return _again(lambda: self._acquire_on(connection, req, ticket))
        except LockWaitEnded:  # the key's row held elsewhere until the deadline
            return None

    def _acquire_on(
        self, connection: BaseDatabaseWrapper, req: Request, ticket: int | None
    ) -> int | None:
        vendor = connection.vendor
        name = req.key.name
        row = reader_row(req.key, req.token, req.upgradeable)
        place = queue.NEWCOMER if ticket is None else ticket
        owner = f"readers, the last in: {req.owner}"[:255]
        if vendor == "postgresql" and not req.upgradeable:
            params = {
                "name": name,
                "row": row,
                "token": req.token,
                "owner": req.owner,
                "marker": owner,
                "ttl": req.ttl,
                "place": place,
                "ticket": -1 if ticket is None else ticket,
            }
            found = fetch_one(connection, _pg_take(conf.LEASE_SYNCHRONOUS_COMMIT), params, True)
            if found is None:
                return None
            req.row = row
            return int(found[0])
        now = dbclock._NOW[vendor]
        with self._locked(connection, req.key) as (cur, key_row):
            token, live = key_row[0], bool(key_row[1])
            if live and token != READERS:
                return None  # a writer holds the key
            if req.upgradeable:  # one upgradeable reader at a time
                cur.execute(
                    f"SELECT 1 FROM {TABLE} WHERE name = %s AND token <> %s AND expire_at > {now}",
                    [row, req.token],
                )
                if cur.fetchone() is not None:
                    return None
            cur.execute(
                f"SELECT CASE WHEN EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s "
                f"AND token = %s AND expire_at > {now}) THEN 1 ELSE 0 END, "
                f"CASE WHEN EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %s "
                f"AND w.expire_at > {now} AND w.id < %s) THEN 1 ELSE 0 END",
                [row, req.token, name, place],
            )
            own, ahead = (bool(value) for value in cur.fetchone())
            if ahead and not own:
                return None  # tickets ahead go first (a writer's, or readers' behind one)
            durable = conf.LEASE_SYNCHRONOUS_COMMIT
            cur.execute(_mark(vendor, live, durable), [owner, req.ttl, name])
            if vendor == "mysql":
                cur.execute(f"SELECT fence FROM {TABLE} WHERE name = %s", [name])
            fence = int(cur.fetchone()[0])
            cur.execute(_write_reader(vendor), [row, req.token, req.owner, fence, req.ttl])
            if ticket is not None:
                cur.execute(f"DELETE FROM {WAITERS} WHERE id = %s", [ticket])
                if vendor == "postgresql":  # the next ticket: a reader goes in too
                    cur.execute(f"SELECT {queue.PG_WAKE_HEAD.format(name='%s')}", [name])
        req.row = row
        return fence

    def enqueue(self, req: Request) -> int:
        return queue.enqueue(req)

    def look(self, req: Request, ticket: int) -> Look:
        """A waiting reader's look: how long a writer holds the key (readers
        don't keep it), and whether a live ticket is ahead."""
        found = read(
            req.alias,
            f"SELECT (SELECT CASE WHEN token = '{READERS}' THEN -1 ELSE {{left}} END "
            f"FROM {TABLE} WHERE name = %s), "
            f"CASE WHEN EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %s "
            "AND w.expire_at > {now} AND w.id < %s) THEN 1 ELSE 0 END",
            [req.key.name, req.key.name, ticket],
        )
        left = -1.0 if found is None or found[0] is None else float(found[0])
        ahead = bool(found[1]) if found is not None else False
        if req.upgradeable and left <= 0:  # another upgradeable reader keeps it
            upgrader = read(
                req.alias,
                f"SELECT {{left}} FROM {TABLE} WHERE name = %s AND token <> %s",
                [reader_row(req.key, req.token, True), req.token],
            )
            if upgrader is not None and upgrader[0] is not None:
                left = float(upgrader[0])
        return Look(left, ahead)

    # -- upgrading ---------------------------------------------------------------

    def upgrade(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> int | Literal[False] | None:
        """Wait until the caller's upgradeable read lease is the key's only
        reader, then take the key's row for it (see :class:`Upgrades`).

        While it waits, a ticket in the key's queue keeps newcomers (readers
        too) out; the wait polls at the lock's retry interval (a reader's
        release wakes only the queue's head).
        """
        ticket: int | None = None
        attempt = 0
        renewed = time.monotonic()
        try:
            while True:
                fence, _ = with_reconnect(
                    req.alias,
                    lambda connection: _again(lambda: self._upgrade_on(connection, req)),
                )
                if fence is not None or deadline.expired():
                    return fence
                if ticket is None:
                    ticket = queue.enqueue(req)
                elif time.monotonic() - renewed >= queue.renew_every():
                    queue.beat(req, ticket)
                    renewed = time.monotonic()
                pause = min(interval(policy, attempt), queue.renew_every())
                time.sleep(max(0.0, min(pause, deadline.remaining())))
                attempt += 1
        finally:
            if ticket is not None:
                queue.leave(req.alias, ticket)

    def _upgrade_on(
        self, connection: BaseDatabaseWrapper, req: Request
    ) -> int | Literal[False] | None:
        vendor = connection.vendor
        now = dbclock._NOW[vendor]
        with self._locked(connection, req.key) as (cur, key_row):
            if key_row[0] == req.token and key_row[1]:
                return int(key_row[2])  # upgraded already (an answer lost with its connection)
            if key_row[0] != READERS or not key_row[1]:
                return False
            row = reader_row(req.key, req.token, True)
            cur.execute(
                f"SELECT 1 FROM {TABLE} WHERE name = %s AND token = %s AND expire_at > {now}",
                [row, req.token],
            )
            if cur.fetchone() is None:
                return False
            cur.execute(*_readers(vendor, req.key, "count(*)", but=row))
            if cur.fetchone()[0]:
                return None
            fence = _next_fence(vendor, conf.LEASE_SYNCHRONOUS_COMMIT)
            cur.execute(
                f"UPDATE {TABLE} SET token = %s, owner = %s, fence = {fence}, "
                f"acquired_at = {now}, expire_at = {dbclock._NOW_PLUS[vendor]} WHERE name = %s",
                [req.token, req.owner, req.ttl, req.key.name],
            )
            cur.execute(f"SELECT fence FROM {TABLE} WHERE name = %s", [req.key.name])
            taken = int(cur.fetchone()[0])
            cur.execute(f"DELETE FROM {TABLE} WHERE name = %s", [row])
        return taken

    # -- release, extend, inspect ----------------------------------------------

    def release(self, req: Request) -> bool:
        caller = caller_pin(req)
        if caller is not None:
            # The caller's open transaction share-locks the key's row (a guard
            # inside it): the release is part of that transaction, and a
            # rollback undoes it (the read lease then runs out on its own: a
            # second release could not tell this reader's lease from the same
            # holder's next one on PostgreSQL, which matches no fence).
            with contextlib.suppress(CallerGone), in_caller_transaction(caller):
                return self.release_on(caller, req)
        connection = lock_connection(req.alias)
        if connection.in_atomic_block:  # SQLite: the caller's transaction has written
            return _release_after_transaction(
                connection, req, self.release_on, self._release_fenced
            )
        released, retried = with_reconnect(
            req.alias, lambda connection: self.release_on(connection, req), connection
        )
        if not released and retried:
            # The first try may have released before its connection dropped.
            found = read(req.alias, f"SELECT token FROM {TABLE} WHERE name = %s", [req.row])
            return found is None
        return released

    def release_on(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        """Delete the reader's row, and shorten the key's lease to the latest
        remaining reader's (free when none is left, waking the queue's head)."""
        return _again(lambda: self._release_on(connection, req))

    def _release_fenced(self, connection: BaseDatabaseWrapper, req: Request, fence: int) -> None:
        """:meth:`release_on`, of the read lease with fencing number ``fence`` only
        (once the caller's SQLite transaction has ended)."""
        _again(lambda: self._release_on(connection, req, fence))

    def _pg_release(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        # (inside the caller's transaction: as durable as its commit)
        durable = conf.LEASE_SYNCHRONOUS_COMMIT or connection.in_atomic_block
        fast = "" if durable else FAST_COMMIT
        params = {
            "row": req.row,
            "token": req.token,
            "name": req.key.name,
            "prefix": _readers_like(req.key),
        }
        with self._transaction(connection):
            key_row = fetch_one(connection, _PG_RELEASE_ROW.format(fast=fast), params)
            if key_row is None:  # the key's row is gone (force-released, cleaned up)
                return False
            if key_row[0] == req.token:  # upgraded: the write lease
                if key_row[1]:
                    fetch_one(connection, _PG_RELEASE_UPGRADED, params)
                return bool(key_row[1])
            # (a reader whose key was force-released deletes its row, and has lost)
            released = bool(key_row[2]) and key_row[0] == READERS and bool(key_row[1])
            if released:
                fetch_one(connection, _PG_RELEASE_KEY, params)
        return released

    def _release_on(
        self, connection: BaseDatabaseWrapper, req: Request, fence: int | None = None
    ) -> bool:
        vendor = connection.vendor
        if vendor == "postgresql":
            return self._pg_release(connection, req)
        # SQLite and MySQL/MariaDB (waiters poll: nobody to wake)
        with self._locked(connection, req.key) as (cur, key_row):
            if key_row[0] == req.token and fence is None:  # upgraded: the write lease
                if not key_row[1]:
                    return False
                cur.execute(
                    f"UPDATE {TABLE} SET token = '', expire_at = {dbclock._NOW[vendor]} "
                    "WHERE name = %s",
                    [req.key.name],
                )
                return True
            only = "" if fence is None else " AND fence = %s"
            cur.execute(
                f"DELETE FROM {TABLE} WHERE name = %s AND token = %s "
                f"AND {dbclock.live_row_sql(connection)}{only}",
                [req.row, req.token] + ([] if fence is None else [fence]),
            )
            # (a reader whose key was force-released deletes its row, and has lost)
            released = bool(cur.rowcount) and key_row[0] == READERS and bool(key_row[1])
            if released:
                cur.execute(*_readers(vendor, req.key, "max(expire_at)"))
                latest = cur.fetchone()[0]
                cur.execute(_shrink(vendor), [latest is None, latest, req.key.name])
        return released

    def extend_on(self, connection: BaseDatabaseWrapper, req: Request, ttl: float) -> bool:
        """Renew the reader's lease, and the key's at least as far; ``False`` if
        the read lease is no longer the caller's."""
        return _again(lambda: self._extend_on(connection, req, ttl))

    def _extend_on(self, connection: BaseDatabaseWrapper, req: Request, ttl: float) -> bool:
        vendor = connection.vendor
        with self._locked(connection, req.key) as (cur, key_row):
            now_plus = dbclock._NOW_PLUS[vendor]
            if key_row[0] == req.token and key_row[1]:  # upgraded: the write lease
                cur.execute(
                    f"UPDATE {TABLE} SET expire_at = {now_plus} WHERE name = %s",
                    [ttl, req.key.name],
                )
                return True
            if key_row[0] != READERS or not key_row[1]:
                return False  # force-released, or run out (a writer may have it)
            cur.execute(
                f"UPDATE {TABLE} SET expire_at = {now_plus} WHERE name = %s AND token = %s "
                f"AND {dbclock.live_row_sql(connection)}",
                [ttl, req.row, req.token],
            )
            if not cur.rowcount:
                return False
            cur.execute(
                f"UPDATE {TABLE} SET expire_at = {_GREATEST[vendor]}(expire_at, {now_plus}) "
                "WHERE name = %s",
                [ttl, req.key.name],
            )
        return True

    def release_after(self, req: Request, min_hold: float) -> bool:
        raise StrategyNotSupported("a shared lease has no minimum hold")

    def take_over(self, req: Request, over: str) -> int | None:
        raise StrategyNotSupported("a shared lease cannot be taken over")

    def _mine(self, now: str) -> str:
        """``FROM … WHERE``: the key's row while the caller holds it, as a
        reader (its row live, the key's marked as read) or upgraded (the
        key's row its own). Takes the key, the reader's row, the token twice."""
        return (
            f"FROM {TABLE} k LEFT JOIN {TABLE} r ON r.name = %s AND r.token = %s "
            f"AND r.expire_at > {now} WHERE k.name = %s AND k.expire_at > {now} "
            f"AND (k.token = %s OR (k.token = '{READERS}' AND r.name IS NOT NULL))"
        )

    def _mine_params(self, req: Request) -> list[str]:
        return [req.row, req.token, req.key.name, req.token]

    def owned(self, req: Request) -> bool:
        sql = f"SELECT 1 {self._mine('{now}')}"
        return read(req.alias, sql, self._mine_params(req)) is not None

    def pin(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        if connection.vendor == "sqlite":
            # one writer at a time: this write keeps every writer out
            now = dbclock.now_sql(connection)
            with connection.cursor() as cur:
                cur.execute(
                    f"UPDATE {TABLE} SET expire_at = expire_at WHERE name = %s "
                    f"AND EXISTS (SELECT 1 {self._mine(now)})",
                    [req.key.name, *self._mine_params(req)],
                )
                return bool(cur.rowcount)
        return super().pin(connection, req)

    def pin_query(self, connection: BaseDatabaseWrapper, req: Request) -> tuple[str, list[str]]:
        """One row while the read lease is the caller's; the key's row is
        share-locked, so no writer takes it until the transaction ends."""
        now = dbclock.now_sql(connection)
        # (PostgreSQL locks the key's row only: the reader's is outer-joined)
        share = "FOR SHARE OF k" if connection.vendor == "postgresql" else "LOCK IN SHARE MODE"
        return f"SELECT 1 {self._mine(now)} {share}", self._mine_params(req)

    def loss_reason(self, req: Request) -> str:
        found = read(
            req.alias,
            f"SELECT r.token, CASE WHEN r.expire_at > {{now}} THEN 1 ELSE 0 END, k.token, "
            f"CASE WHEN k.expire_at > {{now}} THEN 1 ELSE 0 END "
            f"FROM {TABLE} k LEFT JOIN {TABLE} r ON r.name = %s WHERE k.name = %s",
            [req.row, req.key.name],
        )
        if found is None or found[0] is None:
            return "its reader's row was deleted (force-released, or cleaned up after it ran out)"
        token, live, key_token, key_live = found[0], bool(found[1]), found[2], bool(found[3])
        if token == req.token and not live:
            return "its lease expired on the database clock"
        if key_token != READERS or not key_live:
            return (
                "the key was force-released (in the admin or with dlock_release), "
                "or all its readers' leases ran out and a writer may hold it"
            )
        return "its reader's row belongs to another holder"


shared_lease = SharedLeaseStrategy()
_upgrades: Upgrades = shared_lease  # (checked by mypy)
