"""The waiter queue of the ``lease`` strategy: first come, first served.

A caller that finds a lease key held takes a *ticket*: a row in the
``django_dlock_waiter`` table whose ``id`` comes from the table's monotonic
sequence. The key then goes to the live ticket with the lowest number (the
*head*) when it is freed, and nobody barges past live tickets: a newcomer's
acquire (also a try-once, ``timeout=0``) checks, in the same statement that
takes the lease, that no live ticket waits for the key; a waiter's acquire
checks that no live ticket is ahead of its own.

Each ticket has a short lease of its own (``expire_at``, judged on the
database clock like every lease, ``DLOCK_QUEUE_TICKET_TTL`` seconds), renewed
by its waiter at the latest halfway through it. A waiter that dies (a killed
process, a lost connection) stops renewing: its ticket runs out,
is skipped, and ``dlock_cleanup`` removes it. A waiter that times out or is
cancelled deletes its ticket.

Wake-ups on PostgreSQL: a release sends ``pg_notify`` only when the key has
live tickets, addressed to the head's ticket alone (payload
``django-dlock-ticket:<id>``), so one waiter wakes, not the herd. Elsewhere
waiters poll at the retry policy's interval, still in ticket order.

A waiter never sleeps through a free key. Under PostgreSQL's default
isolation (read committed) a statement sees the rows committed when it
*started*, so a release that started just before a new ticket was committed
would not see it, send nothing, and leave that waiter asleep until its next
timed look. Two things close this race; they serialise the release and the
ticket on the key's row:

* the ticket is inserted in a statement that also sets ``queued`` on the
  key's row (creating a free row if there is none), which holds the row
  locked until the ticket is committed;
* a release (also a force-release, and cleanup of dead tickets) first
  updates the row, then looks for the head in the function
  ``django_dlock_wake_head``, a ``VOLATILE`` PL/pgSQL function: each query
  in it takes a fresh snapshot (see "Function Volatility Categories" in the
  PostgreSQL documentation), taken after the row was locked. A plain
  release looks only if the row, as it is once locked, says ``queued``:
  a ticket committed while the release waited for the row has set it.

The flag spares the queue to the many keys nobody waits for: an acquire
reads the queue only when the key's row is flagged, and a release wakes
only then. The acquire that finds the row flagged clears the flag once no
ticket (live or run out) is left, asking ``django_dlock_queued`` (a fresh
snapshot again, after the row is locked). A ticket never waits for a key
whose row is unflagged: rows are deleted only by ``dlock_cleanup``, which
keeps a row with a live ticket, and whose delete skips a row changed by a
ticket meanwhile. A semaphore's queue is flagged on each of its permit
rows: a ticket flags them all, a permit's release wakes the head when its
row is flagged, and a take reads the queue when any of them is.

If the release locked the row first, the ticket's statement waits until the
release is committed, so the waiter's first look, made after its ticket is
in and its wake-up registered, sees the key free. If the ticket locked the
row first, the release waits until the ticket is committed, and its fresh
snapshot sees the ticket and wakes it. Either way the waiter learns that the
key is free at once.

The same lock closes a cleanup race: ``dlock_cleanup`` deletes a free row
only if no live ticket waits for its key (and, on PostgreSQL, only the row
version it judged: one a ticket has flagged meanwhile stays), and on SQLite
and MySQL/MariaDB an acquire that *creates* a key's row checks for live
tickets too, in the same statement. A newcomer therefore never barges past
a ticket committed before it looked, whether the key's row exists or not.

A ticket taken by ``Lock.enqueue()`` is renewed by a keeper thread of the
process until its owner calls ``wait()``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock
from django_dlock.strategies.base import Request
from django_dlock.strategies.connection import (
    again_if_deadlocked,
    cursor,
    execute,
    fetch_one,
    with_reconnect,
)
from django_dlock.tables import LOCK_TABLE, WAITER_TABLE
from django_dlock.validation import ticket_ttl_error

logger = logging.getLogger("django_dlock")

WAITERS = WAITER_TABLE
LOCKS = LOCK_TABLE
CHANNEL = "django_dlock"
#: payload prefix of a wake-up addressed to one ticket (lock names are namespaced)
WAKE_PREFIX = "django-dlock-ticket:"
#: the ticket number of a caller without a ticket: every live ticket is ahead of it
NEWCOMER = 2**62


def ticket_ttl() -> float:
    """Seconds a ticket stays live without renewal (``DLOCK_QUEUE_TICKET_TTL``, default 6).

    Raises:
        ValueError: the setting is not a number of seconds > 0.
    """
    value = getattr(settings, "DLOCK_QUEUE_TICKET_TTL", 6.0)
    problem = ticket_ttl_error(value)
    if problem is not None:
        raise ValueError(f"the DLOCK_QUEUE_TICKET_TTL setting is invalid: {problem}")
    return float(value)


def renew_every() -> float:
    """How often a waiter renews its ticket (and looks at least): a quarter of its TTL,
    so that a ticket is renewed at the latest halfway through its lease."""
    return ticket_ttl() / 4


def wake_payload(ticket: int) -> str:
    return f"{WAKE_PREFIX}{ticket}"


def none_ahead_sql(connection: BaseDatabaseWrapper, name: str) -> str:
    """SQL: no live ticket for the key named by ``name`` (a column) is below ``%s``."""
    now = dbclock.now_sql(connection)
    return (
        f"NOT EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = {name} "
        f"AND w.expire_at > {now} AND w.id < %s)"
    )


#: PostgreSQL: wake the head of ``{name}``'s queue; the head's ticket (NULL when
#: nobody waits). A function (migration 0004) that reads the queue with a
#: snapshot of its own, taken after the caller locked the key's row.
PG_WAKE_HEAD = "django_dlock_wake_head({name})"
#: PostgreSQL: does any ticket (live or run out) but ``{besides}`` wait for
#: ``{name}``? A function (migration 0007) with a snapshot of its own, like
#: the wake-up's.
PG_QUEUED = "django_dlock_queued({name}, {besides})"
#: PostgreSQL: is a live ticket below ``{ticket}`` waiting for ``{name}``? A
#: function (migration 0009) that reads with the caller's snapshot: the
#: question of :func:`none_ahead_sql`, which an acquire asks only when the
#: key's row is flagged. As a subquery, PostgreSQL would set it up (open the
#: waiter table and its index) at every execution, also when not asked.
PG_AHEAD = "django_dlock_ahead({name}, {ticket})"

# PostgreSQL: a ticket is inserted in the statement that sets ``queued`` on
# the key's row (creating a free row if there is none), so it waits for a
# release in flight, a release waits for it and then sees the flag, and an
# acquire or cleanup waiting for the row sees it changed. A semaphore's
# ticket flags each of its permit rows, in their order (two tickets lock
# them in the same order), since each permit's release wakes the queue.
_PG_FLAG = f"""
INSERT INTO {LOCKS} AS l (name, token, owner, fence, expire_at, queued)
SELECT n, '', '', 0, statement_timestamp(), true FROM unnest(%s::text[]) AS n
ON CONFLICT (name) DO UPDATE SET queued = true
RETURNING 1
"""
# A ticket put back by its waiter (cleanup had removed it): the rows that
# are still there are flagged again.
_PG_REFLAG = f"UPDATE {LOCKS} SET queued = true WHERE name = ANY(%s) RETURNING 1"
_PG_ENQUEUE = f"""
WITH held AS ({_PG_FLAG})
INSERT INTO {WAITERS} (name, token, owner, enqueued_at, expire_at)
SELECT %s, %s, %s, statement_timestamp(), statement_timestamp() + %s * interval '1 second'
FROM (SELECT count(*) FROM held) AS h
RETURNING id
"""


def flagged_rows(req: Request) -> list[str]:
    """The lease rows whose ``queued`` flag tells that somebody may wait for
    ``req``'s key: the key's own row, or a semaphore's permit rows."""
    return list(req.queue_rows) if req.queue_rows else [req.key.name]


def enqueue(req: Request) -> int:
    """Take a ticket for ``req``'s key; its number."""
    ttl = ticket_ttl()

    def run(connection: BaseDatabaseWrapper) -> int:
        if connection.vendor == "postgresql":
            flagged = [flagged_rows(req), req.key.name, req.token, req.owner, ttl]
            # (a cleanup may lock a semaphore's permit rows in another order)
            found = again_if_deadlocked(
                connection, lambda: fetch_one(connection, _PG_ENQUEUE, flagged)
            )
            return int(found[0])
        now = dbclock.now_sql(connection)
        now_plus = dbclock.now_plus_sql(connection)
        params: list[Any] = [req.key.name, req.token, req.owner, ttl]
        sql = (
            f"INSERT INTO {WAITERS} (name, token, owner, enqueued_at, expire_at) "
            f"VALUES (%s, %s, %s, {now}, {now_plus})"
        )
        if connection.vendor == "mysql":
            with cursor(connection) as cur:
                cur.execute(sql, params)
                return int(cur.lastrowid)
        row = fetch_one(connection, sql + " RETURNING id", params)
        return int(row[0])

    ticket, _ = with_reconnect(req.alias, run)
    _count(ticket)
    return ticket


# -- this process's tickets, counted in the dlock_waiters gauge -------------------

#: ticket -> the metrics gauge it was counted in (None: metrics were off)
_mine: dict[int, Any] = {}
_mine_mutex = threading.Lock()


def _count(ticket: int) -> None:
    from django_dlock import metrics

    observer = metrics.observer
    gauge = observer.waiters if observer is not None else None
    with _mine_mutex:
        _mine[ticket] = gauge
    if gauge is not None:
        gauge.inc()


def done(ticket: int) -> None:
    """A ticket of this process ended (granted, given up): it no longer counts."""
    with _mine_mutex:
        if ticket not in _mine:
            return
        gauge = _mine.pop(ticket)
    if gauge is not None:
        gauge.dec()


def waiting_here() -> int:
    """How many tickets this process holds now (callers waiting in a lease queue)."""
    with _mine_mutex:
        return len(_mine)


def beat(req: Request, ticket: int) -> None:
    """Renew a ticket's lease; put it back (same number) if it was removed meanwhile."""

    def run(connection: BaseDatabaseWrapper) -> None:
        now = dbclock.now_sql(connection)
        now_plus = dbclock.now_plus_sql(connection)
        _, count = execute(
            connection,
            f"UPDATE {WAITERS} SET expire_at = {now_plus} WHERE id = %s",
            [ticket_ttl(), ticket],
        )
        if count:
            return
        # Cleaned up after it ran out (the waiter was stalled): same place.
        sql = (
            f"INSERT INTO {WAITERS} (id, name, token, owner, enqueued_at, expire_at) "
            f"VALUES (%s, %s, %s, %s, {now}, {now_plus})"
        )
        params = [ticket, req.key.name, req.token, req.owner, ticket_ttl()]
        if connection.vendor == "postgresql":  # the key's row says so again, if it is there
            sql, params = f"WITH flagged AS ({_PG_REFLAG}) {sql}", [flagged_rows(req), *params]
        again_if_deadlocked(connection, lambda: execute(connection, sql, params))

    with_reconnect(req.alias, run)


def forget(connection: BaseDatabaseWrapper, ticket: int) -> None:
    """Delete a granted ticket (SQLite, MySQL/MariaDB; PostgreSQL does it in the acquire)."""
    execute(connection, f"DELETE FROM {WAITERS} WHERE id = %s", [ticket])


_PG_LEAVE = f"""
WITH gone AS (DELETE FROM {WAITERS} WHERE id = %s RETURNING id, name)
SELECT pg_notify('{CHANNEL}', '{WAKE_PREFIX}' || head.id)
FROM gone CROSS JOIN LATERAL (
    SELECT w.id FROM {WAITERS} w
    WHERE w.name = gone.name AND w.id <> gone.id AND w.expire_at > statement_timestamp()
    ORDER BY w.id LIMIT 1
) head
WHERE NOT EXISTS (
    SELECT 1 FROM {LOCKS} l WHERE l.name = gone.name AND l.expire_at > statement_timestamp()
)
"""


def leave(alias: str, ticket: int) -> None:
    """Give a place up (timeout, cancellation, error): delete the ticket.

    On PostgreSQL, if the key is free, the next waiter is woken in the same
    statement (the leaver may have been the head).
    """

    def run(connection: BaseDatabaseWrapper) -> None:
        if connection.vendor == "postgresql":
            execute(connection, _PG_LEAVE, [ticket])
        else:
            forget(connection, ticket)

    done(ticket)
    try:
        with_reconnect(alias, run)
    except Exception:
        # The ticket runs out on its own within its TTL.
        logger.exception("django-dlock: could not delete waiter ticket %s", ticket)


def waiters(alias: str, names: Iterable[str] | None) -> list[tuple[str, int, str, Any, bool]]:
    """The queue of each key (``None``: of every key): ``(name, ticket, owner,
    enqueued_at, live)`` in ticket order."""
    from django.db.models import BooleanField, Case, Value, When

    from django_dlock.dbclock import DbNow
    from django_dlock.models import Waiter

    found = Waiter.objects.using(alias).all()
    if names is not None:
        found = found.filter(name__in=list(names))
    rows = (
        found.annotate(
            live=Case(
                When(expire_at__gt=DbNow(), then=Value(True)),
                default=Value(False),
                output_field=BooleanField(),
            )
        )
        .order_by("name", "id")
        .values_list("name", "id", "owner", "enqueued_at", "live")
    )
    return list(rows)


# -- the keeper: renews tickets taken by enqueue() until wait() -----------------


class _Kept:
    """A ticket the keeper renews: its request, whether its place is still
    wanted, and a lock held while the keeper works on it."""

    def __init__(self, req: Request, wanted: Callable[[], bool]) -> None:
        self.req = req
        self.wanted = wanted
        self.busy = threading.Lock()


class _Keeper:
    """A daemon thread that renews the tickets of callers between enqueue() and wait()."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        #: ticket -> what the keeper needs to renew it
        self.tickets: dict[int, _Kept] = {}
        self.changed = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, req: Request, ticket: int, wanted: Callable[[], bool]) -> None:
        """Renew ``ticket`` until :meth:`remove`, or until ``wanted()`` is false.

        A place nobody wants any more (the thread or task that took it ended
        without ``wait()``, the lock object was dropped, the place ran out)
        is given up: its ticket is deleted, so it blocks nobody.
        """
        with self.mutex:
            self.tickets[ticket] = _Kept(req, wanted)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="django-dlock-ticket-keeper", daemon=True
                )
                self.thread.start()

    def remove(self, ticket: int) -> bool:
        """Stop renewing ``ticket``; returns once no renewal of it is in flight.

        The caller is about to use the ticket (``wait()``) or delete it: a
        renewal still running could otherwise put back a ticket that was
        just granted or deleted, and that ghost would block the free key for
        a whole ticket lifetime. ``False`` if the keeper had given the place
        up already (nobody wanted it): the ticket is gone.
        """
        with self.mutex:
            kept = self.tickets.pop(ticket, None)
            if not self.tickets:
                self.changed.set()  # let the thread end (and close its connection) now
        if kept is None:
            return False
        with kept.busy:
            return True

    def _run(self) -> None:
        try:
            while True:
                self.changed.wait(renew_every())
                with self.mutex:
                    self.changed.clear()
                    found = list(self.tickets.items())
                    if not found:
                        self.thread = None
                        return
                for ticket, kept in found:
                    self._keep(ticket, kept)
        finally:
            connections.close_all()

    def _keep(self, ticket: int, kept: _Kept) -> None:
        """Renew one ticket, or give it up if its place is no longer wanted."""
        with kept.busy:  # remove() waits for this
            with self.mutex:
                if self.tickets.get(ticket) is not kept:
                    return  # removed meanwhile: the ticket is its owner's again
                orphan = not kept.wanted()
                if orphan:
                    del self.tickets[ticket]
            try:
                if orphan:
                    leave(kept.req.alias, ticket)
                else:
                    beat(kept.req, ticket)
            except Exception as exc:
                logger.warning("django-dlock: could not renew waiter ticket %s: %s", ticket, exc)


keeper = _Keeper()


def _after_fork_in_child() -> None:
    global keeper, _mine_mutex
    keeper = _Keeper()
    _mine.clear()  # the parent's waiters
    _mine_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
