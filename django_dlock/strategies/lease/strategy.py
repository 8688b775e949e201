"""The lease strategy's operations: acquire (sync and async), release, extend, inspect.

What the statements do, and how fencing numbers and durability work, is
described in :mod:`django_dlock.strategies.lease`. The statements are in
:mod:`.sql`, one try to take the lease in :mod:`.acquire`, a waiter's plan
in :mod:`.waiting`, and an async step's cancellation in :mod:`.handoff`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock, notify
from django_dlock._threads import start_db_thread
from django_dlock.conf import RetryInterval, conf
from django_dlock.exceptions import StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline
from django_dlock.strategies import queue
from django_dlock.strategies.base import (
    HELD,
    CountsPermits,
    Grant,
    Guards,
    Request,
    SharesApart,
    Strategy,
    TakesTickets,
)
from django_dlock.strategies.connection import (
    committed_view,
    execute,
    fetch_one,
    lock_connection,
    with_reconnect,
)
from django_dlock.strategies.lease.acquire import acquire_on
from django_dlock.strategies.lease.pins import (
    PINNED,
    CallerGone,
    RowPinned,
    in_caller_transaction,
    pinned_by_caller,
    remember_pin,
)
from django_dlock.strategies.lease.sql import FAST_COMMIT, PG_RELEASE_SQL, PG_TAKE_OVER, TABLE, read
from django_dlock.strategies.lease.waiting import Look, TicketWait, attempt, look

#: why a key could not be taken (the words of the log messages; HELD in base)
QUEUED_AHEAD = "is free, but other waiters are queued ahead"


logger = logging.getLogger("django_dlock")

#: seconds between two tries of a release deferred past the caller's SQLite transaction
_AFTER_TRANSACTION_POLL = 0.05


def caller_pin(req: Request) -> BaseDatabaseWrapper | None:
    """The calling thread's connection when its open transaction pinned
    ``req``'s lease row (see :func:`~django_dlock.strategies.lease.pins.pinned_by_caller`),
    asked only when the row is pinned somewhere: the usual release and
    extend look no further than the (empty) table of pins."""
    if PINNED and (req.alias, req.row, req.token) in PINNED:
        return pinned_by_caller(req)
    return None


def _release_after_transaction(
    caller: BaseDatabaseWrapper,
    req: Request,
    release_on: Callable[[BaseDatabaseWrapper, Request], bool],
    release_fenced: Callable[[BaseDatabaseWrapper, Request, int], object] | None = None,
) -> bool:
    """Release ``req`` in the caller's transaction, and again once that
    transaction has ended.

    For the caller's transaction whose guard pinned the lease row (on any
    database), and SQLite's writing transaction: no other connection can
    change the row until the caller's transaction ends (SQLite has one
    writer at a time), so the release runs on the caller's connection, as
    part of that transaction (in a savepoint: a failed release leaves the
    transaction usable), and the lock is free the moment it commits, with
    the transaction's writes. A rollback undoes the release with the rest:
    so a thread of its own releases the lease again as soon as the caller's
    transaction has ended (nobody else could take the key before that);
    after a commit it finds nothing left to do. That statement matches the
    fencing number committed before the release (read on the thread's
    private connection, which does not see the caller's transaction): a
    grant made inside the caller's transaction is undone by its rollback,
    and a new grant of the same key afterwards (the same thread trying
    again) is left alone. On PostgreSQL and MySQL/MariaDB it waits for the
    row that the caller's transaction holds, at most as long as the lease
    has left; on SQLite it tries again every few milliseconds.

    A transaction that failed (an error inside ``transaction.atomic``:
    Django lets no statement run in it until it is rolled back) is only
    read, to tell whether the lease was still the caller's; its rollback
    and the thread do the rest.

    ``release_fenced(connection, req, fence)``: the release after the
    transaction, of the lease with that fencing number only (a reader's;
    without it, the lease row's).
    """
    now = dbclock.now_sql(caller)
    mine = (
        f"SELECT fence, {dbclock.seconds_until_sql(caller, 'expire_at')} FROM {TABLE} "
        f"WHERE name = %s AND token = %s AND expire_at > {now}"
    )
    try:
        committed = fetch_one(committed_view(req.alias), mine, [req.row, req.token])
    except OperationalError as exc:  # SQLite: the caller's transaction keeps even readers out
        logger.warning(
            "django-dlock: could not read the lease of %s outside its holder's "
            "transaction: %s; if that transaction rolls back, the lease runs out on its own",
            req.row,
            exc,
        )
        committed = None
    if caller.needs_rollback:
        if caller.vendor == "sqlite":  # (sqlite3's own placeholders: Django's cursor refuses)
            raw_sql = mine % ("?", "?")
            found = caller.connection.execute(raw_sql, [req.row, req.token]).fetchone()
            released = found is not None
        else:  # (the server may refuse any statement in it: what was committed tells)
            released = committed is not None
    else:
        with in_caller_transaction(caller):
            released = release_on(caller, req)
    if committed is None:
        return released
    fence = int(committed[0])
    params: list[Any] = [req.row, req.token, fence]
    left = max(float(committed[1]), 0.0) + 1.0
    until = time.monotonic() + left

    def release() -> None:
        connection = connections[req.alias]  # this thread's own
        vendor = connection.vendor
        now = dbclock.now_sql(connection)
        sql = (
            f"UPDATE {TABLE} SET token = '', expire_at = {now} "
            f"WHERE name = %s AND token = %s AND fence = %s AND {dbclock.live_row_sql(connection)}"
        )
        args: list[Any] = list(params)
        if vendor == "postgresql":  # wakes the key's queue, as a release does
            sql += f" RETURNING CASE WHEN queued THEN {queue.PG_WAKE_HEAD.format(name='%s')} END"
            args.append(req.key.name)
        while True:
            try:
                with transaction.atomic(using=req.alias), connection.cursor() as cur:
                    if vendor == "postgresql":
                        cur.execute(f"SET LOCAL lock_timeout = {math.ceil(left * 1000)}")
                    elif vendor == "mysql":  # (this thread's connection is closed after)
                        cur.execute(f"SET SESSION innodb_lock_wait_timeout = {math.ceil(left)}")
                    if release_fenced is None:
                        cur.execute(sql, args)
                    else:
                        release_fenced(connection, req, fence)
                return
            except DatabaseError as exc:  # still locked by the caller's transaction?
                if (
                    vendor != "sqlite"
                    or not isinstance(exc, OperationalError)
                    or time.monotonic() > until
                ):
                    logger.warning(
                        "django-dlock: could not release %s after its transaction: %s; "
                        "the lease runs out on its own",
                        req.row,
                        exc,
                    )
                    return
                time.sleep(_AFTER_TRANSACTION_POLL)

    start_db_thread(release, "django-dlock-release-after-transaction", alias=req.alias)
    return released


class LeaseStrategy:
    """Lease rows in the ``Lock`` table (see :mod:`django_dlock.strategies.lease`)."""

    name = "lease"
    family = "lease"
    #: a lease outlives the caller's transaction (released or expired, never rolled back)
    transaction_scoped = False
    leased = True
    #: many readers or one writer: readers' leases are rows of their own (SharesApart)
    shares = True
    shared_by = "django_dlock.strategies.lease.shared:shared_lease"
    #: a semaphore's permits: a lease row each (CountsPermits)
    permits_by = "django_dlock.strategies.lease.permits:permit_strategy"

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
        ticket = self.enqueue(req)
        return self.wait_ticket(req, ticket, deadline, policy)

    def try_acquire(self, req: Request, ticket: int | None = None) -> int | None:
        """Take the lease if it is free and no live ticket is ahead; the fencing number.

        Without ``ticket`` (a newcomer) every live ticket is ahead. With it,
        the granted ticket is deleted. One try is :meth:`acquire_on` (a
        semaphore's permit, a reader: theirs, which record the row they
        took in ``req.row``).
        """
        # Retrying after a dropped connection is safe: the same token takes its
        # own lease again (if the first try wrote it), with a new fencing number.
        fence, _ = with_reconnect(
            req.alias, lambda connection: self.acquire_on(connection, req, ticket)
        )
        if ticket is not None and fence is not None:
            queue.done(ticket)
        return fence

    def look(self, req: Request, ticket: int) -> Look:
        """A waiter's look: how long the key stays taken, and whether a live
        ticket is ahead of ``ticket``."""
        return look(req, ticket)

    #: one try on a connection (a quorum's: its private connection to one database)
    acquire_on = staticmethod(acquire_on)

    def wait_ticket(
        self, req: Request, ticket: int, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        """Wait with ``ticket`` until granted (the ticket is then gone) or the deadline.

        The place is given up (the ticket deleted) on a timeout or an error.
        """
        wait: TicketWait | None = None
        try:
            waiter = notify.Waiter()
            wait = TicketWait(req, ticket, deadline, policy, waiter, self)
            if wait.listen is not None:
                wait.listen.wait_ready(min(1.0, deadline.remaining()))
            with contextlib.closing(wait):
                for kind, pause in wait:
                    if kind == "sleep":
                        wait.reply = waiter.thread_event.wait(pause)
                        waiter.clear()
                    else:
                        wait.reply = wait.step(kind)
            return wait.grant
        finally:
            if wait is None or wait.grant is None:
                queue.leave(req.alias, ticket)

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        fence = await attempt(functools.partial(self.try_acquire, req), req, self.release)
        if fence is not None:
            return Grant(fence)
        if deadline.expired():
            return None
        ticket = await self.aenqueue(req)
        return await self.await_ticket(req, ticket, deadline, policy)

    def enqueue(self, req: Request) -> int:
        """Take a ticket in the key's queue; its number."""
        return queue.enqueue(req)

    async def aenqueue(self, req: Request) -> int:
        """Take a ticket off the event loop; a cancellation meanwhile leaves none behind."""
        task = asyncio.ensure_future(sync_to_async(self.enqueue)(req))
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
        wait: TicketWait | None = None
        try:
            waiter = notify.Waiter(asyncio.get_running_loop())
            wait = TicketWait(req, ticket, deadline, policy, waiter, self)
            woken = waiter.async_event
            assert woken is not None
            if wait.listen is not None:
                await sync_to_async(wait.listen.wait_ready, thread_sensitive=False)(
                    min(1.0, deadline.remaining())
                )
            with contextlib.closing(wait):
                for kind, pause in wait:
                    if kind == "sleep":
                        wait.reply = False
                        with contextlib.suppress(asyncio.TimeoutError):
                            wait.reply = await asyncio.wait_for(woken.wait(), pause)
                        waiter.clear()
                    else:
                        step = functools.partial(wait.step, kind)
                        wait.reply = await attempt(step, req, self.release)
            return wait.grant
        finally:
            if wait is None or wait.grant is None:
                leave = sync_to_async(queue.leave)
                await asyncio.shield(leave(req.alias, ticket))

    # -- release, extend, inspect ---------------------------------------------

    def release(self, req: Request) -> bool:
        caller = caller_pin(req)
        if caller is not None:  # the caller's open transaction share-locks the row
            with contextlib.suppress(CallerGone):  # (gone: the usual way below)
                return _release_after_transaction(caller, req, self._release_on_for(req))
        if req.hold_at_least:  # TaskLock's min_hold
            return self.release_after(req, req.hold_at_least)
        connection = lock_connection(req.alias)
        if connection.in_atomic_block:  # SQLite: the caller's transaction has written
            return _release_after_transaction(connection, req, self.release_on)
        released, retried = with_reconnect(
            req.alias, lambda connection: self.release_on(connection, req), connection
        )
        if not released and retried:
            # The first try may have released before its connection dropped:
            # a free row (empty token) means nobody else holds it.
            found = read(req.alias, f"SELECT token FROM {TABLE} WHERE name = %s", [req.row])
            return found is None or found[0] == ""
        return released

    def _release_on_for(self, req: Request) -> Callable[[BaseDatabaseWrapper, Request], bool]:
        """:meth:`release_on`, or :meth:`release_after_on` for ``req``'s minimum hold."""
        if req.hold_at_least:
            return lambda connection, req: self.release_after_on(connection, req, req.hold_at_least)
        return self.release_on

    def release_on(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        """Release on ``connection``; ``False`` if the lease there is no longer ours.

        Inside the caller's transaction the release is as durable as the
        transaction's own commit (the fast durability is the lock
        statement's own transaction's, never the caller's)."""
        if connection.vendor == "postgresql":
            durable = conf.LEASE_SYNCHRONOUS_COMMIT or connection.in_atomic_block
            sql = PG_RELEASE_SQL[durable]
            params = [req.row, req.token, req.key.name]  # wakes the key's queue
            return execute(connection, sql, params)[0] is not None
        sql = (
            f"UPDATE {TABLE} SET token = '', expire_at = {dbclock.now_sql(connection)} "
            f"WHERE name = %s AND token = %s AND {dbclock.live_row_sql(connection)}"
        )
        return bool(execute(connection, sql, [req.row, req.token])[1])

    def extend(self, req: Request, ttl: float) -> bool:
        caller = caller_pin(req)
        if caller is not None:
            # The caller's open transaction share-locks the row: the new
            # expiry is part of that transaction (a rollback undoes it).
            with contextlib.suppress(CallerGone), in_caller_transaction(caller):
                return self.extend_on(caller, req, ttl)
        pins = PINNED.get((req.alias, req.row, req.token)) if PINNED else None
        if pins is not None and pins.current():
            # The holder's renewer: its holder's transaction (a guard inside
            # an outer one) keeps the row locked, and would keep this
            # statement waiting until it ends, its holder with it if that
            # holder releases meanwhile (the release stops the renewer).
            # The renewer tries again soon; nobody can take the lease over
            # while the row is locked.
            raise RowPinned(
                "its holder's open transaction keeps the lease row locked (a guard "
                "inside an outer transaction): renewed once that transaction has ended"
            )
        extended, _ = with_reconnect(
            req.alias, lambda connection: self.extend_on(connection, req, ttl)
        )
        return extended

    def extend_on(self, connection: BaseDatabaseWrapper, req: Request, ttl: float) -> bool:
        """Renew on ``connection``; ``False`` if the lease there is no longer ours."""
        now_plus = dbclock.now_plus_sql(connection)
        fast = (
            connection.vendor == "postgresql"
            and not conf.LEASE_SYNCHRONOUS_COMMIT
            and not connection.in_atomic_block  # (never the caller's transaction's durability)
        )
        returning = f" RETURNING 1{FAST_COMMIT}" if fast else ""
        # A lease that has run out is not revived, even if nobody took it.
        if connection.vendor == "postgresql":
            # Judged once the row is ours (clock_timestamp, after the locking
            # subquery): a renewal that waited for the row, held by another
            # session, past the lease's end finds it ended. Judged when the
            # statement began, it would bring back a lease whose holder was
            # already told it lost it.
            sql = (
                f"UPDATE {TABLE} SET expire_at = {now_plus} WHERE id = (SELECT id FROM {TABLE} "
                "WHERE name = %s AND token = %s FOR UPDATE) AND expire_at > clock_timestamp()"
            )
        else:
            sql = (
                f"UPDATE {TABLE} SET expire_at = {now_plus} "
                f"WHERE name = %s AND token = %s AND {dbclock.live_row_sql(connection)}"
            )
        return bool(execute(connection, sql + returning, [ttl, req.row, req.token])[1])

    def release_after(self, req: Request, min_hold: float) -> bool:
        """Release, but keep the lease until ``acquired_at + min_hold`` (database time).

        One statement: the token is cleared (nobody, not even the caller,
        can re-enter) and ``expire_at`` becomes the later of now and
        ``acquired_at + min_hold``. Used by :class:`~django_dlock.TaskLock`.
        ``False`` if the caller no longer holds the lease.
        """
        return self.release_after_on(lock_connection(req.alias), req, min_hold)

    def release_after_on(
        self, connection: BaseDatabaseWrapper, req: Request, min_hold: float
    ) -> bool:
        """:meth:`release_after` on ``connection`` (a quorum's private connection)."""
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
        sql = (
            f"UPDATE {TABLE} SET expire_at = {later}, token = '' "
            f"WHERE name = %s AND token = %s AND {dbclock.live_row_sql(connection)}"
        )
        return bool(execute(connection, sql, [float(min_hold), req.row, req.token])[1])

    def take_over(self, req: Request, over: str) -> int | None:
        """PostgreSQL: acquire like :meth:`try_acquire`, also over a live lease
        whose token starts with ``over``.

        For a caller that already proved by other means (an advisory lock)
        that the holder of such a lease is gone: ``LeaderElection`` with the
        advisory strategy records its leader here. A lease counts as ended
        when the row is examined, so a take-over that waited for a release
        in flight takes the row that release ended. Returns the fencing
        number, or ``None`` if a live lease of another kind holds the row.
        """
        connection = lock_connection(req.alias)
        if connection.vendor != "postgresql":
            raise StrategyNotSupported("take_over needs PostgreSQL")
        pattern = over.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        row = fetch_one(
            connection,
            PG_TAKE_OVER,
            [req.key.name, req.token, req.owner, req.ttl, pattern],
        )
        return None if row is None else int(row[0])

    def locked(self, alias: str, key: Key) -> bool:
        sql = f"SELECT 1 FROM {TABLE} WHERE name = %s AND expire_at > {{now}}"
        return read(alias, sql, [key.name]) is not None

    def owned(self, req: Request) -> bool:
        sql = f"SELECT 1 FROM {TABLE} WHERE name = %s AND token = %s AND expire_at > {{now}}"
        return read(req.alias, sql, [req.row, req.token]) is not None

    def pin(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        """In the caller's transaction: the lease is still ours, and stays so
        until the transaction ends (a take-over waits for the row)."""
        if connection.vendor == "sqlite":
            # one writer at a time: this write keeps every take-over out
            now = dbclock.now_sql(connection)
            with connection.cursor() as cur:
                cur.execute(
                    f"UPDATE {TABLE} SET expire_at = expire_at "
                    f"WHERE name = %s AND token = %s AND expire_at > {now}",
                    [req.row, req.token],
                )
                found = bool(cur.rowcount)
        else:
            sql, params = self.pin_query(connection, req)
            with connection.cursor() as cur:
                cur.execute(sql, params)
                found = cur.fetchone() is not None
        if connection.in_atomic_block:
            # (also when nothing was found: MySQL/MariaDB keep the row's lock
            # all the same, SQLite the database's write lock)
            remember_pin(connection, req)
        return found

    def pin_query(self, connection: BaseDatabaseWrapper, req: Request) -> tuple[str, list[str]]:
        """The ``SELECT`` of :meth:`pin` on PostgreSQL and MySQL/MariaDB: one
        row while the lease is ours, share-locked until the transaction ends."""
        now = dbclock.now_sql(connection)
        share = "FOR SHARE" if connection.vendor == "postgresql" else "LOCK IN SHARE MODE"
        sql = f"SELECT 1 FROM {TABLE} WHERE name = %s AND token = %s AND expire_at > {now} {share}"
        return sql, [req.row, req.token]

    def loss_reason(self, req: Request) -> str:
        """Why ``req``'s lease is no longer the caller's, from what its row says now.

        One read, only after an extend, release or check has failed: the
        row's token was cleared (force-released in the admin or with
        ``dlock_release``), belongs to someone else (taken over after the
        lease ran out), is still the caller's but expired (nobody took it),
        or the row is gone (deleted).
        """
        found = read(
            req.alias,
            f"SELECT token, CASE WHEN expire_at > {{now}} THEN 1 ELSE 0 END "
            f"FROM {TABLE} WHERE name = %s",
            [req.row],
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

    def busy_reason(self, alias: str, key: Key) -> str:
        """Why a newcomer could not take ``key`` (one read, after a try failed).

        A lease is refused while it runs, and also when it is free but live
        tickets of other waiters are queued ahead (they are served first).
        """
        found = read(
            alias,
            f"SELECT CASE WHEN EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s "
            f"AND expire_at > {{now}}) THEN 1 ELSE 0 END, "
            f"CASE WHEN EXISTS (SELECT 1 FROM {queue.WAITERS} WHERE name = %s "
            f"AND expire_at > {{now}}) THEN 1 ELSE 0 END",
            [key.name, key.name],
        )
        if found is not None and not found[0] and found[1]:
            return QUEUED_AHEAD
        return HELD

    def seconds_left(self, alias: str, key: Key) -> float:
        """Seconds until the current lease of ``key`` ends (<= 0: free now)."""
        found = read(alias, f"SELECT {{left}} FROM {TABLE} WHERE name = %s", [key.name])
        return -1.0 if found is None or found[0] is None else float(found[0])


lease = LeaseStrategy()
_implements_strategy: Strategy = lease  # (checked by mypy)
_takes_tickets: TakesTickets = lease  # (checked by mypy)
_guards: Guards = lease  # (checked by mypy)
_counts_permits: CountsPermits = lease  # (checked by mypy)
_shares_apart: SharesApart = lease  # (checked by mypy)
