"""The lease queue's races: a release racing a new ticket, and cleanup racing a ticket.

PostgreSQL judges each statement on the rows committed when it started, so
a release that started just before a ticket was committed used to miss it
(no wake-up: the waiter slept until its next timed look), and a key's row
deleted by cleanup while a ticket was being inserted let a newcomer create
a fresh row past the queue. These tests hold one side of each race open in
a transaction of their own and check the other side's outcome, so they
need no timing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import notify
from django_dlock.keys import make_key
from django_dlock.strategies import queue
from django_dlock.strategies.base import Request
from django_dlock.strategies.lease import lease, waiting
from django_dlock.strategies.lease.sql import PG_RELEASE_SQL

from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def _raw(alias: str) -> Any:
    """A psycopg connection of our own to the test database, in a transaction."""
    conn = notify._connect_like(alias)()
    conn.autocommit = False
    return conn


def _blocked_by(alias: str, pid: int) -> bool:
    """Whether some backend waits for a lock held by backend ``pid``."""
    with connections[alias].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [pid]
        )
        return bool(cur.fetchone()[0])


def _request(name: str, token: str, alias: str = "default") -> Request:
    return Request(
        key=make_key(name),
        alias=alias,
        token=token,
        owner=f"test {token}",
        ttl=30,
        row=make_key(name).name,
    )


def _ticket_uncommitted(ticketing: Any, holder: Request) -> int:
    """A waiter's ticket for ``holder``'s key, inserted in ``ticketing``'s
    open transaction (it holds the key's row until committed)."""
    params = [[holder.key.name], holder.key.name, "waiter", "test waiter", 30.0]
    return int(ticketing.execute(queue._PG_ENQUEUE, params).fetchone()[0])


def _in_background(func: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(func())
        except BaseException as exc:  # handed to the test
            out.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_release_waiting_for_a_ticket_wakes_it(pg):
    """The ticket locked the key's row first: the release waits for it and wakes it."""
    holder = _request("race-ticket-first", "holder")
    assert lease.try_acquire(holder) is not None
    listen = notify._connect_like(pg)()
    listen.execute(f"LISTEN {queue.CHANNEL}")
    ticketing = _raw(pg)
    try:
        ticket = _ticket_uncommitted(ticketing, holder)
        # The release starts now, before the ticket is committed...
        thread, out = _in_background(lambda: lease.release(holder))
        wait_until(lambda: _blocked_by(pg, ticketing.info.backend_pid))
        ticketing.commit()
        thread.join(30)
        assert out == [True]
        # ... and still wakes the ticket, addressed to it alone.
        heard = []
        for message in listen.notifies(timeout=10.0, stop_after=1):
            heard.append(message.payload)
        assert heard == [queue.wake_payload(ticket)]
    finally:
        ticketing.close()
        listen.close()


def test_a_ticket_waits_for_a_release_in_flight(pg):
    """The release locked the key's row first: the ticket is taken after it
    commits, so the waiter's first look sees the key free."""
    holder = _request("race-release-first", "holder")
    waiter = _request("race-release-first", "waiter")
    assert lease.try_acquire(holder) is not None
    releasing = _raw(pg)
    try:
        params = [holder.key.name, holder.token, holder.key.name]
        found = releasing.execute(PG_RELEASE_SQL[True], params).fetchone()
        assert found is not None  # released, not yet committed
        thread, out = _in_background(lambda: queue.enqueue(waiter))
        wait_until(lambda: _blocked_by(pg, releasing.info.backend_pid))
        releasing.commit()
        thread.join(30)
        (ticket,) = out
        assert isinstance(ticket, int)
        look = waiting.look(waiter, ticket)
        assert look.left <= 0 and not look.ahead
        assert lease.try_acquire(waiter, ticket) is not None
    finally:
        releasing.close()
    assert lease.release(waiter)


def test_no_barging_when_the_keys_row_is_gone(alias):
    """A live ticket waits for a key whose row cleanup deleted: a newcomer's
    try-once must not create a fresh row past it; the ticket is served."""
    waiter = _request("race-no-row", "waiter", alias)
    ticket = queue.enqueue(waiter)
    with connections[alias].cursor() as cur:
        cur.execute("SELECT queued FROM django_dlock_lock WHERE name = %s", [waiter.key.name])
        found = list(cur.fetchall())
    # PostgreSQL: the ticket made the key's row, free and flagged; elsewhere
    # there is no row, and the newcomer's insert looks at the queue itself
    assert found == ([(True,)] if connections[alias].vendor == "postgresql" else [])
    assert dlock.lock("race-no-row", using=alias).acquire(timeout=0) is False
    assert lease.try_acquire(_request("race-no-row", "newcomer", alias)) is None
    fence = lease.try_acquire(waiter, ticket)
    assert fence is not None
    # Re-acquiring one's own live lease still works while others wait (a
    # new grant: a new fencing number).
    other = queue.enqueue(_request("race-no-row", "second", alias))
    again = lease.try_acquire(waiter)
    assert again is not None and again > fence
    assert lease.release(waiter)
    queue.leave(alias, other)


def test_cleanup_keeps_a_free_row_with_a_live_ticket_and_the_ticket_is_served(alias):
    from django_dlock.cleanup import delete_free

    holder = dlock.lock("race-cleanup", using=alias, ttl=30)
    assert holder.acquire(timeout=0)
    waiter = _request("race-cleanup", "waiter", alias)
    ticket = queue.enqueue(waiter)
    holder.release()
    delete_free(using=alias)
    assert dlock.lock("race-cleanup", using=alias).acquire(timeout=0) is False
    assert lease.try_acquire(waiter, ticket) is not None
    assert lease.release(waiter)


# -- PostgreSQL: the key's row says whether anybody may wait -------------------


def _queued(alias: str, name: str) -> Any:
    with connections[alias].cursor() as cur:
        cur.execute("SELECT queued FROM django_dlock_lock WHERE name = %s", [name])
        return cur.fetchone()[0]


def test_a_key_nobody_waits_for_is_never_flagged(pg):
    holder = _request("flag-none", "holder")
    assert lease.try_acquire(holder) is not None
    assert lease.release(holder)
    assert not _queued(pg, holder.key.name)


def test_the_flag_stays_while_a_ticket_is_left_and_goes_with_the_last(pg):
    holder = _request("flag-last", "holder")
    first, second = _request("flag-last", "first"), _request("flag-last", "second")
    assert lease.try_acquire(holder) is not None
    tickets = [queue.enqueue(first), queue.enqueue(second)]
    assert _queued(pg, holder.key.name) is True
    # nobody barges past the tickets, not even the holder's next try
    assert lease.release(holder)
    assert lease.try_acquire(_request("flag-last", "newcomer")) is None
    assert lease.try_acquire(second, tickets[1]) is None  # not its turn
    assert lease.try_acquire(first, tickets[0]) is not None
    assert _queued(pg, holder.key.name) is True  # the second still waits
    assert lease.release(first)
    assert lease.try_acquire(second, tickets[1]) is not None
    assert not _queued(pg, holder.key.name)
    assert lease.release(second)


def test_a_newcomer_clears_the_flag_a_leaver_left(pg):
    holder = _request("flag-leaver", "holder")
    assert lease.try_acquire(holder) is not None
    queue.leave(pg, queue.enqueue(_request("flag-leaver", "leaver")))
    assert _queued(pg, holder.key.name) is True
    assert lease.release(holder)
    newcomer = _request("flag-leaver", "newcomer")
    assert lease.try_acquire(newcomer) is not None
    assert not _queued(pg, holder.key.name)
    assert lease.release(newcomer)


def test_a_cleanup_waiting_for_a_ticket_keeps_the_keys_row(pg):
    """The cleanup judged the free row before the ticket was committed, then
    waited for the row: it must not delete it, or a newcomer would create a
    fresh row past the ticket."""
    from django_dlock.cleanup import delete_free

    holder = _request("flag-cleanup", "holder")
    assert lease.try_acquire(holder) is not None
    assert lease.release(holder)
    ticketing = _raw(pg)
    try:
        ticket = _ticket_uncommitted(ticketing, holder)
        thread, out = _in_background(lambda: delete_free(using=pg))
        wait_until(lambda: _blocked_by(pg, ticketing.info.backend_pid))
        ticketing.commit()
        thread.join(30)
        assert out == [0]
    finally:
        ticketing.close()
    assert _queued(pg, holder.key.name) is True
    assert lease.try_acquire(_request("flag-cleanup", "newcomer")) is None
    waiter = _request("flag-cleanup", "waiter")
    assert lease.try_acquire(waiter, ticket) is not None
    assert lease.release(waiter)


# -- PostgreSQL: a semaphore's permit rows say whether anybody may wait ---------


def _permit_request(name: str, token: str, alias: str = "default") -> Request:
    key = make_key(name, "semaphore")
    return Request(key=key, alias=alias, token=token, owner=f"test {token}", ttl=30, row=key.name)


def _flags(alias: str, name: str) -> dict[str, Any]:
    with connections[alias].cursor() as cur:
        cur.execute(
            "SELECT name, queued FROM django_dlock_lock WHERE name LIKE %s", [f"semaphore:{name}#%"]
        )
        return {row[0].rpartition("#")[2]: bool(row[1]) for row in cur.fetchall()}


def test_a_semaphores_ticket_flags_every_permit_row_until_the_queue_is_empty(pg):
    from django_dlock.strategies.lease.permits import permit_strategy

    sem = permit_strategy(2)
    holders = [_permit_request("flag-sem", f"holder{i}") for i in range(2)]
    assert all(sem.try_acquire(holder) is not None for holder in holders)
    assert _flags(pg, "flag-sem") == {"0": False, "1": False}
    first, second = _permit_request("flag-sem", "first"), _permit_request("flag-sem", "second")
    tickets = [sem.enqueue(first), sem.enqueue(second)]
    assert _flags(pg, "flag-sem") == {"0": True, "1": True}
    # two permits free, two tickets ahead: a newcomer waits its turn
    assert sem.release(holders[0]) and sem.release(holders[1])
    assert sem.try_acquire(_permit_request("flag-sem", "newcomer")) is None
    assert sem.try_acquire(first, tickets[0]) is not None
    assert _flags(pg, "flag-sem") == {"0": True, "1": True}  # the second still waits
    assert sem.try_acquire(second, tickets[1]) is not None
    assert first.row == "semaphore:flag-sem#0" and second.row == "semaphore:flag-sem#1"
    assert _flags(pg, "flag-sem") == {"0": True, "1": False}  # the last grant cleared its row
    assert sem.release(first)
    newcomer = _permit_request("flag-sem", "newcomer")
    assert sem.try_acquire(newcomer) is not None  # clears the flag the queue left on row 0
    assert _flags(pg, "flag-sem") == {"0": False, "1": False}
    assert sem.release(newcomer) and sem.release(second)


def test_a_permits_release_wakes_the_queue_only_when_its_row_is_flagged(pg):
    from django_dlock.strategies.lease.permits import permit_strategy

    sem = permit_strategy(1)
    listen = notify._connect_like(pg)()
    listen.execute(f"LISTEN {queue.CHANNEL}")
    try:
        alone = _permit_request("wake-sem", "alone")
        assert sem.try_acquire(alone) is not None and sem.release(alone)
        holder = _permit_request("wake-sem", "holder")
        assert sem.try_acquire(holder) is not None
        waiter = _permit_request("wake-sem", "waiter")
        ticket = sem.enqueue(waiter)
        assert sem.release(holder)
        heard = [m.payload for m in listen.notifies(timeout=10.0, stop_after=1)]
        # the first release (nobody queued) sent nothing: the only wake-up is the waiter's
        assert heard == [queue.wake_payload(ticket)]
        assert sem.try_acquire(waiter, ticket) is not None and sem.release(waiter)
    finally:
        listen.close()


def test_cleanup_keeps_a_semaphores_flagged_permit_rows_while_a_ticket_is_live(pg):
    from django_dlock.cleanup import delete_free
    from django_dlock.strategies.lease.permits import permit_strategy

    sem = permit_strategy(1)
    holder = _permit_request("clean-sem", "holder")
    assert sem.try_acquire(holder) is not None and sem.release(holder)
    waiter = _permit_request("clean-sem", "waiter")
    ticket = sem.enqueue(waiter)
    delete_free(using=pg)
    assert _flags(pg, "clean-sem") == {"0": True}
    assert sem.try_acquire(_permit_request("clean-sem", "newcomer")) is None
    queue.leave(pg, ticket)
    delete_free(using=pg)
    assert _flags(pg, "clean-sem") == {}  # no ticket left: free rows go, flags and all


# -- PostgreSQL: a ticket and a cleanup that lock permit rows in opposite orders ----


def _free_rows(alias: str, names: list[str]) -> None:
    """Free rows, long expired, lying in the table in the order of ``names``."""
    with connections[alias].cursor() as cur:
        for name in names:
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, expire_at, queued) "
                "VALUES (%s, '', '', 1, now() - interval '1 hour', false)",
                [name],
            )
        cur.execute("SELECT name FROM django_dlock_lock ORDER BY ctid")
        assert [row[0] for row in cur.fetchall()] == names


def _waiting(alias: str) -> int:
    """How many backends of the test database wait for a lock another one holds."""
    with connections[alias].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND cardinality(pg_blocking_pids(pid)) > 0"
        )
        return int(cur.fetchone()[0])


def _deadlock_timeout(alias: str) -> float:
    with connections[alias].cursor() as cur:
        cur.execute("SELECT extract(epoch FROM current_setting('deadlock_timeout')::interval)")
        return float(cur.fetchone()[0])


@pytest.mark.parametrize("victim", ["cleanup", "ticket"])
def test_a_ticket_and_a_cleanup_locking_permit_rows_in_opposite_orders_both_finish(pg, victim):
    """A ticket flags a semaphore's permit rows in slot order; a cleanup batch
    deletes free rows in the order they lie in the table. Locking them in
    opposite orders, the two deadlock, and PostgreSQL rolls back the one that
    began waiting last: neither caller may see the deadlock. A third session
    holds one row so that the two lock theirs in that order; each case makes
    the other side the victim."""
    from django_dlock.cleanup import delete_free
    from django_dlock.strategies.lease.permits import permit_strategy

    permit = [f"semaphore:dead-sem#{i}" for i in range(3)]
    if victim == "cleanup":
        # the cleanup deletes permit 1, then waits for the row between (held);
        # the ticket flags permit 0, then waits for permit 1 (the cleanup's);
        # the row between freed, the cleanup waits for permit 0 (the ticket's)
        sem, held = permit_strategy(2), "lock:dead-sem-between"
        _free_rows(pg, [permit[1], held, permit[0]])
    else:
        # the ticket flags permit 0, then waits for permit 1 (held); the
        # cleanup deletes permit 2, then waits for permit 0 (the ticket's);
        # permit 1 freed, the ticket waits for permit 2 (the cleanup's)
        sem, held = permit_strategy(3), permit[1]
        _free_rows(pg, [permit[2], permit[0], permit[1]])
    holding = _raw(pg)
    try:
        holding.execute("SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE", [held])
        waiter = _permit_request("dead-sem", "waiter")
        first, second = (
            (lambda: delete_free(using=pg), lambda: sem.enqueue(waiter))
            if victim == "cleanup"
            else (lambda: sem.enqueue(waiter), lambda: delete_free(using=pg))
        )
        threads = []
        for step in (first, second):
            threads.append(_in_background(step))
            waiting = len(threads)
            wait_until(lambda: _waiting(pg) == waiting)  # noqa: B023 (called at once)
        # PostgreSQL looks for a deadlock once per wait, deadlock_timeout after
        # the wait began: with both looks done, the one that waits next is the victim
        time.sleep(_deadlock_timeout(pg) + 0.5)
        holding.rollback()
        for thread, _ in threads:
            thread.join(30)
    finally:
        holding.close()
    (cleaned,), (ticketed,) = (out for _, out in threads[:: 1 if victim == "cleanup" else -1])
    assert isinstance(cleaned, int), cleaned
    assert isinstance(ticketed, int), ticketed
    # the ticket waits, its semaphore's every permit row flagged, and is served
    assert _flags(pg, "dead-sem") == {str(i): True for i in range(sem.permits)}
    assert sem.try_acquire(waiter, ticketed) is not None
    assert sem.release(waiter)
