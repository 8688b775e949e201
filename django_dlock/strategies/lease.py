"""The ``lease`` strategy: a row in the ``Lock`` table with an expiry.

Works on PostgreSQL, SQLite and MySQL/MariaDB. Every operation is one atomic
statement (or, on MySQL/MariaDB, one short transaction) that checks the
holder's token and judges the lease on the database clock:

* **acquire** inserts the row, or takes it over when its lease has ended
  (``expire_at <= now``) and no live waiter's ticket is ahead of the caller
  (see :mod:`django_dlock.strategies.queue`: waiters are served first come,
  first served), or when it is already the caller's, and returns the
  fencing number;
* **release** ends the lease (``expire_at = now``, empty token) only if the
  token matches, and on PostgreSQL, only if the key has waiters, sends
  ``NOTIFY django_dlock`` addressed to the next one;
* **extend** moves ``expire_at`` only if the token matches.

Fencing numbers: on PostgreSQL every acquisition by a new holder takes
``nextval('django_dlock_fence')`` (and at least the row's number + 1):
strictly greater than every number issued before for that key.
``dlock_cleanup`` raises the sequence above every number it deletes. After
a fail-over (a promoted standby: a new timeline) the sequence first jumps to
``(timeline - 1) * 2**44``, so numbers a standby never received are not
issued again (see :mod:`django_dlock.strategies.fence`).

Durability (PostgreSQL): by default each lease write waits for its WAL
flush, like any commit. With ``DLOCK_LEASE_SYNCHRONOUS_COMMIT = False`` lease
writes commit with ``synchronous_commit = off`` (set for the statement's own
transaction, in the same statement): about twice as fast, but a crash of the
*database server* can lose the last fraction of a second of lease writes, so
a lock acquired just before the crash can be free again after it (its holder
learns it on its next renew, extend or release: ``LockLost``). Fencing
numbers then also follow the database clock (microseconds since the epoch),
so they keep increasing across such a crash, as long as the database
server's clock is not set back. On SQLite and MySQL/MariaDB a key's number is its row's
number + 1, and a new row starts above ``FenceFloor.value``, which
``dlock_cleanup`` raises to the highest number it deletes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.db import IntegrityError, InterfaceError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock, notify
from django_dlock._threads import start_db_thread
from django_dlock.conf import RetryInterval, conf
from django_dlock.exceptions import StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline, interval
from django_dlock.strategies import queue
from django_dlock.strategies.base import Grant, Request
from django_dlock.strategies.connection import (
    close_private_connections,
    cursor,
    execute,
    fetch_one,
    lock_connection,
    with_reconnect,
)
from django_dlock.strategies.fence import NEXT_FENCE
from django_dlock.tables import FENCE_FLOOR_TABLE, LOCK_TABLE, WAITER_TABLE

#: longest a PostgreSQL waiter parks between checks when it relies on NOTIFY
MAX_PARK = 2.0
#: margin after a lease's end before a waiter looks again
EXPIRY_MARGIN = 0.005

#: longest pause between looks while the database is unreachable
MAX_OUTAGE_PAUSE = 1.0

# One step of the waiting plan: ("left" | "try" | "sleep", seconds to sleep)
Step = tuple[str, float]

logger = logging.getLogger("django_dlock")


@dataclass
class Look:
    """What a waiter saw: seconds until the lease ends (<= 0: free), and
    whether a live ticket is ahead of its own."""

    left: float
    ahead: bool


@dataclass
class _Place:
    """A waiter's ticket, and when (monotonic) it last renewed it."""

    ticket: int
    renewed: float = field(default_factory=time.monotonic)


class Outage:
    """A waiter's step failed because the database was unreachable."""

    def __init__(self, error: Exception) -> None:
        self.error = error


TABLE = LOCK_TABLE
WAITERS = WAITER_TABLE
NOTIFY_CHANNEL = "django_dlock"

# PostgreSQL acquire, with {new_fence} and {returning} filled per durability.
_PG_ACQUIRE = f"""
INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at)
SELECT %s, %s, %s, {{new_fence}}, statement_timestamp(),
       statement_timestamp() + %s * interval '1 second'
WHERE NOT EXISTS (
        SELECT 1 FROM {WAITERS} w WHERE w.name = %s
        AND w.expire_at > statement_timestamp() AND w.id < %s)
   OR EXISTS (
        SELECT 1 FROM {TABLE} o WHERE o.name = %s AND o.token = %s
        AND o.expire_at > statement_timestamp())
ON CONFLICT (name) DO UPDATE SET
    token = EXCLUDED.token,
    owner = EXCLUDED.owner,
    fence = CASE WHEN l.token = EXCLUDED.token AND l.expire_at > statement_timestamp()
                 THEN l.fence ELSE GREATEST(EXCLUDED.fence, l.fence + 1) END,
    acquired_at = CASE WHEN l.token = EXCLUDED.token AND l.expire_at > statement_timestamp()
                       THEN l.acquired_at ELSE EXCLUDED.acquired_at END,
    expire_at = EXCLUDED.expire_at
WHERE (l.token = EXCLUDED.token AND l.expire_at > statement_timestamp())
   OR (l.expire_at <= statement_timestamp() AND NOT EXISTS (
        SELECT 1 FROM {WAITERS} w WHERE w.name = l.name
        AND w.expire_at > statement_timestamp() AND w.id < %s))
RETURNING fence{{returning}}
"""
# Fast durability (DLOCK_LEASE_SYNCHRONOUS_COMMIT = False): the statement's
# own transaction commits without waiting for the WAL flush, and fencing
# numbers also follow the database clock, which a crash cannot roll back.
_FAST_COMMIT = ", set_config('synchronous_commit', 'off', true)"
_FENCE = {
    True: NEXT_FENCE,
    False: f"GREATEST({NEXT_FENCE}, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)",
}
_PG_ACQUIRE_SQL = {
    durable: _PG_ACQUIRE.format(
        new_fence=_FENCE[durable], returning="" if durable else _FAST_COMMIT
    )
    for durable in (True, False)
}
# A waiter's acquire: its ticket goes in the same statement as it is granted.
_PG_ACQUIRE_TICKET_SQL = {
    durable: f"WITH taken AS ({sql}), "
    f"gone AS (DELETE FROM {WAITERS} WHERE id = %s AND EXISTS (SELECT 1 FROM taken)) "
    "SELECT fence FROM taken"
    for durable, sql in _PG_ACQUIRE_SQL.items()
}

_SQLITE_ACQUIRE = f"""
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
    fence = CASE WHEN {TABLE}.token = excluded.token AND {TABLE}.expire_at > {{now}}
                 THEN {TABLE}.fence ELSE {TABLE}.fence + 1 END,
    acquired_at = CASE WHEN {TABLE}.token = excluded.token AND {TABLE}.expire_at > {{now}}
                       THEN {TABLE}.acquired_at ELSE excluded.acquired_at END,
    expire_at = excluded.expire_at
WHERE ({TABLE}.token = excluded.token AND {TABLE}.expire_at > {{now}})
   OR ({TABLE}.expire_at <= {{now}} AND NOT EXISTS (
        SELECT 1 FROM {WAITERS} w WHERE w.name = {TABLE}.name
        AND w.expire_at > {{now}} AND w.id < %s))
RETURNING fence
""".format(now=dbclock._NOW["sqlite"], now_plus=dbclock._NOW_PLUS["sqlite"])

_MYSQL_SELECT = (
    f"SELECT token, expire_at <= UTC_TIMESTAMP(6), fence, EXISTS ("
    f"SELECT 1 FROM {WAITERS} w WHERE w.name = %s AND w.expire_at > UTC_TIMESTAMP(6) "
    f"AND w.id < %s) FROM {TABLE} WHERE name = %s FOR UPDATE"
)
_MYSQL_TAKE = (
    # The first parameter says whether this is the caller's own live lease
    # (a retried acquire): it keeps its acquired_at.
    f"UPDATE {TABLE} SET acquired_at = IF(%s, acquired_at, UTC_TIMESTAMP(6)), "
    "token = %s, owner = %s, fence = %s, "
    "expire_at = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND "
    "WHERE name = %s"
)
_MYSQL_AHEAD = (
    f"SELECT EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %s "
    "AND w.expire_at > UTC_TIMESTAMP(6) AND w.id < %s)"
)
_MYSQL_FLOOR = f"SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1 LOCK IN SHARE MODE"
_MYSQL_INSERT = (
    f"INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) "
    "VALUES (%s, %s, %s, %s, UTC_TIMESTAMP(6), "
    "UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND)"
)

_PG_TAKE_OVER = f"""
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
WHERE l.expire_at <= statement_timestamp() OR l.token = EXCLUDED.token OR l.token LIKE %s
RETURNING fence
"""

# Wakes the head of the key's queue, if any (nothing is sent when nobody
# waits), and the candidates of an election, which listen by name.
_PG_RELEASE = f"""
WITH released AS (
    UPDATE {TABLE} SET token = '', expire_at = statement_timestamp()
    WHERE name = %s AND token = %s AND expire_at > statement_timestamp()
    RETURNING name{{returning}}
)
SELECT {queue.PG_WAKE_HEAD.format(name="released.name")},
       CASE WHEN left(name, 7) = 'leader:' THEN pg_notify('{NOTIFY_CHANNEL}', name) END
FROM released
"""
_PG_RELEASE_SQL = {
    durable: _PG_RELEASE.format(returning="" if durable else _FAST_COMMIT)
    for durable in (True, False)
}


class _Handoff:
    """What a worker thread's acquiring step and its (maybe cancelled) task share."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.cancelled = False
        self.finished = False
        self.result: Any = None


class LeaseStrategy:
    """Lease rows in the ``Lock`` table (see the module docstring)."""

    name = "lease"
    family = "lease"
    #: a lease outlives the caller's transaction (released or expired, never rolled back)
    transaction_scoped = False

    def ended(self, req: Request) -> bool:
        return False  # a lease ends by release, expiry or takeover, never on its own

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        if connection.vendor not in ("postgresql", "sqlite", "mysql"):
            raise StrategyNotSupported(
                f"the lease strategy does not support the {connection.vendor!r} database"
            )

    # -- acquire ---------------------------------------------------------------

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        fence = self.try_acquire(req)
        if fence is not None:
            return Grant(fence)
        if deadline.expired():
            return None
        ticket = queue.enqueue(req)
        return self.wait_ticket(req, ticket, deadline, policy)

    def wait_ticket(
        self, req: Request, ticket: int, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        """Wait with ``ticket`` until granted (the ticket is then gone) or the deadline.

        The place is given up (the ticket deleted) on a timeout or an error.
        """
        granted = False
        try:
            listen = self._listener(req.alias)
            waiter = notify.Waiter()
            payload = queue.wake_payload(ticket)
            if listen is not None:
                listen.wait_ready(min(1.0, deadline.remaining()))
                listen.register(payload, waiter)
            try:
                place = _Place(ticket)
                plan = self._plan(deadline, policy, listen)
                step = next(plan)
                while True:
                    kind, pause = step
                    if kind == "sleep":
                        result: Any = waiter.thread_event.wait(pause)
                        waiter.clear()
                    else:
                        result = self._step(kind, req, place)
                    step = plan.send(result)
            except StopIteration as done:
                granted = done.value is not None
                return None if done.value is None else Grant(done.value)
            finally:
                if listen is not None:
                    listen.unregister(payload, waiter)
        finally:
            if not granted:
                queue.leave(req.alias, ticket)

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        fence = await self._attempt(self.try_acquire, req)
        if fence is not None:
            return Grant(fence)
        if deadline.expired():
            return None
        ticket = await self.aenqueue(req)
        return await self.await_ticket(req, ticket, deadline, policy)

    async def aenqueue(self, req: Request) -> int:
        """Take a ticket off the event loop; a cancellation meanwhile leaves none behind."""
        task = asyncio.ensure_future(sync_to_async(queue.enqueue)(req))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def done(finished: asyncio.Future[int]) -> None:
                if not finished.cancelled() and finished.exception() is None:
                    start_db_thread(
                        functools.partial(queue.leave, req.alias, finished.result()),
                        "django-dlock-give-back",
                    )

            task.add_done_callback(done)
            raise

    async def await_ticket(
        self, req: Request, ticket: int, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        """Async :meth:`wait_ticket`: a cancelled wait leaves no ticket and no lock."""
        granted = False
        try:
            listen = self._listener(req.alias)
            waiter = notify.Waiter(asyncio.get_running_loop())
            assert waiter.async_event is not None
            payload = queue.wake_payload(ticket)
            if listen is not None:
                await sync_to_async(listen.wait_ready, thread_sensitive=False)(
                    min(1.0, deadline.remaining())
                )
                listen.register(payload, waiter)
            try:
                place = _Place(ticket)
                plan = self._plan(deadline, policy, listen)
                step = next(plan)
                while True:
                    kind, pause = step
                    result: Any
                    if kind == "sleep":
                        result = False
                        with contextlib.suppress(asyncio.TimeoutError):
                            result = await asyncio.wait_for(waiter.async_event.wait(), pause)
                        waiter.clear()
                    else:
                        step_of = functools.partial(self._step_of, kind, place)
                        result = await self._attempt(step_of, req)
                    step = plan.send(result)
            except StopIteration as done:
                granted = done.value is not None
                return None if done.value is None else Grant(done.value)
            finally:
                if listen is not None:
                    listen.unregister(payload, waiter)
        finally:
            if not granted:
                leave = sync_to_async(queue.leave)
                await asyncio.shield(leave(req.alias, ticket))

    async def _attempt(self, step: Callable[[Request], Any], req: Request) -> Any:
        """Run one acquiring step in a worker thread, safe against cancellation.

        The statement cannot be stopped once it runs. If the task is
        cancelled meanwhile (``asyncio.wait_for``, a client that went away),
        a lease the step took is given back as soon as the step ends, so a
        cancelled acquire leaves no lock behind.
        """
        handoff = _Handoff()

        def run() -> Any:
            result = step(req)
            with handoff.mutex:
                handoff.finished = True
                handoff.result = result
                give_back = handoff.cancelled
            if give_back:
                self._give_back(req, result)
            return result

        try:
            return await sync_to_async(run)()
        except asyncio.CancelledError:
            with handoff.mutex:
                handoff.cancelled = True
                late = handoff.finished
            if late:  # the step finished but its result never reached us
                thread = threading.Thread(
                    target=self._give_back_and_close,
                    args=(req, handoff.result),
                    name="django-dlock-give-back",
                    daemon=True,
                )
                thread.start()
            raise

    def _give_back(self, req: Request, result: Any) -> None:
        if isinstance(result, int) and not isinstance(result, bool):
            try:
                self.release(req)
            except Exception:
                logger.exception(
                    "django-dlock: could not give back %s after a cancelled acquire",
                    req.key.name,
                )

    def _give_back_and_close(self, req: Request, result: Any) -> None:
        try:
            self._give_back(req, result)
        finally:
            connections[req.alias].close()
            close_private_connections()

    def _step_of(self, kind: str, place: _Place, req: Request) -> Any:
        return self._step(kind, req, place)

    def _step(self, kind: str, req: Request, place: _Place) -> Any:
        """A waiter's look ("look": a read, and the ticket's renewal when due) or
        try ("try": take the lease with the ticket); an :class:`Outage` if the
        database is away."""
        try:
            if kind == "try":
                return self.try_acquire(req, place.ticket)
            now = time.monotonic()
            if now - place.renewed >= queue.renew_every():
                queue.beat(req, place.ticket)
                place.renewed = now
            return self._look(req, place.ticket)
        except (OperationalError, InterfaceError) as exc:
            logger.warning(
                "django-dlock: waiting for %s: database unavailable: %s", req.key.name, exc
            )
            return Outage(exc)

    def _look(self, req: Request, ticket: int) -> Look:
        """One read: seconds until the lease ends, and whether a live ticket is ahead."""
        found = self._read(
            req.alias,
            f"SELECT (SELECT {{left}} FROM {TABLE} WHERE name = %s), "
            f"CASE WHEN EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %s "
            "AND w.expire_at > {now} AND w.id < %s) THEN 1 ELSE 0 END",
            [req.key.name, req.key.name, ticket],
        )
        left = -1.0 if found is None or found[0] is None else float(found[0])
        return Look(left, bool(found[1]) if found is not None else False)

    def _listener(self, alias: str) -> notify.Listener | None:
        if connections[alias].vendor != "postgresql":
            return None
        return notify.listener(alias)

    def _plan(
        self, deadline: Deadline, policy: RetryInterval, listen: notify.Listener | None
    ) -> Generator[Step, Any, int | None]:
        """How a waiter with a ticket waits, as steps for a sync or an async driver.

        Each turn tries to take the lease with the ticket (granted only when
        the lease is free and no live ticket is ahead), else renews the
        ticket and reads how long the current lease runs. The first turn
        comes right after the ticket was taken and the wake-up registered,
        so a release in between is never slept through. Between turns, park
        until a NOTIFY addressed to this ticket wakes us (PostgreSQL) or the
        retry interval passes (elsewhere), never past the end of the current
        lease, the deadline, or a quarter of the ticket's own lease.

        A waiter rides out an outage of the database (a restart, a dropped
        connection): it backs off and looks again until its deadline, and
        then raises the database's error rather than report a timeout.
        """
        attempt = 0
        woken = False
        while True:
            # Woken by a NOTIFY addressed to this ticket: try at once.
            look: Look | Outage = Look(0.0, False) if woken else (yield ("look", 0.0))
            if not isinstance(look, Outage) and look.left <= 0 and not look.ahead:
                fence: int | None | Outage = yield ("try", 0.0)
                if isinstance(fence, Outage):
                    look = fence
                elif fence is not None:
                    return fence
            if isinstance(look, Outage):
                if deadline.expired():
                    raise look.error
                pause = min(MAX_OUTAGE_PAUSE, max(0.05, interval(policy, attempt)))
                yield ("sleep", min(pause, deadline.remaining()))
                attempt += 1
                woken = False
                continue
            if deadline.expired():
                return None
            left = look.left
            if listen is not None and listen.healthy:
                pause = MAX_PARK if left <= 0 else min(MAX_PARK, left + EXPIRY_MARGIN)
            else:
                pause = interval(policy, attempt)
                if left > 0:
                    pause = min(pause, left + EXPIRY_MARGIN)
            pause = min(pause, queue.renew_every())
            woken = bool((yield ("sleep", max(0.0, min(pause, deadline.remaining())))))
            attempt += 1

    def try_acquire(self, req: Request, ticket: int | None = None) -> int | None:
        """Take the lease if it is free and no live ticket is ahead; the fencing number.

        Without ``ticket`` (a newcomer) every live ticket is ahead. With it,
        the granted ticket is deleted.
        """
        # Retrying after a dropped connection is safe: the same token
        # re-acquires its own lease with the same fencing number.
        fence, _ = with_reconnect(
            req.alias, lambda connection: self._acquire_on(connection, req, ticket)
        )
        if ticket is not None and fence is not None:
            queue.done(ticket)
        return fence

    def _acquire_on(
        self, connection: BaseDatabaseWrapper, req: Request, ticket: int | None
    ) -> int | None:
        vendor = dbclock.vendor(connection)
        if vendor == "mysql":
            return self._mysql_acquire(connection, req, ticket)
        name, token = req.key.name, req.token
        place = queue.NEWCOMER if ticket is None else ticket
        params = [name, token, req.owner, req.ttl, name, place, name, token, place]
        if vendor == "postgresql":
            if ticket is not None:
                sql = _PG_ACQUIRE_TICKET_SQL[conf.LEASE_SYNCHRONOUS_COMMIT]
                row = fetch_one(connection, sql, [*params, ticket], True)
                return None if row is None else int(row[0])
            sql = _PG_ACQUIRE_SQL[conf.LEASE_SYNCHRONOUS_COMMIT]
        else:
            sql = _SQLITE_ACQUIRE
        row = fetch_one(connection, sql, params, True)
        if row is None:
            return None
        if ticket is not None:
            queue.forget(connection, ticket)
        return int(row[0])

    def _mysql_acquire(
        self, connection: BaseDatabaseWrapper, req: Request, ticket: int | None
    ) -> int | None:
        # One short transaction: lock the row, decide, write. A missing row
        # is inserted above the fence floor; two racing inserters are told
        # apart by the unique index (the loser retries once).
        for _attempt in range(2):
            with cursor(connection) as cur:
                cur.execute("START TRANSACTION")
                try:
                    fence = self._mysql_take(cur, req, ticket)
                except IntegrityError:
                    cur.execute("ROLLBACK")
                    continue
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT" if fence is not None else "ROLLBACK")
                return fence
        return None

    def _mysql_take(self, cur: Any, req: Request, ticket: int | None) -> int | None:
        place = queue.NEWCOMER if ticket is None else ticket
        cur.execute(_MYSQL_SELECT, [req.key.name, place, req.key.name])
        row = cur.fetchone()
        if row is None:
            # No row (never used, or deleted by cleanup): live tickets still go first.
            cur.execute(_MYSQL_AHEAD, [req.key.name, place])
            if cur.fetchone()[0]:
                return None
            cur.execute(_MYSQL_FLOOR)
            floor = cur.fetchone()
            fence = (int(floor[0]) if floor else 0) + 1
            cur.execute(_MYSQL_INSERT, [req.key.name, req.token, req.owner, fence, req.ttl])
        else:
            token, free, fence, ahead = row[0], bool(row[1]), int(row[2]), bool(row[3])
            own = token == req.token and not free
            if own:
                pass
            elif free and not ahead:
                fence += 1
            else:
                return None
            cur.execute(_MYSQL_TAKE, [own, req.token, req.owner, fence, req.ttl, req.key.name])
        if ticket is not None:
            cur.execute(f"DELETE FROM {WAITERS} WHERE id = %s", [ticket])
        return fence

    # -- release, extend, inspect ---------------------------------------------

    def release(self, req: Request) -> bool:
        released, retried = with_reconnect(
            req.alias, lambda connection: self._release_on(connection, req)
        )
        if not released and retried:
            # The first try may have released before its connection dropped:
            # a free row (empty token) means nobody else holds it.
            found = self._read(
                req.alias, f"SELECT token FROM {TABLE} WHERE name = %s", [req.key.name]
            )
            return found is None or found[0] == ""
        return released

    def _release_on(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        if connection.vendor == "postgresql":
            sql = _PG_RELEASE_SQL[conf.LEASE_SYNCHRONOUS_COMMIT]
            return fetch_one(connection, sql, [req.key.name, req.token]) is not None
        now = dbclock.now_sql(connection)
        sql = (
            f"UPDATE {TABLE} SET token = '', expire_at = {now} "
            f"WHERE name = %s AND token = %s AND expire_at > {now}"
        )
        return bool(execute(connection, sql, [req.key.name, req.token])[1])

    def extend(self, req: Request, ttl: float) -> bool:
        extended, _ = with_reconnect(
            req.alias, lambda connection: self._extend_on(connection, req, ttl)
        )
        return extended

    def _extend_on(self, connection: BaseDatabaseWrapper, req: Request, ttl: float) -> bool:
        now = dbclock.now_sql(connection)
        now_plus = dbclock.now_plus_sql(connection)
        fast = connection.vendor == "postgresql" and not conf.LEASE_SYNCHRONOUS_COMMIT
        returning = f" RETURNING 1{_FAST_COMMIT}" if fast else ""
        # A lease that has run out is not revived, even if nobody took it.
        sql = (
            f"UPDATE {TABLE} SET expire_at = {now_plus} "
            f"WHERE name = %s AND token = %s AND expire_at > {now}"
        )
        return bool(execute(connection, sql + returning, [ttl, req.key.name, req.token])[1])

    def release_after(self, req: Request, min_hold: float) -> bool:
        """Release, but keep the lease until ``acquired_at + min_hold`` (database time).

        One statement: the token is cleared (nobody, not even the caller,
        can re-enter) and ``expire_at`` becomes the later of now and
        ``acquired_at + min_hold``. Used by :class:`~django_dlock.TaskLock`.
        ``False`` if the caller no longer holds the lease.
        """
        connection = lock_connection(req.alias)
        vendor = dbclock.vendor(connection)
        now = dbclock.now_sql(connection)
        later = {
            "postgresql": "GREATEST({now}, "
            "COALESCE(acquired_at + %s * interval '1 second', {now}))",
            "sqlite": "MAX({now}, COALESCE(strftime('%%Y-%%m-%%d %%H:%%M:%%f', acquired_at, "
            "%s || ' seconds'), {now}))",
            "mysql": "GREATEST({now}, COALESCE(acquired_at + INTERVAL ROUND(%s * 1000000) "
            "MICROSECOND, {now}))",
        }[vendor].format(now=now)
        with cursor(connection) as cur:
            cur.execute(
                f"UPDATE {TABLE} SET expire_at = {later}, token = '' "
                f"WHERE name = %s AND token = %s AND expire_at > {now}",
                [float(min_hold), req.key.name, req.token],
            )
            return bool(cur.rowcount)

    def _read(self, alias: str, sql: str, params: list[Any]) -> Any:
        """One row of a read-only query with ``{now}`` / ``{left}`` filled per database."""

        def run(connection: BaseDatabaseWrapper) -> Any:
            query = sql.format(
                now=dbclock.now_sql(connection),
                left=dbclock.seconds_until_sql(connection, "expire_at"),
            )
            return fetch_one(connection, query, params)

        found, _ = with_reconnect(alias, run)
        return found

    def take_over(self, req: Request, over: str) -> int | None:
        """PostgreSQL: acquire like :meth:`try_acquire`, also over a live lease
        whose token starts with ``over``.

        For a caller that already proved by other means (an advisory lock)
        that the holder of such a lease is gone: ``LeaderElection`` with the
        advisory strategy records its leader here. Returns the fencing
        number, or ``None`` if a live lease of another kind holds the row.
        """
        connection = lock_connection(req.alias)
        if connection.vendor != "postgresql":
            raise StrategyNotSupported("take_over needs PostgreSQL")
        pattern = over.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        row = fetch_one(
            connection,
            _PG_TAKE_OVER,
            [req.key.name, req.token, req.owner, req.ttl, pattern],
        )
        return None if row is None else int(row[0])

    def locked(self, alias: str, key: Key) -> bool:
        sql = f"SELECT 1 FROM {TABLE} WHERE name = %s AND expire_at > {{now}}"
        return self._read(alias, sql, [key.name]) is not None

    def owned(self, req: Request) -> bool:
        sql = f"SELECT 1 FROM {TABLE} WHERE name = %s AND token = %s AND expire_at > {{now}}"
        return self._read(req.alias, sql, [req.key.name, req.token]) is not None

    def loss_reason(self, req: Request) -> str:
        """Why ``req``'s lease is no longer the caller's, from what its row says now.

        One read, only after an extend, release or check has failed: the
        row's token was cleared (force-released in the admin or with
        ``dlock_release``), belongs to someone else (taken over after the
        lease ran out), is still the caller's but expired (nobody took it),
        or the row is gone (deleted).
        """
        found = self._read(
            req.alias,
            f"SELECT token, CASE WHEN expire_at > {{now}} THEN 1 ELSE 0 END "
            f"FROM {TABLE} WHERE name = %s",
            [req.key.name],
        )
        if found is None:
            return "its row was deleted (force-released and cleaned up)"
        token, live = found[0], bool(found[1])
        if token == req.token:
            return "its lease expired on the database clock (nobody has taken it since)"
        if token == "":
            return (
                "it was force-released (in the admin or with dlock_release), "
                "or it expired and another holder took it and released it since"
            )
        if live:
            return "its lease expired and was taken over by another holder"
        return (
            "its lease expired and was taken over by another holder (whose lease has run out since)"
        )

    def seconds_left(self, alias: str, key: Key) -> float:
        """Seconds until the current lease of ``key`` ends (<= 0: free now)."""
        found = self._read(alias, f"SELECT {{left}} FROM {TABLE} WHERE name = %s", [key.name])
        return -1.0 if found is None or found[0] is None else float(found[0])


lease = LeaseStrategy()
